"""`keel generate` and `keel embed`, in process: real text from the default model, embeddings
equal to LLM.embed, every flag reaches LLM, and a bad flag is a clear error with exit code 2."""

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

    for argv in (["generate", "x"], ["serve"], ["chat"], ["embed", "x"]):
        args = build_parser().parse_args(argv)
        kwargs = engine_kwargs(args)
        assert set(kwargs) == set(EngineArgs.field_names())
        expected = dataclasses.asdict(EngineArgs())
        if argv[0] == "embed":
            expected["runner"] = "pooling"  # embed always pools
        assert kwargs == expected, argv
    args = build_parser().parse_args(["serve", "--runner", "pooling"])
    assert engine_kwargs(args)["runner"] == "pooling"


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


def test_embed_equals_llm_embed(capsys):
    """The default embedding model (MiniLM): --json gives LLM.embed's vectors, in order; the
    plain output is one short line per text."""
    import json

    import numpy as np

    from keel import LLM

    texts = ["hello world", "The cat sits on the mat.", "x" * 100]
    rc = main(["embed", "--json", "--dtype", "float32", *texts])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert "minilm" in doc["model"].lower()
    assert [d["index"] for d in doc["data"]] == [0, 1, 2]
    assert [d["text"] for d in doc["data"]] == texts
    llm = LLM(runner="pooling", dtype="float32")
    try:
        expected = llm.embed(texts, use_tqdm=False)
    finally:
        llm.shutdown()
    for d, out in zip(doc["data"], expected):
        np.testing.assert_allclose(d["embedding"], out.outputs.embedding, atol=1e-5)

    rc = main(["embed", "--dtype", "float32", *texts])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0 and len(lines) == 3
    first = ", ".join(f"{x:.4f}" for x in expected[0].outputs.embedding[:4])
    assert lines[0] == f"'hello world' -> 384 dims [{first}, ...]"
    assert lines[2].startswith("'xxxx") and "'... -> 384 dims [" in lines[2]
    assert len(lines[2].split(" -> ")[0]) <= 40


def test_embed_too_long_text_names_the_flag(capsys):
    import json

    long_text = "word " * 400  # past MiniLM's max_model_len of 256
    rc = main(["embed", long_text])
    err = capsys.readouterr().err
    assert rc == 2
    assert "keel: error:" in err and "--truncate-prompt-tokens" in err
    rc = main(["embed", "--json", "--truncate-prompt-tokens", "16", long_text])
    assert rc == 0
    assert len(json.loads(capsys.readouterr().out)["data"][0]["embedding"]) == 384
    rc = main(["embed", "--truncate-prompt-tokens", "0", "hi"])
    assert rc == 2 and "--truncate-prompt-tokens must be" in capsys.readouterr().err
    rc = main(["embed", "--runner", "generate", "hi"])
    assert rc == 2 and "--runner generate" in capsys.readouterr().err


def test_seconds_since_process_start_is_the_process_age():
    """`keel generate` logs its first token against the process's start: the age it reads
    lies between what the process slept and what its parent saw pass (one 10 ms tick of
    slack). Read against the wall clock (/proc/stat's btime) it was up to ~1 s too large."""
    import subprocess
    import sys
    import time

    probe = ("import time; time.sleep(0.5); from keel.utils import seconds_since_process_start; "
             "print(seconds_since_process_start())")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                         text=True).stdout
    elapsed = time.monotonic() - t0
    age = float(out.strip().splitlines()[-1])
    assert 0.5 <= age <= elapsed + 0.02, (age, elapsed)
