"""LLM: offline generation. Builds the engine core, feeds it requests, steps it until they
finish, and detokenizes."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from keel.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from keel.engine.core import EngineCore
from keel.engine.input_processor import InputProcessor
from keel.engine.output_processor import OutputProcessor
from keel.engine.parallel_sampling import ParentRequest
from keel.outputs import RequestOutput
from keel.request import Request
from keel.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | dict[str, Any]


@dataclass(slots=True)
class _Processed:
    request_id: str  # what the user gets back (the parent's id when n > 1)
    prompt: str | None
    requests: list[Request]  # one per completion
    parent: ParentRequest | None


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
        max_logprobs: int = 20,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
    ) -> None:
        config = EngineConfig(
            model_config=ModelConfig(
                model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, device=device,
                max_logprobs=max_logprobs,
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
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
                distributed_executor_backend=distributed_executor_backend,
            ),
            threads=threads,
        )
        self.config = config
        self.tokenizer = _load_tokenizer(config.model_config.model_path)
        self.engine_core = EngineCore(config)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
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
        processed = [self._process(p, sp) for p, sp in zip(prompts, params)]
        return self._run(processed, use_tqdm)

    def _process(self, prompt: Prompt, params: SamplingParams) -> _Processed:
        """One prompt -> its engine requests: one, or n children that share the prompt."""
        if isinstance(params, SamplingParams):
            params = params.clone()
            params.output_kind = RequestOutputKind.FINAL_ONLY  # offline: one output each
        request_id = str(next(self._request_counter))
        request, text = self.input_processor.process(request_id, prompt, params)
        if request.sampling_params.n == 1:
            return _Processed(request_id, text, [request], None)
        parent = ParentRequest(request_id, request.sampling_params)
        children = []
        for index in range(request.sampling_params.n):
            child_id, child_params = parent.get_child_info(index)
            children.append(dataclasses.replace(
                request, request_id=child_id, sampling_params=child_params, output_token_ids=[]
            ))
        return _Processed(request_id, text, children, parent)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then
        generate. `chat_template_kwargs` go to the template (e.g. enable_thinking=False)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("This model's tokenizer has no chat template: use generate().")
        if not messages:
            raise ValueError("messages is empty: pass a conversation (a list of messages).")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tokenize=False,
                **(chat_template_kwargs or {}),
            )
            # The template already wrote the special tokens (BOS and the like).
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, processed: list[_Processed], use_tqdm: bool) -> list[RequestOutput]:
        core, out_proc = self.engine_core, self.output_processor
        for item in processed:
            for index, request in enumerate(item.requests):
                out_proc.add_request(request, item.prompt, item.parent, index)
                core.add_request(request)
        results: dict[str, RequestOutput] = {}
        unfinished = {item.request_id for item in processed}
        pbar = tqdm(total=len(processed), desc="Processed prompts", disable=not use_tqdm,
                    dynamic_ncols=True)
        try:
            while unfinished:
                if not core.scheduler.has_requests():
                    raise RuntimeError(
                        f"{len(unfinished)} request(s) left the engine without finishing "
                        "(aborted from elsewhere?)"
                    )
                outputs, _ = core.step()
                batch = outputs.get(0)
                if batch is None or not batch.outputs:
                    continue
                result = out_proc.process_outputs(batch.outputs)
                if result.reqs_to_abort:  # stopped by a stop string: free them now
                    core.abort_requests(result.reqs_to_abort)
                for out in result.request_outputs:
                    if out.finished and out.request_id in unfinished:
                        results[out.request_id] = out
                        unfinished.discard(out.request_id)
                        pbar.update(1)
        except BaseException:
            # Leave the engine serving: drop what this call added, keep everything else.
            core.abort_requests(out_proc.abort_requests(list(unfinished)))
            raise
        finally:
            pbar.close()
        return [results[item.request_id] for item in processed]

    def shutdown(self) -> None:
        """Stop the engine (worker processes too); the LLM cannot be used afterwards."""
        self.engine_core.shutdown()

    close = shutdown


def _load_tokenizer(path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as e:
        logger.warning("No usable tokenizer in %s (%s): only token-id prompts will work.", path, e)
        return None
