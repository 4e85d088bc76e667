"""Worker: one per device. Picks the device, loads the model, sizes the KV cache, and owns
one ModelRunner. The executor calls its methods by name (`collective_rpc("execute_model")`)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from keel.attention.layer import kv_cache_bytes_per_block
from keel.config import EngineConfig
from keel.core.sched_output import SchedulerOutput
from keel.cpu_ops import get_cpu_ops
from keel.distributed import (
    destroy_model_parallel,
    init_distributed_environment,
    initialize_model_parallel,
    is_first_pp_rank,
    recv_tensor_dict,
    send_tensor_dict,
)
from keel.outputs import IntermediateTensors, ModelRunnerOutput
from keel.utils import (
    anonymous_regions,
    available_memory_bytes,
    configure_threads,
    freeze_startup_heap,
    keep_freed_memory,
    weights_on_huge_pages,
)
from keel.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GiB = 1 << 30
# Default KV budget on the CPU: a modest share of the memory available at start-up.
DEFAULT_CPU_KV_SHARE = 0.1
DEFAULT_CPU_KV_MAX_GIB = 4.0


class Worker:
    def __init__(self, config: EngineConfig, local_rank: int = 0, rank: int = 0,
                 is_driver_worker: bool = True, distributed_init_method: str | None = None,
                 own_process: bool = False) -> None:
        self.config = config
        # True in an mp or Ray worker process, which serves this worker alone until it exits.
        self.own_process = own_process
        self.local_rank, self.rank = local_rank, rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        self.device = self.config.model_config.torch_device
        pc = self.config.parallel_config
        if self.device.type == "cuda":
            if pc.world_size > 1:
                self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            configure_threads(self.config.threads)
            get_cpu_ops()  # build/load keel's CPU kernels now, not inside the first step
        if pc.world_size > 1:
            # Before the model is built: its layers ask for their shard when constructed.
            init_distributed_environment(pc.world_size, self.rank, self.distributed_init_method,
                                         "nccl" if self.device.type == "cuda" else "gloo")
            initialize_model_parallel(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        # The same seed on every rank: TP ranks sample the same tokens from the same logits.
        torch.manual_seed(self.config.model_config.seed)
        self.model_runner = ModelRunner(self.config, self.device)

    def get_rank(self) -> int:
        return self.rank

    def load_model(self) -> None:
        # Dense weights only: the quantized kernels' (the default .gguf's) were not measured
        # faster on huge pages, and the collapse costs ~1 s of a one-shot `keel generate`.
        dense = self.config.model_config.quantization_method is None
        before = anonymous_regions() if self.device.type == "cpu" and dense else None
        self.model_runner.load_model()
        if before is not None:
            advised = weights_on_huge_pages(before)
            if advised:
                logger.info("Weights on huge pages: %.0f MiB advised.", advised / 2**20)

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit the memory budget (capped at what max_num_seqs requests of
        max_model_len tokens could ever use)."""
        cc, mc = self.config.cache_config, self.config.model_config
        per_block = kv_cache_bytes_per_block(self.model_runner.model, cc.block_size,
                                             cc.kv_torch_dtype or mc.torch_dtype)
        blocks_per_seq = -(-mc.max_model_len // cc.block_size)
        useful = blocks_per_seq * self.config.scheduler_config.max_num_seqs
        if per_block == 0:
            # No layer keeps a KV cache (an encoder): blocks are only the scheduler's count.
            logger.info("No KV cache: %s attends within each pass.", mc.hf_config.architectures[0])
            return useful
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
            budget = num_blocks * per_block
        else:
            budget = self._kv_budget_bytes()
            num_blocks = min(int(budget // per_block), useful)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"The KV cache holds {num_blocks} blocks of {cc.block_size} tokens "
                f"({budget / GiB:.2f} GiB), but one request of max_model_len="
                f"{mc.max_model_len} tokens needs {blocks_per_seq}: raise kv_cache_memory_gib "
                f"(or num_gpu_blocks_override), or lower max_model_len."
            )
        logger.info(
            "KV cache: %.2f GiB -> %d blocks of %d tokens (%d tokens); maximum concurrency for "
            "%d-token requests: %.1fx", num_blocks * per_block / GiB, num_blocks, cc.block_size,
            num_blocks * cc.block_size, mc.max_model_len, num_blocks / blocks_per_seq,
        )
        return num_blocks

    def _kv_budget_bytes(self) -> float:
        cc = self.config.cache_config
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            peak = self._profile_run()
            used_elsewhere = total - free
            return max(0.0, total * cc.gpu_memory_utilization - used_elsewhere - peak)
        if cc.kv_cache_memory_gib is not None:
            return cc.kv_cache_memory_gib * GiB
        return min(DEFAULT_CPU_KV_SHARE * available_memory_bytes(), DEFAULT_CPU_KV_MAX_GIB * GiB)

    @torch.inference_mode()
    def _profile_run(self) -> int:
        """CUDA: run the largest pass (max_num_batched_tokens prompt tokens) once with a
        throwaway KV cache; return the peak activation memory it needed, in bytes."""
        from keel.model_executor.direct import DirectRunner

        runner = self.model_runner
        per_req = min(runner.max_num_tokens, runner.max_model_len - 1)
        num_reqs = -(-runner.max_num_tokens // per_req)
        torch.cuda.reset_peak_memory_stats(runner.device)
        before = torch.cuda.memory_allocated(runner.device)
        direct = DirectRunner(runner.model, num_reqs, per_req, runner.block_size)
        direct.step(list(range(num_reqs)), [[0] * per_req] * num_reqs, [0] * num_reqs)
        peak = torch.cuda.max_memory_allocated(runner.device) - before
        del direct
        torch.cuda.empty_cache()
        return peak

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        if self.device.type == "cpu":
            # After the load (its frees go back to the kernel), before the first pass.
            keep_freed_memory()
        if self.own_process:
            freeze_startup_heap()  # start-up is over: the model and the KV cache are made

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        intermediate_tensors = None
        num_tokens = scheduler_output.total_num_scheduled_tokens
        if num_tokens and not is_first_pp_rank():
            # Blocks until the previous stage has run its layers on this pass.
            shapes = self.model_runner.model.intermediate_tensor_shapes(num_tokens)
            intermediate_tensors = IntermediateTensors(recv_tensor_dict(shapes, self.device))
        output = self.model_runner.execute_model(scheduler_output, intermediate_tensors)
        if isinstance(output, IntermediateTensors):
            send_tensor_dict(output.tensors)
            return None  # sample_tokens finds nothing parked on this rank
        return output

    def sample_tokens(self, grammar_output: Any = None) -> ModelRunnerOutput | None:
        return self.model_runner.sample_tokens(grammar_output)

    def shutdown(self) -> None:
        self.model_runner = None
        if self.config.parallel_config.world_size > 1:
            destroy_model_parallel()
