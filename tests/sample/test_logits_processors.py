"""Each sampling transformation on the same logits as its oracle: transformers' logits
processors of the same name (temperature, top-k, top-p, min-p, repetition penalty), and a NumPy
reference for presence/frequency penalties, logit bias, allowed ids, bad words and min_tokens.

The metadata is built the way the engine builds it: requests with SamplingParams are added to a
real InputBatch, which fills its per-row arrays and refresh_metadata() makes the
SamplingMetadata the sampler reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf

from keel.sample.sampler import Sampler, apply_top_k_top_p
from keel.sampling_params import SamplingParams
from keel.worker.input_batch import CachedRequestState, InputBatch

VOCAB, MAX_REQS, MAX_LEN = 64, 8, 48
NEG_INF = float("-inf")


def batch_with(params: list[SamplingParams], prompts=None, outputs=None) -> InputBatch:
    rng = np.random.default_rng(0)
    batch = InputBatch(MAX_REQS, MAX_LEN, 64, 4, torch.device("cpu"), vocab_size=VOCAB)
    for i, sp in enumerate(params):
        prompt = prompts[i] if prompts else rng.integers(0, VOCAB, 6).tolist()
        out = outputs[i] if outputs else rng.integers(0, VOCAB, 5).tolist()
        batch.add_request(CachedRequestState(
            req_id=f"r{i}", prompt_token_ids=prompt, sampling_params=sp, generator=None,
            block_ids=([0] * 12,), num_computed_tokens=len(prompt) + len(out) - 1,
            output_token_ids=out,
        ))
    batch.condense()
    batch.refresh_metadata()
    return batch


def random_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def assert_same_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same masked positions (-inf), and the same values elsewhere."""
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-6, atol=1e-6)


def filled(params: SamplingParams, stop_ids=(), bad_words_ids=()) -> SamplingParams:
    """What InputProcessor does when a request is added (stop ids, bad-word ids)."""
    params = params.clone()
    params._all_stop_token_ids = set(stop_ids)
    params._bad_words_token_ids = [list(w) for w in bad_words_ids]
    return params


# ---- against transformers ----------------------------------------------------------------------


@pytest.mark.parametrize("t", [0.3, 1.0, 1.7])
def test_temperature_matches_transformers(t):
    logits = random_logits(3)
    batch = batch_with([SamplingParams(temperature=t)] * 3)
    meta = batch.sampling_metadata
    got = logits.clone().div_(meta.temperature.unsqueeze(1))
    want = tf.TemperatureLogitsWarper(t)(None, logits.clone())
    assert_same_logits(got, want)


@pytest.mark.parametrize("k", [1, 5, 40])
def test_top_k_matches_transformers(k):
    logits = random_logits(4, seed=k)
    meta = batch_with([SamplingParams(temperature=1.0, top_k=k)] * 4).sampling_metadata
    got = apply_top_k_top_p(logits.clone(), meta.top_k, meta.top_p)
    want = tf.TopKLogitsWarper(k)(None, logits.clone())
    assert_same_logits(got, want)


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.99])
def test_top_p_matches_transformers(p):
    logits = random_logits(4, seed=int(p * 100))
    meta = batch_with([SamplingParams(temperature=1.0, top_p=p)] * 4).sampling_metadata
    got = apply_top_k_top_p(logits.clone(), meta.top_k, meta.top_p)
    want = tf.TopPLogitsWarper(p)(None, logits.clone())
    assert_same_logits(got, want)


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5])
def test_min_p_matches_transformers(min_p):
    """Rows 0 and 2 set min_p, row 1 does not (and must be untouched)."""
    from keel.sample.logits_processors import apply_min_p

    logits = random_logits(3, seed=3)
    params = [SamplingParams(temperature=1.0, min_p=min_p), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, min_p=min_p)]
    meta = batch_with(params).sampling_metadata
    got = apply_min_p(logits.clone(), *meta.min_p)
    want = tf.MinPLogitsWarper(min_p)(None, logits.clone())
    want[1] = logits[1]
    assert_same_logits(got, want)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    """transformers penalises every id in input_ids: here, prompt + output, as vLLM does."""
    prompts = [[1, 2, 3, 3, 9], [5, 6], [7, 7, 7]]
    outputs = [[4, 9, 10], [6, 11, 12, 13], [20]]
    batch = batch_with([SamplingParams(repetition_penalty=penalty)] * 3, prompts, outputs)
    logits = random_logits(3, seed=5)
    got = Sampler(MAX_REQS).apply_logits_processors(logits.clone(), batch.sampling_metadata)
    proc = tf.RepetitionPenaltyLogitsProcessor(penalty)
    for row in range(3):
        ids = torch.tensor([prompts[row] + outputs[row]])
        want = proc(ids, logits[row : row + 1].clone())
        assert_same_logits(got[row : row + 1], want)


