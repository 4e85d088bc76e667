"""Engine configuration: model, cache, scheduler, parallelism, and the whole (EngineConfig).

Every check here is about something a user typed (a flag, a model folder), so failures raise
`ValueError` / `FileNotFoundError` with a message that says what to change.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from keel import dtypes

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"Unknown device {device!r}: use 'auto', 'cpu' or 'cuda'.")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here: use 'cpu' or 'auto'.")
    return torch.device(device)


@dataclass
class ModelConfig:
    """What to load and how. `model` is a HF folder, a `.gguf` file, or None (default model)."""

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    device: str = "auto"
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for
    # "generate", "pooling" (embeddings: LLM.embed), or "auto": pooling for a
    # sentence-transformers folder or a bare `*Model` architecture (BertModel, Qwen3Model).
    runner: str = "auto"
    # Weights kept quantized in memory (keel/model_executor/quantize_model.py): "auto" (a
    # .gguf file's own 4-bit blocks, else none), "gguf", "int8", "int4", "w8a8" (int8
    # weights and activations, lossy), or None / "none".
    quantization: str | None = "auto"
    quantization_group_size: int | None = None  # int4's group (default: 128, 64 or 32)
    # Filled in by __post_init__.
    model_path: Path = field(init=False)
    hf_config: Any = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False)
    torch_device: torch.device = field(init=False)
    runner_type: str = field(init=False)  # "generate" | "pooling"
    pooler_config: Any = field(init=False, default=None)  # PoolerConfig when pooling
    is_encoder_only: bool = field(init=False, default=False)
    quantization_method: str | None = field(init=False, default=None)
    # The KV cache's dtype under kv_cache_dtype="auto" (set with torch_dtype).
    auto_kv_cache_dtype: torch.dtype = field(init=False)
    # Whether a float32 model's GEMMs may run on float16 FMAs (dtypes.auto_float16_gemms).
    float16_gemms: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        from keel.model_executor.hf_config import load_hf_config
        from keel.model_executor.models import resolve_architecture

        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"Unknown runner {self.runner!r}: use auto, generate or pooling.")
        self.torch_device = resolve_device(self.device)
        if self.model is None and self.runner == "pooling":
            from keel.model_executor.default_model import default_embedding_model_path

            self.model_path = default_embedding_model_path()
        else:
            self.model_path = resolve_model_path(self.model)
        self.hf_config = load_hf_config(self.model_path)
        cls = resolve_architecture(self.hf_config)  # fail early on an unsupported one
        self._resolve_runner(cls)
        self.torch_dtype = dtypes.checkpoint_dtype(self.dtype, self.hf_config, self.torch_device)
        self._resolve_quantization()
        # keel/dtypes.py: what dtype="auto" computes in on this CPU, and keeps the K/V in
        where = (self.torch_device, self.runner_type, self.quantization_method)
        self.torch_dtype = dtypes.auto_compute_dtype(self.dtype, self.torch_dtype, *where)
        self.auto_kv_cache_dtype = dtypes.auto_kv_cache_dtype(self.dtype, self.torch_dtype, *where)
        self.float16_gemms = dtypes.auto_float16_gemms(self.dtype, self.torch_dtype, *where)
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        limit = min(limit, self._sentence_transformers_max_len() or limit)
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}.")
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}.")
        elif self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's "
                f"max_position_embeddings={limit}: pass a value <= {limit}."
            )

    def _resolve_runner(self, cls: type) -> None:
        from keel.model_executor.layers.pooler import resolve_pooler_config
        from keel.model_executor.models import POOLING_ONLY

        archs = list(getattr(self.hf_config, "architectures", None) or [])
        if any(a.endswith("ForSequenceClassification") for a in archs):
            raise NotImplementedError(
                f"{archs[0]}: classification heads are not implemented in keel yet; an "
                "embedding model (BertModel, a sentence-transformers folder) or a decoder "
                "works.")
        pooling_only = bool(POOLING_ONLY & set(archs))
        runner = self.runner
        if runner == "auto":
            st_folder = (self.model_path / "modules.json").is_file()
            runner = "pooling" if pooling_only or st_folder else "generate"
        if runner == "generate" and pooling_only:
            raise ValueError(f"{archs[0]} has no LM head: it cannot generate. Use it with "
                             "runner='pooling' (LLM.embed, keel embed).")
        self.runner_type = runner
        self.is_encoder_only = bool(getattr(cls, "is_encoder_only", False))
        if runner == "pooling":
            self.pooler_config = resolve_pooler_config(self.model_path, self.is_encoder_only)

    def _resolve_quantization(self) -> None:
        from keel.model_executor.gguf_loader import TYPES_FILE

        q = self.quantization
        from_gguf = (self.model_path / TYPES_FILE).is_file()
        if q in (None, "none"):
            method = None
        elif q == "auto":  # a .gguf file (the default model is one) stays quantized
            gguf_given = self.model is None or str(self.model).endswith(".gguf")
            method = "gguf" if gguf_given and from_gguf else None
        elif q == "gguf" and not from_gguf:
            raise ValueError("quantization='gguf' needs a .gguf model file: for a Hugging Face "
                             "folder use 'int8' or 'int4'.")
        elif q in ("gguf", "int8", "int4", "w8a8"):
            method = q
        else:
            raise ValueError(f"Unknown quantization {q!r}: use auto, gguf, int8, int4, w8a8 "
                             "or none.")
        g = self.quantization_group_size
        if g is not None and (method != "int4" or g not in (32, 64, 128)):
            raise ValueError(f"quantization_group_size={g}: only with quantization='int4', "
                             "and one of 32, 64, 128.")
        if method is not None and self.torch_device.type != "cpu":
            raise NotImplementedError(f"quantization={method!r} runs on the CPU kernels torch "
                                      "ships; on CUDA pass quantization=None.")
        if method is not None and self.torch_dtype == torch.float16:
            raise ValueError("Quantized weights compute in float32 or bfloat16: pick one.")
        self.quantization_method = method

    def _sentence_transformers_max_len(self) -> int | None:
        """A sentence-transformers folder's `max_seq_length` (its encode() truncates there)."""
        path = self.model_path / "sentence_bert_config.json"
        if self.runner_type != "pooling" or not path.is_file():
            return None
        try:
            value = json.loads(path.read_text()).get("max_seq_length")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        return value if isinstance(value, int) and value > 0 else None

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """None -> the default model; a `.gguf` file -> its cached HF folder; else a HF folder."""
    from keel.model_executor.gguf_loader import resolve_gguf

    if model is None:
        from keel.model_executor.default_model import default_model_path

        return resolve_gguf(default_model_path())
    path = Path(model).expanduser()
    if str(path).endswith(".gguf"):
        return resolve_gguf(path)
    if not path.exists():
        raise FileNotFoundError(
            f"Model {str(model)!r} not found: pass a Hugging Face model folder or a .gguf file "
            "(keel never downloads weights)."
        )
    if not path.is_dir():
        raise ValueError(f"Model {str(path)!r} is a file but not a .gguf: pass a model folder.")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"Model folder {str(path)!r} has no config.json.")
    return path


