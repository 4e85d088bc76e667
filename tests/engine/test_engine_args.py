"""EngineArgs' token budget per step: vLLM-CPU's default for each entry point unless given."""

import pytest

from keel.engine.arg_utils import EngineArgs


def test_default_token_budget_follows_the_entry_point():
    args = EngineArgs()
    budgets = {u: args.create_engine_config(u).scheduler_config.max_num_batched_tokens
               for u in ("llm_class", "openai_api_server", "engine_context")}
    assert budgets == {"llm_class": 4096, "openai_api_server": 2048, "engine_context": 2048}
    # Times the world size, as in vLLM.
    assert EngineArgs(tensor_parallel_size=2).default_max_num_batched_tokens("llm_class") == 8192
    assert EngineArgs(pipeline_parallel_size=2).default_max_num_batched_tokens(
        "openai_api_server") == 4096


def test_a_given_budget_is_kept():
    for u in ("llm_class", "openai_api_server"):
        config = EngineArgs(max_num_batched_tokens=64).create_engine_config(u)
        assert config.scheduler_config.max_num_batched_tokens == 64


def test_unknown_usage_context_is_refused():
    with pytest.raises(ValueError, match="usage_context must be one of"):
        EngineArgs().create_engine_config("llm")


def test_llm_and_server_pick_their_contexts(monkeypatch):
    """LLM() builds with "llm_class"; `keel serve` with "openai_api_server"."""
    from keel.engine import arg_utils, llm
    from keel.entrypoints.openai import api_server

    seen = []

    def spy(self, usage_context="engine_context"):
        seen.append(usage_context)
        raise RuntimeError("stop here")

    monkeypatch.setattr(arg_utils.EngineArgs, "create_engine_config", spy)
    with pytest.raises(RuntimeError, match="stop here"):
        llm.LLM()
    with pytest.raises(RuntimeError, match="stop here"):
        api_server.run_server(EngineArgs())
    assert seen == ["llm_class", "openai_api_server"]


def test_block_size_is_32_for_a_bfloat16_cache_on_the_cpu(hf_model_dir):
    """Unless one is named: 32 tokens a KV block where the cache is bfloat16 on the CPU (its
    decode attention reads each head's keys of a block as one run), else 16; a named size is
    kept."""
    import torch

    from keel.config import default_block_size

    folder = str(hf_model_dir("llama"))

    def cache(**kw):
        args = EngineArgs(model=folder, device="cpu", **kw)
        cc = args.create_engine_config("llm_class").cache_config
        return cc.kv_torch_dtype, cc.block_size

    assert cache(dtype="bfloat16") == (torch.bfloat16, 32)
    assert cache(dtype="float32", kv_cache_dtype="bfloat16") == (torch.bfloat16, 32)
    assert cache(dtype="float32", kv_cache_dtype="float32") == (torch.float32, 16)
    assert cache(dtype="bfloat16", kv_cache_dtype="int8") == (torch.int8, 16)
    assert cache(dtype="bfloat16", block_size=16) == (torch.bfloat16, 16)
    assert cache(dtype="float32", block_size=64) == (torch.float32, 64)
    assert default_block_size(torch.device("cuda"), torch.bfloat16) == 16
    assert default_block_size(torch.device("cpu"), torch.float16) == 16