def test_top_k_and_top_p_together_match_transformers_in_sequence():
    logits = random_logits(3, seed=11)
    meta = batch_with([SamplingParams(temperature=1.0, top_k=10, top_p=0.8)] * 3).sampling_metadata
    got = apply_top_k_top_p(logits.clone(), meta.top_k, meta.top_p)
    want = tf.TopPLogitsWarper(0.8)(None, tf.TopKLogitsWarper(10)(None, logits.clone()))
    assert_same_logits(got, want)


def test_mixed_rows_each_get_their_own_settings():
    """One batch, rows with different top-k / top-p / none: each row equals transformers with
    that row's own setting (rows without a setting are untouched)."""
    settings = [dict(top_k=3), dict(top_p=0.6), dict(), dict(top_k=7, top_p=0.9)]
    logits = random_logits(4, seed=2)
    meta = batch_with([SamplingParams(temperature=1.0, **s) for s in settings]).sampling_metadata
    got = apply_top_k_top_p(logits.clone(), meta.top_k, meta.top_p)
    for row, s in enumerate(settings):
        want = logits[row : row + 1].clone()
        if "top_k" in s:
            want = tf.TopKLogitsWarper(s["top_k"])(None, want)
        if "top_p" in s:
            want = tf.TopPLogitsWarper(s["top_p"])(None, want)
        assert_same_logits(got[row : row + 1], want)


# ---- against NumPy -----------------------------------------------------------------------------


def test_presence_and_frequency_penalties_match_numpy():
    prompts = [[1, 2, 3], [4, 4], [8]]
    outputs = [[3, 3, 5, 6], [7], [8, 8, 8, 9]]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(),  # no penalty: its row must be untouched
              SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5)]
    batch = batch_with(params, prompts, outputs)
    logits = random_logits(3, seed=7)
    got = Sampler(MAX_REQS).apply_logits_processors(logits.clone(), batch.sampling_metadata)
    want = logits.numpy().copy()
    for row, sp in enumerate(params):
        counts = np.bincount(outputs[row], minlength=VOCAB)  # output tokens only
        want[row] -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)


def test_logit_bias_matches_numpy():
    params = [SamplingParams(logit_bias={3: 5.0, 10: -100.0}), SamplingParams(),
              SamplingParams(logit_bias={0: 1.5})]
    batch = batch_with(params)
    logits = random_logits(3, seed=8)
    got = Sampler(MAX_REQS).apply_logits_processors(logits.clone(), batch.sampling_metadata)
    want = logits.numpy().copy()
    for row, sp in enumerate(params):
        for tok, bias in (sp.logit_bias or {}).items():
            want[row, tok] += bias
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)


def test_allowed_token_ids_match_numpy():
    params = [SamplingParams(allowed_token_ids=[1, 5, 9]), SamplingParams(),
              SamplingParams(allowed_token_ids=[63])]
    batch = batch_with(params)
    logits = random_logits(3, seed=9)
    got = Sampler(MAX_REQS).apply_logits_processors(logits.clone(), batch.sampling_metadata)
    want = logits.numpy().copy()
    for row, sp in enumerate(params):
        if sp.allowed_token_ids is not None:
            keep = np.zeros(VOCAB, bool)
            keep[sp.allowed_token_ids] = True
            want[row, ~keep] = NEG_INF
    np.testing.assert_array_equal(got.numpy(), want)


def test_bad_words_single_and_multi_token_match_numpy():
    """A one-token bad word is always banned; a multi-token one only when the row's latest
    outputs are its prefix (prompt tokens do not count)."""
    bad = [[4], [7, 8, 9], [30, 31]]
    outputs = [[1, 7, 8], [2, 3, 30], [6, 7, 8, 9]]
    prompts = [[7, 8], [30], [1]]
    params = [filled(SamplingParams(bad_words=["x"]), bad_words_ids=bad)] * 2 + [SamplingParams()]
    batch = batch_with(params, prompts, outputs)
    logits = random_logits(3, seed=10)
    got = Sampler(MAX_REQS).apply_logits_processors(logits.clone(), batch.sampling_metadata)

    want = logits.numpy().copy()
    for row in range(2):
        for seq in bad:
            prefix = seq[:-1]
            if not prefix or outputs[row][-len(prefix):] == prefix:
                want[row, seq[-1]] = NEG_INF
    np.testing.assert_array_equal(got.numpy(), want)
    assert got[0, 9] == NEG_INF and got[0, 31] != NEG_INF  # [7, 8] -> 9 banned
    assert got[1, 31] == NEG_INF and got[1, 9] != NEG_INF  # [30] -> 31 banned


