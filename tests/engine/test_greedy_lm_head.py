"""Greedy sampling in the LM head (ParallelLMHead.greedy_token_ids, amx_gemm_argmax,
i16_gemm_argmax): in a step whose every row takes its argmax (greedy, no logits processors, no
logprobs, no drafts, no grammar), a bfloat16 head on keel's AMX GEMM, or dtype="auto"'s head on
i16_gemm, takes each row's token in its epilogue without writing the logits. The tokens must be
the sampler's argmax of those logits (KEEL_GREEDY_LM_HEAD=0), and a step with anything else in
its batch must keep the logits."""

from __future__ import annotations

import pytest

from keel import LLM, SamplingParams
from keel.cpu_ops import get_cpu_ops
from keel.model_executor.layers import amx_choice
from keel.model_executor.layers.vocab_embedding import ParallelLMHead

PROMPTS = [[5, 17, 33, 9, 41, 2, 77, 100, 3, 8] * 3, [60, 61, 62], [1, 2, 3, 4, 5, 6, 7],
           [9, 8, 7], [100, 200, 300, 10, 20], [42] * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# The unwrapped methods (a test that generates twice must not count through the first wrapper).
REAL_GREEDY, REAL_LOGITS = ParallelLMHead.greedy_token_ids, ParallelLMHead.compute_logits


def generate(folder, monkeypatch, on: bool, params, dtype="bfloat16", **engine):
    """(token ids per request, LM-head argmax calls that took the tokens, logits calls)."""
    monkeypatch.setenv("KEEL_GREEDY_LM_HEAD", "1" if on else "0")
    # Decode-sized bfloat16 passes on keel's AMX GEMM where the CPU has it (the engine measures
    # this against oneDNN; fixed here).
    ops = get_cpu_ops()
    if ops is not None and ops.amx_gemm_dense_available():
        monkeypatch.setattr(amx_choice.gc, "_keel_ops", ops)
        monkeypatch.setattr(amx_choice, "_amx_gemm_faster", True)
    calls = {"head": 0, "logits": 0}

    def greedy(self, hidden):
        out = REAL_GREEDY(self, hidden)
        calls["head"] += out is not None
        return out

    def logits(self, hidden, float32=True):
        calls["logits"] += 1
        return REAL_LOGITS(self, hidden, float32)

    monkeypatch.setattr(ParallelLMHead, "greedy_token_ids", greedy)
    monkeypatch.setattr(ParallelLMHead, "compute_logits", logits)
    llm = LLM(folder, dtype=dtype, kv_cache_memory_gib=0.0625, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    del llm
    return [list(o.outputs[0].token_ids) for o in outs], calls


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lm_head_argmax_gives_the_samplers_tokens(arch, hf_model_dir, monkeypatch):
    folder = hf_model_dir(arch)
    on, on_calls = generate(folder, monkeypatch, True, GREEDY)
    off, off_calls = generate(folder, monkeypatch, False, GREEDY)
    assert on == off
    assert off_calls["head"] == 0 and off_calls["logits"] >= 12
    ops = get_cpu_ops()
    if ops is not None and ops.amx_gemm_dense_available():
        # Every step: the prompts' pass and 11 decode passes, no logits at all.
        assert on_calls["head"] >= 12 and on_calls["logits"] == 0, on_calls
    else:  # no AMX GEMM, no copy for the head: the logits as before
        assert on_calls == off_calls


def test_auto_on_int16_products_takes_the_tokens_in_the_head(hf_model_dir, monkeypatch):
    """dtype="auto" with its GEMMs on i16_gemm (chosen here without timing, AMX hidden): every
    greedy step takes its tokens from i16_gemm_argmax, the tokens the sampler takes from the
    logits."""
    from keel import dtypes
    from keel.model_executor.layers import gemm_choice

    monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: False)
    monkeypatch.setattr(gemm_choice, "_fp16_gemm_faster", True)
    folder = hf_model_dir("llama")
    on, on_calls = generate(folder, monkeypatch, True, GREEDY, dtype="auto")
    off, off_calls = generate(folder, monkeypatch, False, GREEDY, dtype="auto")
    assert on == off
    assert off_calls["head"] == 0 and off_calls["logits"] >= 12
    if gemm_choice.low_precision_kind() == "i16":
        assert on_calls["head"] >= 12 and on_calls["logits"] == 0, on_calls
    else:  # fp16_gemm (no argmax epilogue) or no low-precision GEMM: the logits as before
        assert on_calls == off_calls


def test_steps_with_drafts_take_the_targets_argmax_from_the_head(hf_model_dir, monkeypatch):
    """n-gram drafts, every request greedy: the greedy rule compares each draft with its
    target's argmax, so the head takes every row's token (targets and bonus) and no logits are
    made; the tokens are the ones the logits give."""
    folder = hf_model_dir("llama")
    prompts_repeat = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    drafts = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    from keel.worker import sample_step

    verified = {"argmax": 0, "logits": 0}  # steps with drafts, by what the targets came as

    def rejection(target_logits, spec, bonus, meta, target_argmax=None):
        verified["logits" if target_argmax is None else "argmax"] += int(
            spec.num_draft_tokens.sum() > 0)
        return real_rejection(target_logits, spec, bonus, meta, target_argmax)

    real_rejection = sample_step.rejection_sample
    monkeypatch.setattr(sample_step, "rejection_sample", rejection)
    on, on_calls = generate(folder, monkeypatch, True, prompts_repeat, **drafts)
    on_verified = dict(verified)
    off, off_calls = generate(folder, monkeypatch, False, prompts_repeat, **drafts)
    assert verified["logits"] > 0  # drafts were proposed and checked
    plain, _ = generate(folder, monkeypatch, True, prompts_repeat)
    assert on == off == plain
    assert off_calls["head"] == 0 and off_calls["logits"] > 0
    ops = get_cpu_ops()
    if ops is not None and ops.amx_gemm_dense_available():
        assert on_calls["head"] > 0 and on_calls["logits"] == 0, on_calls
        assert on_verified["argmax"] > 0 and on_verified["logits"] == 0, on_verified
    else:
        assert on_calls == off_calls


def test_a_step_with_logprobs_or_sampling_keeps_the_logits(hf_model_dir, monkeypatch):
    """One request that wants logprobs, or samples, in the batch: every step computes the
    logits (that request reads them), and the greedy requests' tokens are unchanged."""
    folder = hf_model_dir("llama")
    base, _ = generate(folder, monkeypatch, True, GREEDY)
    for other in (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
                  SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True)):
        params = [GREEDY] * (len(PROMPTS) - 1) + [other]
        tokens, calls = generate(folder, monkeypatch, True, params)
        assert calls["head"] == 0 and calls["logits"] >= 12, calls
        assert tokens[:-1] == base[:-1]


def test_a_bad_switch_is_named(hf_model_dir, monkeypatch):
    monkeypatch.setenv("KEEL_GREEDY_LM_HEAD", "yes")
    with pytest.raises(ValueError, match="KEEL_GREEDY_LM_HEAD must be 0 or 1"):
        LLM(hf_model_dir("llama"), dtype="bfloat16", kv_cache_memory_gib=0.0625)