def default_block_size(device: torch.device, kv_dtype: torch.dtype) -> int:
    """Tokens per KV block where none is named: 32 for a bfloat16 cache on the CPU, else 16
    (vLLM's GPU default). keel's CPU decode attention reads each KV head's keys of a block as
    one run, and a block's successor is seldom next to it in memory once requests grow by
    decoding. Over 64 rows of bfloat16 caches (30 layers' caches, 45-175 and 364-864 keys, 2
    cores of a Zen 4), blocks of 32 ran 0.84-0.93x the time of 16 with bfloat16 queries and
    0.89-1.00x with float32 ones (`auto`); least where the blocks were contiguous, most where
    laid out as decoding leaves them; the AVX2 build (KEEL_CPU_MARCH=znver3, on the same host)
    0.86-0.97x. A float32 cache's kernel goes 16 keys at a time: with blocks of 32 it read
    1.05-1.08x slower where they were contiguous (0.95-0.98x where scattered), so it keeps 16
    (BENCHMARKS.md, sixty-fifth round)."""
    if device.type == "cpu" and kv_dtype == torch.bfloat16:
        return 32
    return 16


@dataclass
class CacheConfig:
    block_size: int | None = None  # tokens per KV block; None: default_block_size
    kv_cache_memory_gib: float | None = None  # None: a modest share of available memory
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True  # as in vLLM v1
    # The K/V's dtype in the cache: "auto" (the model's compute dtype, except bfloat16 under
    # dtype="auto" where a CPU computes a float32 model in float32), "float32",
    # "bfloat16" (also under float32 compute: half the bytes, the arithmetic in float32), or
    # "int8" (opt-in, lossy: each K/V row int8 with a float32 scale, under float32 or
    # bfloat16 compute; see dtypes.kv_cache_dtype).
    cache_dtype: str = "auto"
    num_blocks: int = field(init=False, default=0)  # set by the worker after sizing
    kv_torch_dtype: torch.dtype | None = field(init=False, default=None)  # set by EngineConfig

    def __post_init__(self) -> None:
        if self.block_size is not None and (
                isinstance(self.block_size, bool) or not isinstance(self.block_size, int)
                or self.block_size <= 0 or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}.")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError(
                f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib}."
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}."
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1].")
        dtypes.check_kv_cache_dtype(self.cache_dtype)

    def resolve_kv_dtype(self, model_config: ModelConfig) -> torch.dtype:
        """The cache's torch dtype for this model (kept in kv_torch_dtype)."""
        self.kv_torch_dtype = dtypes.kv_cache_dtype(self.cache_dtype, model_config.torch_dtype,
                                                    model_config.auto_kv_cache_dtype)
        return self.kv_torch_dtype


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048  # copied from ModelConfig by EngineConfig
    # Plan step N+1 while step N runs (two steps in flight; see EngineCore.step_with_batch_queue)
    async_scheduling: bool = False
    # False: a prompt is scheduled whole or waits (set for encoders and CLS/mean pooling).
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}."
            )


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | type | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class SpeculativeConfig:
    """vLLM's `speculative_config` dict, e.g. {"method": "ngram", "num_speculative_tokens": 3,
    "prompt_lookup_max": 4}. keel drafts with n-grams only."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> SpeculativeConfig | None:
        if d is None:
            return None
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(d).__name__}.")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"Unknown speculative_config key(s) {unknown}; keel knows "
                             f"{sorted(known)}.")
        return cls(**d)

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise NotImplementedError(
                f"speculative_config method {self.method!r} is not implemented in keel; "
                "use \"ngram\".")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {k!r}.")
        # vLLM's defaults: 5 and 5, or the one given for both.
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"prompt_lookup_min ({lo}) and prompt_lookup_max ({hi}) must be "
                             "integers with 1 <= prompt_lookup_min <= prompt_lookup_max.")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    threads: int | None = None  # torch intra-op threads; None: all cores of this process
    speculative_config: SpeculativeConfig | None = None
    trace_path: str | None = None  # record every step to this JSON Lines file (keel/trace/)

    def __post_init__(self) -> None:
        pc = self.parallel_config
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(pc, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        heads = getattr(self.model_config.hf_config, "num_attention_heads", 1)
        if heads % pc.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={pc.tensor_parallel_size} must divide the model's "
                f"{heads} attention heads: pick a divisor of {heads}."
            )
        if self.scheduler_config.async_scheduling and pc.pipeline_parallel_size > 1:
            raise NotImplementedError(
                "async_scheduling together with pipeline parallelism is not implemented in "
                "keel yet: drop one of them.")
        if self.speculative_config is not None and pc.pipeline_parallel_size > 1:
            raise NotImplementedError(
                "speculative decoding with pipeline_parallel_size > 1 is not implemented in "
                "keel yet: drop one of them.")
        layers = getattr(self.model_config.hf_config, "num_hidden_layers", 1)
        if pc.pipeline_parallel_size > layers:
            raise ValueError(
                f"pipeline_parallel_size={pc.pipeline_parallel_size} is more than the model's "
                f"{layers} layers: each pipeline stage needs at least one layer."
            )
        if pc.distributed_executor_backend is None:
            # The seed: the default is decided here, not in Executor.get_class.
            pc.distributed_executor_backend = "uni" if pc.world_size == 1 else "mp"
        sc, cc = self.scheduler_config, self.cache_config
        cc.resolve_kv_dtype(self.model_config)
        if cc.block_size is None:
            cc.block_size = default_block_size(self.model_config.torch_device, cc.kv_torch_dtype)
        sc.max_model_len = self.model_config.max_model_len
        if sc.max_num_batched_tokens < cc.block_size:
            raise ValueError(
                f"max_num_batched_tokens={sc.max_num_batched_tokens} is smaller than one block "
                f"(block_size={cc.block_size}): raise it or lower block_size."
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}.")
        if self.model_config.runner_type == "pooling":
            self._configure_pooling()

    def _configure_pooling(self) -> None:
        """Pooling runs prompts only. CLS and mean pooling (and any encoder) need each prompt
        whole in one pass: no chunked prefill, no prefix caching (as vLLM does for encoders)."""
        mc, sc, cc = self.model_config, self.scheduler_config, self.cache_config
        if self.speculative_config is not None:
            raise ValueError("speculative_config is for generation: drop it for a pooling "
                             "model (runner='pooling').")
        if self.parallel_config.pipeline_parallel_size > 1:
            raise NotImplementedError("pooling with pipeline_parallel_size > 1 is not "
                                      "implemented in keel yet.")
        if mc.is_encoder_only or mc.pooler_config.needs_whole_prompt:
            sc.enable_chunked_prefill = False
            cc.enable_prefix_caching = False
            if sc.max_num_batched_tokens < mc.max_model_len:
                logger.info("Pooling without chunked prefill: max_num_batched_tokens raised "
                            "from %d to max_model_len=%d.", sc.max_num_batched_tokens,
                            mc.max_model_len)
                sc.max_num_batched_tokens = mc.max_model_len
