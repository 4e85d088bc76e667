"""`keel generate`, in process: real text from the default model, every flag reaches LLM, and
a bad flag is a clear error with exit code 2."""

from __future__ import annotations

from keel.entrypoints.cli import build_parser, engine_kwargs, main


def test_default_model_answers(capsys, monkeypatch, tmp_path):
    # The GGUF conversion goes to a fresh cache dir, so this also covers a first run.
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path))
    rc = main(["generate", "--max-tokens", "12", "--kv-cache-memory-gib", "0.5",
               "What is the capital of France?"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "'What is the capital of France?' ->" in out
    assert "Paris" in out


def test_tiny_model_without_chat_template(capsys, hf_model_dir):
    rc = main(["generate", "--model", hf_model_dir("qwen3"), "--dtype", "float32",
               "--max-tokens", "5", "--ignore-eos", "--no-chat", "Hello world", "The quick"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and len(lines) == 2
    assert lines[0].startswith("'Hello world' -> ")


def test_every_llm_option_is_a_flag():
    import inspect

    from keel import LLM

    args = build_parser().parse_args(["generate", "x"])
    assert set(engine_kwargs(args)) == set(inspect.signature(LLM).parameters)


def test_bad_flag_is_a_clear_error(capsys, hf_model_dir):
    rc = main(["generate", "--model", hf_model_dir("qwen3"), "--block-size", "12", "Hello"])
    assert rc == 2
    assert "block_size must be a positive power of two" in capsys.readouterr().err