def test_min_tokens_masks_stop_ids_until_reached():
    outputs = [[1, 2], [1, 2, 3, 4, 5], [1]]
    params = [filled(SamplingParams(min_tokens=4), stop_ids={0, 9}),  # 2 < 4: masked
              filled(SamplingParams(min_tokens=4), stop_ids={0, 9}),  # 5 >= 4: free
              filled(SamplingParams(min_tokens=2), stop_ids={12})]
    batch = batch_with(params, outputs=outputs)
    logits = random_logits(3, seed=12)
    got = Sampler(MAX_REQS).apply_logits_processors(logits.clone(), batch.sampling_metadata)
    want = logits.numpy().copy()
    want[0, [0, 9]] = NEG_INF
    want[2, 12] = NEG_INF
    np.testing.assert_array_equal(got.numpy(), want)


def test_all_greedy_batch_is_one_argmax():
    meta = batch_with([SamplingParams(temperature=0.0)] * 3).sampling_metadata
    assert meta.all_greedy and meta.no_processing and meta.max_num_logprobs is None
    assert meta.min_p is None and meta.penalties is None and meta.history is None
    logits = random_logits(3)
    out = Sampler(MAX_REQS)(logits.clone(), meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1)) and out.logprobs is None


def test_greedy_rows_see_processed_logits():
    """Greedy picks the argmax after the logits processors (a bias can force a token)."""
    meta = batch_with([SamplingParams(temperature=0.0, logit_bias={17: 100.0})]).sampling_metadata
    out = Sampler(MAX_REQS)(random_logits(1), meta)
    assert out.sampled_token_ids.tolist() == [17]


def test_logprobs_are_raw_and_ranked():
    """Logprobs come from the raw logits (before penalties / temperature), the sampled token
    first with its rank, then the batch's largest top-k."""
    params = [SamplingParams(temperature=0.0, logprobs=3, logit_bias={5: 50.0}),
              SamplingParams(temperature=0.0, logprobs=1),
              SamplingParams(temperature=0.7, min_p=0.2)]  # asks for none: not computed
    meta = batch_with(params).sampling_metadata
    assert meta.max_num_logprobs == 3 and meta.logprobs_rows.tolist() == [0, 1]
    logits = random_logits(3, seed=4)
    raw = logits.log_softmax(-1)[:2]
    out = Sampler(MAX_REQS)(logits.clone(), meta)
    lp = out.logprobs.slice(0, 2)
    assert out.logprobs.logprobs.shape == (3, 4)
    assert lp.logprob_token_ids[0, 0] == 5  # forced by the bias
    np.testing.assert_allclose(lp.logprobs[0, 0], raw[0, 5].item(), rtol=1e-6)
    assert lp.ranks[0] == int((raw[0] >= raw[0, 5]).sum())
    top = raw.topk(3, dim=-1)
    np.testing.assert_array_equal(lp.logprob_token_ids[:, 1:], top.indices.numpy())
    np.testing.assert_allclose(lp.logprobs[:, 1:], top.values.numpy(), rtol=1e-6)
    assert lp.ranks[1] == 1  # greedy without processing: the top token


def test_top_k_top_p_on_a_large_vocabulary_candidates_and_full_sort():
    """vocab 5000 > the 256 candidates: peaked rows are decided among the candidates, flat
    rows (nucleus wider than 256 tokens) fall back to the full sort, rows with top-k only or
    top-p only or neither share the batch; every row equals transformers' warpers."""
    vocab = 5000
    g = torch.Generator().manual_seed(1)
    scales = [8.0, 0.05, 8.0, 0.05, 3.0, 3.0, 1.0]  # 8: peaked, 0.05: nearly flat
    settings = [(0, 0.9), (0, 0.9), (50, 0.8), (400, 0.95), (300, 1.0), (0, 1.0), (0, 0.5)]
    logits = torch.cat([torch.randn(1, vocab, generator=g) * sc for sc in scales])
    top_k = torch.tensor([k for k, _ in settings])
    top_p = torch.tensor([p for _, p in settings])
    got = apply_top_k_top_p(logits.clone(), top_k, top_p)
    for row, (k, p) in enumerate(settings):
        want = logits[row : row + 1].clone()
        if k:
            want = tf.TopKLogitsWarper(k)(None, want)
        if p < 1:
            want = tf.TopPLogitsWarper(p)(None, want)
        assert_same_logits(got[row : row + 1], want)
    survivors = (~torch.isinf(got)).sum(-1).tolist()
    assert survivors[1] > 256 and survivors[0] < 256  # both paths were taken
