"""LLM: offline generation. Builds the engine core, feeds it requests, steps it until they
finish, and detokenizes."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from keel.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from keel.engine.core import EngineCore
from keel.engine.input_processor import InputProcessor
from keel.outputs import CompletionOutput, RequestOutput
from keel.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        kv_cache_memory_gib: float | None = None,
        num_gpu_blocks_override: int | None = None,
        distributed_executor_backend: str | type | None = None,
        seed: int = 0,
        device: str = "auto",
        threads: int | None = None,
        gpu_memory_utilization: float = 0.9,
    ) -> None:
        config = EngineConfig(
            model_config=ModelConfig(
                model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, device=device
            ),
            cache_config=CacheConfig(
                block_size=block_size,
                kv_cache_memory_gib=kv_cache_memory_gib,
                num_gpu_blocks_override=num_gpu_blocks_override,
                gpu_memory_utilization=gpu_memory_utilization,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
            ),
            parallel_config=ParallelConfig(
                distributed_executor_backend=distributed_executor_backend
            ),
            threads=threads,
        )
        self.config = config
        self.tokenizer = _load_tokenizer(config.model_config.model_path)
        self.engine_core = EngineCore(config)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self._request_counter = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence):
            prompts = [prompts]  # a single prompt (anything else is rejected per prompt)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"Got {len(params)} sampling_params for {len(prompts)} prompts: pass one "
                    "SamplingParams, or one per prompt."
                )
        # Validate every prompt before adding any, so a bad one leaves the engine untouched.
        processed = [
            self.input_processor.process(str(next(self._request_counter)), p, sp)
            for p, sp in zip(prompts, params)
        ]
        return self._run(processed, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("This model's tokenizer has no chat template: use generate().")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {
                "prompt_token_ids": self.tokenizer.apply_chat_template(
                    conv, add_generation_prompt=True, tokenize=True, return_dict=False
                ),
                "prompt": conv[-1]["content"],
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, processed, use_tqdm: bool) -> list[RequestOutput]:
        core = self.engine_core
        order = [req.request_id for req, _ in processed]
        results: dict[str, RequestOutput] = {}
        token_ids: dict[str, list[int]] = {req.request_id: [] for req, _ in processed}
        for req, text in processed:
            results[req.request_id] = RequestOutput(
                req.request_id, text, req.prompt_token_ids,
                [CompletionOutput(index=0, text="", token_ids=token_ids[req.request_id])],
            )
            core.add_request(req)
        params = {req.request_id: req.sampling_params for req, _ in processed}
        pbar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm,
                    dynamic_ncols=True)
        unfinished = set(order)
        try:
            while unfinished:
                if not core.scheduler.has_requests():
                    raise RuntimeError(
                        f"{len(unfinished)} request(s) left the engine without finishing "
                        "(aborted from elsewhere?)"
                    )
                outputs, _ = core.step()
                batch = outputs.get(0)
                for out in batch.outputs if batch is not None else ():
                    if out.request_id not in token_ids:
                        continue
                    token_ids[out.request_id].extend(out.new_token_ids)
                    if out.finished:
                        self._finish(results[out.request_id], out, params[out.request_id])
                        unfinished.discard(out.request_id)
                        pbar.update(1)
        except BaseException:
            # Leave the engine serving: drop what this call added, keep everything else.
            core.abort_requests(list(unfinished))
            raise
        finally:
            pbar.close()
        return [results[rid] for rid in order]

    def _finish(self, result: RequestOutput, out, params: SamplingParams) -> None:
        completion = result.outputs[0]
        completion.finish_reason = out.finish_reason
        completion.stop_reason = out.stop_reason
        if self.tokenizer is not None:
            completion.text = self.tokenizer.decode(
                completion.token_ids, skip_special_tokens=params.skip_special_tokens
            )
        result.finished = True

    def shutdown(self) -> None:
        self.engine_core.shutdown()


def _load_tokenizer(path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as e:
        logger.warning("No usable tokenizer in %s (%s): only token-id prompts will work.", path, e)
        return None
