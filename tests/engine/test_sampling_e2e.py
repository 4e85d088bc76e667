"""Sampling through the whole engine on small random models (float32), against transformers:
seeded requests independent of their company, chunking and preemption; one step's empirical
distribution against the softmax of the processed logits; logprobs of generated and prompt
tokens against transformers' log_softmax; stop strings, n, min_tokens, logit bias, allowed ids
and bad words."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf

from keel import LLM, SamplingParams
from tests.hf_models import hf_reference
from tests.model_executor.test_models import hf_greedy, random_prompt


@pytest.fixture(scope="module")
def folder(hf_model_dir):
    return hf_model_dir("llama")


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, dtype="float32")


@pytest.fixture(scope="module")
def hf(folder):
    return hf_reference(folder)


def ids(prompt: list[int]) -> dict:
    return {"prompt_token_ids": prompt}


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ---- seeded requests ---------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=4321, max_tokens=12,
                        ignore_eos=True, presence_penalty=0.3, repetition_penalty=1.1)


def test_seeded_request_is_independent_of_company_chunking_and_preemption(folder, llm):
    prompt = random_prompt(45, seed=77)
    alone = tokens_of(llm.generate(ids(prompt), SEEDED, use_tqdm=False))[0]
    assert len(alone) == 12

    # Beside 15 other requests (random, greedy, other seeds), in the middle of the batch.
    others = [ids(random_prompt(5 + 3 * i, seed=i)) for i in range(15)]
    other_params = [SamplingParams(temperature=1.0 if i % 2 else 0.0, max_tokens=12,
                                   seed=i if i % 3 == 0 else None, ignore_eos=True)
                    for i in range(15)]
    crowd = llm.generate(others[:7] + [ids(prompt)] + others[7:],
                         other_params[:7] + [SEEDED] + other_params[7:], use_tqdm=False)
    assert crowd[7].outputs[0].token_ids == alone

    chunked = LLM(folder, dtype="float32", max_num_batched_tokens=16)
    assert tokens_of(chunked.generate(ids(prompt), SEEDED, use_tqdm=False))[0] == alone

    # Few KV blocks: the seeded request is preempted (recomputed) at least once.
    tight = LLM(folder, dtype="float32", max_model_len=128, num_gpu_blocks_override=8)
    crowd = tight.generate([ids(random_prompt(60, seed=5)), ids(prompt)],
                           [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                            SEEDED], use_tqdm=False)
    assert tight.engine_core.scheduler.num_preemptions > 0
    assert crowd[1].outputs[0].token_ids == alone


# ---- one step's distribution -------------------------------------------------------------------


@pytest.mark.parametrize("params, warpers", [
    (dict(temperature=1.5, top_p=0.6), [tf.TemperatureLogitsWarper(1.5),
                                        tf.TopPLogitsWarper(0.6)]),
    (dict(temperature=1.2, min_p=0.15), [tf.TemperatureLogitsWarper(1.2),
                                         tf.MinPLogitsWarper(0.15)]),
    (dict(temperature=2.0, top_k=6), [tf.TemperatureLogitsWarper(2.0),
                                      tf.TopKLogitsWarper(6)]),
])
def test_one_step_distribution_matches_processed_softmax(llm, hf, params, warpers):
    """3000 one-token draws from the same prompt: no token outside the allowed set is ever
    drawn, and the empirical distribution is within total-variation 0.06 of softmax(processed
    logits) (sampling noise is ~0.02 here; a wrong top-p / min-p / top-k boundary moves whole
    tokens in or out and fails one check or the other)."""
    prompt = random_prompt(6, seed=3)
    draws = 3000
    outs = llm.generate([ids(prompt)] * draws, SamplingParams(max_tokens=1, **params),
                        use_tqdm=False)
    counts = np.bincount([o.outputs[0].token_ids[0] for o in outs], minlength=hf.vocab_size)

    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[:, -1].float()
    for warp in warpers:
        logits = warp(None, logits)
    expected = logits.softmax(-1)[0].numpy()
    assert counts[expected == 0].sum() == 0, "drew a token the processors exclude"
    assert (expected > 0).sum() > 2  # the test has a real distribution to compare
    tv = 0.5 * np.abs(counts / draws - expected).sum()
    assert tv < 0.06, f"total variation {tv:.3f}"


# ---- logprobs against transformers -------------------------------------------------------------


def hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: row i is the log-distribution of token i + 1 given tokens 0..i."""
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("chunk", [None, 16])
def test_logprobs_match_transformers(folder, hf, chunk):
    kwargs = {} if chunk is None else dict(max_num_batched_tokens=chunk)
    llm = LLM(folder, dtype="float32", **kwargs)
    prompts = [random_prompt(n, seed=n) for n in (5, 21, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=4,
                            prompt_logprobs=3)
    outputs = llm.generate([ids(p) for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        assert completion.token_ids == hf_greedy(hf, prompt, 6)
        ref = hf_logprobs(hf, prompt + completion.token_ids)

        # Generated tokens: the sampled one (rank 1, greedy) plus the top 4.
        assert len(completion.logprobs) == 6
        total = 0.0
        for i, (tok, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = ref[len(prompt) - 1 + i]
            top = row.topk(4)
            assert set(entry) == {tok, *top.indices.tolist()}
            assert entry[tok].rank == 1
            for t, lp in entry.items():
                assert abs(lp.logprob - row[t].item()) < 1e-4
            total += entry[tok].logprob
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)

        # Prompt tokens: None for the first, then the prompt token's own logprob + top 3.
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for i in range(1, len(prompt)):
            row = ref[i - 1]
            tok = prompt[i]
            assert tok in plp[i] and len(plp[i]) >= 3
            assert abs(plp[i][tok].logprob - row[tok].item()) < 1e-4
            assert plp[i][tok].rank == int((row >= row[tok]).sum())
            for t in row.topk(3).indices.tolist():
                assert abs(plp[i][t].logprob - row[t].item()) < 1e-4


# ---- stop strings, n, min_tokens, bias, allowed ids, bad words --------------------------------


def test_stop_string_split_across_tokens(llm):
    """Pick a stop string that starts inside one generated token and ends inside the next:
    the text ends right before it (or right after, with include_stop_str_in_output), and the
    engine stops generating there. Generation is limited to clean word tokens (a random model
    otherwise emits stray bytes), which allowed_token_ids does."""
    tok = llm.tokenizer
    words = [t for t in range(len(tok)) if tok.decode([t]).strip().isalpha()
             and len(tok.decode([t])) >= 2]
    base = dict(temperature=0, max_tokens=24, allowed_token_ids=words)
    prompt = "The quick brown fox"
    full = llm.generate(prompt, SamplingParams(ignore_eos=True, **base),
                        use_tqdm=False)[0].outputs[0]
    pieces = [tok.decode([t]) for t in full.token_ids]
    assert "".join(pieces) == full.text

    def split_stop(i):  # last character of token i + first of token i + 1
        start = len("".join(pieces[: i + 1])) - 1
        return start, full.text[start : start + 2]

    i = next(i for i in range(1, len(pieces) - 1)
             if full.text.find(split_stop(i)[1]) == split_stop(i)[0])
    start, stop = split_stop(i)
    out = llm.generate(prompt, SamplingParams(stop=[stop], **base), use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:start]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[: i + 2]  # generation stopped right there
    out = llm.generate(prompt, SamplingParams(stop=[stop], include_stop_str_in_output=True,
                                              **base), use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[: start + 2]
    # The engine freed the stopped request at once.
    assert not llm.engine_core.scheduler.has_unfinished_requests()


def test_n_completions(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    out = llm.generate(ids(random_prompt(9, seed=1)), params, use_tqdm=False)
    assert len(out) == 1
    completions = out[0].outputs
    assert [c.index for c in completions] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in completions)
    assert len({tuple(c.token_ids) for c in completions}) > 1  # different samples
    again = llm.generate(ids(random_prompt(9, seed=1)), params, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in again] == [c.token_ids for c in completions]
    assert out[0].request_id == out[0].request_id and out[0].finished


def test_min_tokens_holds_back_eos(llm):
    eos = llm.tokenizer.eos_token_id
    force_eos = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100.0})
    out = llm.generate(ids([5, 6, 7]), force_eos, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    force_eos.min_tokens = 5
    out = llm.generate(ids([5, 6, 7]), force_eos, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos
    assert eos not in out.token_ids[:5] and out.finish_reason == "stop"


def test_logit_bias_allowed_ids_and_bad_words(llm):
    prompt = ids(random_prompt(8, seed=2))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    base = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids

    forced = greedy.clone()
    forced.logit_bias = {42: 100.0}
    assert llm.generate(prompt, forced, use_tqdm=False)[0].outputs[0].token_ids == [42] * 10

    allowed = [3, 50, 77, 123]
    out = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True,
                                              allowed_token_ids=allowed), use_tqdm=False)
    toks = out[0].outputs[0].token_ids
    assert set(toks) <= set(allowed) and len(set(toks)) > 1

    # A bad word made of the first greedy token: it never appears, and the output changes.
    word = llm.tokenizer.decode([base[0]])
    banned = llm.input_processor._bad_words_token_ids([word])
    assert [base[0]] in banned or any(len(b) > 1 for b in banned)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                              bad_words=[word]), use_tqdm=False)[0].outputs[0]
    single = {b[0] for b in banned if len(b) == 1}
    assert not single & set(out.token_ids)
    assert out.token_ids != base


