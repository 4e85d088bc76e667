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
    """LLM(**kwargs) takes exactly EngineArgs' fields; generate and serve have a flag for
    each, with EngineArgs' default."""
    import dataclasses

    from keel.engine.arg_utils import EngineArgs

    for argv in (["generate", "x"], ["serve"], ["chat"]):
        args = build_parser().parse_args(argv)
        kwargs = engine_kwargs(args)
        assert set(kwargs) == set(EngineArgs.field_names())
        assert kwargs == dataclasses.asdict(EngineArgs()), argv


def test_bad_flag_is_a_clear_error(capsys, hf_model_dir):
    rc = main(["generate", "--model", hf_model_dir("qwen3"), "--block-size", "12", "Hello"])
    assert rc == 2
    assert "block_size must be a positive power of two" in capsys.readouterr().err


def test_sampling_flags_reach_the_request(capsys, hf_model_dir):
    rc = main(["generate", "--model", hf_model_dir("qwen3"), "--dtype", "float32", "--no-chat",
               "--max-tokens", "4", "--ignore-eos", "--n", "2", "--temperature", "0.8",
               "--min-p", "0.01", "--presence-penalty", "0.5", "--frequency-penalty", "0.2",
               "--repetition-penalty", "1.1", "--logprobs", "2", "--stop", "zzz", "Hello"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0
    completions = [line for line in lines if line.startswith("'Hello'")]
    assert [c.split(" ->")[0] for c in completions] == ["'Hello' [0]", "'Hello' [1]"]
    # Each completion is followed by one line per token: the sampled token plus the top 2.
    logprob_lines = [line for line in lines if line.startswith("    ")]
    assert len(logprob_lines) == 8
    assert all(2 <= line.count("(#") <= 3 for line in logprob_lines)


def test_bad_sampling_flag_is_a_clear_error(capsys, hf_model_dir):
    rc = main(["generate", "--model", hf_model_dir("qwen3"), "--top-p", "1.5", "Hello"])
    assert rc == 2
    assert "top_p must be a number in (0, 1], got 1.5" in capsys.readouterr().err


def test_structured_output_flags(capsys, hf_model_dir):
    import re

    rc = main(["generate", "--model", hf_model_dir("qwen3"), "--dtype", "float32", "--no-chat",
               "--temperature", "1.0", "--max-tokens", "20", "--regex", "[0-9]{3}-[a-c]{2}",
               "Hello"])
    out = capsys.readouterr().out.strip()
    assert rc == 0
    assert re.fullmatch(r"'Hello' -> '[0-9]{3}-[a-c]{2}'", out), out
    rc = main(["generate", "--model", hf_model_dir("qwen3"), "--grammar", 'root ::= "a', "Hi"])
    assert rc == 2
    assert "Invalid grammar in structured_outputs: EBNF lexer error" in capsys.readouterr().err
