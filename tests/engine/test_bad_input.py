"""Bad input gets a clear error and nothing else breaks: each case is followed by a
successful request on the same LLM, and no request or block is left behind."""

from __future__ import annotations

import pytest

from keel import LLM, SamplingParams
from tests.hf_models import VOCAB

OK_PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(hf_model_dir):
    return LLM(hf_model_dir("llama"), dtype="float32", max_model_len=64)


def assert_still_serving(llm):
    scheduler = llm.engine_core.scheduler
    assert not scheduler.has_unfinished_requests()
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}, "Hello"], OK_PARAMS, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", OK_PARAMS, "prompt is empty"),
        ({"prompt_token_ids": []}, OK_PARAMS, "prompt is empty"),
        ({"prompt_token_ids": [3, VOCAB + 5, -1]}, OK_PARAMS, r"outside the vocabulary \[0, 320\)"),
        ({"prompt_token_ids": ["a"]}, OK_PARAMS, "list of integers"),
        ({"prompt_token_ids": list(range(2, 66))}, OK_PARAMS, "too long for max_model_len=64"),
        ({"prompt_token_ids": list(range(2, 42))}, SamplingParams(max_tokens=30),
         "max_tokens=30 cannot fit.*must be <= 24"),
        ({"prompt_token_ids": [5]}, SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        ({"prompt_token_ids": [5]}, SamplingParams(logit_bias={VOCAB: 1.0}),
         r"logit_bias contains token id\(s\) \[320\], outside the vocabulary"),
        ({"prompt_token_ids": [5]}, SamplingParams(allowed_token_ids=[1, 400]),
         "allowed_token_ids contains"),
        ({"prompt_token_ids": [5]}, SamplingParams(logprobs=21), "logprobs=21 .* at most 20"),
        ({"prompt_token_ids": [5]}, SamplingParams(prompt_logprobs=50),
         "prompt_logprobs=50 .* at most 20"),
        (42, OK_PARAMS, "A prompt is a string"),
    ],
)
def test_bad_request_then_good_request(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    assert_still_serving(llm)


def test_one_bad_prompt_in_a_batch_adds_nothing(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [999]}], OK_PARAMS,
                     use_tqdm=False)
    assert_still_serving(llm)


def test_sampling_params_count_mismatch(llm):
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate(["Hello"], [OK_PARAMS, OK_PARAMS], use_tqdm=False)
    assert_still_serving(llm)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
    ],
)
def test_bad_sampling_params(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    assert_still_serving(llm)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(block_size=12), ValueError, "block_size must be a positive power of two"),
        (dict(block_size=16, max_num_batched_tokens=8), ValueError, "smaller than one block"),
        (dict(dtype="float64"), ValueError, "Unknown dtype"),
        (dict(device="tpu"), ValueError, "Unknown device"),
        (dict(max_model_len=4096), ValueError, "max_position_embeddings=512"),
        (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
        (dict(kv_cache_memory_gib=1e-6), ValueError, "raise kv_cache_memory_gib"),
        (dict(num_gpu_blocks_override=3, block_size=16), ValueError, "needs 32"),
        (dict(distributed_executor_backend=3.5), ValueError, "Unknown distributed executor"),
        (dict(tensor_parallel_size=4), ValueError, "must divide the model's 6 attention heads"),
        (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size must be a positive"),
        (dict(pipeline_parallel_size=9), ValueError, "more than the model.s 3 layers"),
    ],
)
def test_bad_engine_options(hf_model_dir, llm, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        LLM(hf_model_dir("llama"), **kwargs)
    assert_still_serving(llm)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.5), r"temperature must be a number >= 0"),
        (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
        (dict(top_k=-2), r"top_k must be an integer >= 1, or 0 / -1"),
        (dict(min_p=-0.1), r"min_p must be a number in \[0, 1\]"),
        (dict(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\]"),
        (dict(frequency_penalty=-3), r"frequency_penalty must be a number in \[-2, 2\]"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be a number > 0"),
        (dict(temperature=float("nan")), r"temperature .* got nan"),
        (dict(top_p=float("inf")), r"top_p .* got inf"),
        (dict(logit_bias={3: float("nan")}), r"logit_bias\[3\] must be a number"),
        (dict(max_tokens=0), r"max_tokens must be an integer >= 1"),
        (dict(min_tokens=8, max_tokens=4), r"min_tokens must be <= max_tokens=4"),
        (dict(n=0), r"n must be an integer >= 1"),
        (dict(logprobs=-1), r"logprobs must be an integer >= 0"),
        (dict(stop=[""]), r"stop must hold non-empty strings"),
        (dict(stop="x", detokenize=False), r"stop strings need detokenize=True"),
        (dict(allowed_token_ids=[]), r"allowed_token_ids must not be empty"),
        (dict(bad_words=[" "]), r"bad_words must hold non-empty strings"),
    ],
)
def test_invalid_sampling_params_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_params_in_a_batch_leave_running_requests_alone(llm):
    """A request with bad parameters is refused at add time while the engine holds others in
    flight; they finish with every token."""
    core = llm.engine_core
    good, _ = llm.input_processor.process("inflight", {"prompt_token_ids": [5, 6, 7]}, OK_PARAMS)
    core.add_request(good)
    core.step()
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate({"prompt_token_ids": [5]}, SamplingParams(logprobs=100), use_tqdm=False)
    tokens = []
    while core.scheduler.has_requests():
        outputs, _ = core.step()
        for out in outputs.get(0).outputs if outputs else ():
            tokens += out.new_token_ids
    assert len(tokens) == 3  # one came with the first step
    assert_still_serving(llm)