def test_prompt_logprobs_survive_preemption(folder):
    """A preempted request recomputes its prompt; its prompt logprobs are still sent once
    each, equal to a run without preemption."""
    prompt = random_prompt(45, seed=77)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)
    calm = LLM(folder, dtype="float32").generate(ids(prompt), params, use_tqdm=False)[0]
    tight = LLM(folder, dtype="float32", max_model_len=128, num_gpu_blocks_override=8)
    crowd = tight.generate([ids(random_prompt(60, seed=5)), ids(prompt)],
                           [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                            params], use_tqdm=False)
    assert tight.engine_core.scheduler.num_preemptions > 0
    got = crowd[1].prompt_logprobs
    assert len(got) == len(prompt) == len(calm.prompt_logprobs)
    for a, b in zip(got[1:], calm.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert crowd[1].outputs[0].token_ids == calm.outputs[0].token_ids


def test_chat_options(llm):
    tok = llm.tokenizer
    convs = [[{"role": "user", "content": "Hello world!"}],
             [{"role": "user", "content": "The quick brown fox"}]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with_prompt = llm.chat(convs, params, use_tqdm=False)
    without = llm.chat(convs[0], params, use_tqdm=False, add_generation_prompt=False)
    assert len(with_prompt) == 2 and len(without) == 1
    assert with_prompt[0].prompt.endswith("assistant: ")
    assert not without[0].prompt.endswith("assistant: ")
    for conv, out in zip(convs, with_prompt):
        assert out.prompt_token_ids == tok.apply_chat_template(
            conv, add_generation_prompt=True, tokenize=True, return_dict=False)
    # chat_template_kwargs reach the template.
    original = tok.chat_template
    tok.chat_template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        out = llm.chat(convs[0], params, use_tqdm=False,
                       chat_template_kwargs={"greeting": "Hi! "})[0]
    finally:
        tok.chat_template = original
    assert out.prompt == "Hi! Hello world!"
