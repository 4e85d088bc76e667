"""EngineArgs: every engine option in one place. `LLM(**kwargs)`, `AsyncLLM` and the CLI
(`keel generate`, `keel serve`) all build their EngineConfig from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from keel.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

USAGE_CONTEXTS = ("llm_class", "openai_api_server", "engine_context")


@dataclass
class EngineArgs:
    model: str | None = None  # HF folder or .gguf file; None: the default model
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    # None: vLLM-CPU's default for the entry point (default_max_num_batched_tokens below).
    max_num_batched_tokens: int | None = None
    block_size: int | None = None  # None: config.default_block_size (32 or 16)
    kv_cache_memory_gib: float | None = None
    kv_cache_dtype: str = "auto"  # auto | float32 | bfloat16 | int8 (see CacheConfig.cache_dtype)
    num_gpu_blocks_override: int | None = None
    distributed_executor_backend: str | type | None = None
    seed: int = 0
    device: str = "auto"
    threads: int | None = None
    gpu_memory_utilization: float = 0.9
    max_logprobs: int = 20
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    speculative_config: dict | None = None  # e.g. {"method": "ngram", "num_speculative_tokens": 3}
    trace_path: str | None = None  # record each step's persistent batch (keel trace view)
    runner: str = "auto"  # "generate" | "pooling" (embeddings) | "auto" (from the folder)
    quantization: str | None = "auto"  # gguf | int8 | int4 | w8a8 | None; auto: a .gguf stays
    quantization_group_size: int | None = None

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def default_max_num_batched_tokens(self, usage_context: str) -> int:
        """vLLM's CPU default: 4,096 tokens a step for the offline `LLM` class, 2,048 for a
        server (shorter steps keep streaming latency down), times the world size. On the long
        prompts of benchmarks/vs_vllm.py in bfloat16, 4,096 made keel's prompt steps ~6%
        faster than 2,048 on average (fewer steps, fewer prompts cut across two; level in
        float32; BENCHMARKS.md, thirty-ninth round)."""
        if usage_context not in USAGE_CONTEXTS:
            raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, got "
                             f"{usage_context!r}.")
        per_rank = 4096 if usage_context == "llm_class" else 2048
        # A bad size is ParallelConfig's to refuse by name, not this product's.
        return per_rank * max(self.tensor_parallel_size, 1) * max(self.pipeline_parallel_size, 1)

    def create_engine_config(self, usage_context: str = "engine_context") -> EngineConfig:
        """usage_context: "llm_class" (the offline `LLM`), "openai_api_server" or
        "engine_context" (anything else): it picks the default token budget, as in vLLM."""
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = self.default_max_num_batched_tokens(usage_context)
        return EngineConfig(
            model_config=ModelConfig(
                model=self.model, dtype=self.dtype, max_model_len=self.max_model_len,
                seed=self.seed, device=self.device, max_logprobs=self.max_logprobs,
                runner=self.runner, quantization=self.quantization,
                quantization_group_size=self.quantization_group_size,
            ),
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_gib=self.kv_cache_memory_gib,
                cache_dtype=self.kv_cache_dtype,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                async_scheduling=self.async_scheduling,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
            ),
            threads=self.threads,
            speculative_config=SpeculativeConfig.from_dict(self.speculative_config),
            trace_path=None if self.trace_path is None else str(self.trace_path),
        )
