"""LLM: offline generation. Builds the engine core, feeds it requests, steps it until they
finish, and detokenizes."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from keel.engine.arg_utils import EngineArgs
from keel.engine.core import EngineCore
from keel.engine.input_processor import InputProcessor, ProcessedPrompt
from keel.engine.output_processor import OutputProcessor
from keel.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from keel.pooling_params import PoolingParams
from keel.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`model`: an HF folder or .gguf file (None: the default model); `kwargs`: any other
        field of EngineArgs (keel/engine/arg_utils.py), e.g. dtype, max_model_len,
        tensor_parallel_size."""
        config = EngineArgs(model=model, **kwargs).create_engine_config("llm_class")
        self.config = config
        self.tokenizer = load_tokenizer(config.model_config.model_path,
                                        config.model_config.hf_config)
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

    def _process(self, prompt: Prompt, params: SamplingParams) -> ProcessedPrompt:
        if isinstance(params, SamplingParams):
            params = params.clone()
            params.output_kind = RequestOutputKind.FINAL_ONLY  # offline: one output each
        return self.input_processor.process_prompt(str(next(self._request_counter)), prompt,
                                                   params)

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`, a list of floats): the pooling the
        model folder declares, normalised when it says so. Needs a pooling model
        (`runner="pooling"`, or a folder detected as one)."""
        params = self._pooling_params(pooling_params, "embed", truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(o)
                for o in self._pool(prompts, params, use_tqdm)]

    def encode(self, prompts: Prompt | Sequence[Prompt],
               pooling_params: PoolingParams | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               ) -> list[PoolingRequestOutput]:
        """The raw pooled hidden state per prompt (`.outputs.data`, a float32 tensor): the
        same pooling as `embed`, never normalised."""
        params = self._pooling_params(pooling_params, "encode", truncate_prompt_tokens)
        return self._pool(prompts, params, use_tqdm)

    @staticmethod
    def _pooling_params(params: PoolingParams | None, task: str,
                        truncate_prompt_tokens: int | None) -> PoolingParams:
        if params is None:
            params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        elif not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
        return dataclasses.replace(params, task=task)

    def _pool(self, prompts: Prompt | Sequence[Prompt], params: PoolingParams,
              use_tqdm: bool) -> list[PoolingRequestOutput]:
        if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence):
            prompts = [prompts]
        if not prompts:
            raise ValueError("No prompts: pass at least one text (or {'prompt_token_ids': "
                             "[...]}) to embed.")
        processed = [self.input_processor.process_pooling(str(next(self._request_counter)),
                                                          p, params) for p in prompts]
        return self._run(processed, use_tqdm)

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

    def _run(self, processed: list[ProcessedPrompt], use_tqdm: bool) -> list[RequestOutput]:
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
                outputs, _ = core.step_fn()
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
            while core.batch_queue:  # async scheduling: a step planned ahead may still run
                core.step_fn()
        except BaseException:
            # Leave the engine serving: drop what this call added, keep everything else.
            core.abort_requests(out_proc.abort_requests(list(unfinished)))
            raise
        finally:
            pbar.close()
        return [results[item.request_id] for item in processed]

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (e.g. after changing weights). Requests running meanwhile
        are preempted and resume with the same tokens."""
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine (worker processes too); the LLM cannot be used afterwards."""
        self.engine_core.shutdown()

    close = shutdown


def load_tokenizer(path, hf_config=None):
    """The folder's tokenizer. With keel's own `HFConfig` (keel/model_executor/hf_config.py)
    it is handed to AutoTokenizer, which would otherwise import transformers' config classes
    (~1.3 s) only to learn the model type; if that fails, AutoTokenizer reads the folder
    itself. Where AutoTokenizer would return transformers' generic tokenizer class anyway
    (`_generic_tokenizer_folder`), that class is loaded directly; in a folder keel converted
    from a GGUF file, from the snapshot its first load kept, without transformers
    (keel/engine/fast_tokenizer.py)."""
    from keel.model_executor.hf_config import HFConfig

    if isinstance(hf_config, HFConfig) and _generic_tokenizer_folder(path, hf_config):
        from keel.engine.fast_tokenizer import load_snapshot, save_snapshot

        fast = load_snapshot(path)
        if fast is not None:
            return fast
        try:
            # Skips importing transformers' model registry (~0.4 s of start-up here).
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            tokenizer = TokenizersBackend.from_pretrained(str(path))
        except Exception as e:  # noqa: BLE001 - AutoTokenizer below reports the real problem
            logger.debug("TokenizersBackend failed (%s); trying AutoTokenizer", e)
        else:
            save_snapshot(tokenizer, path)
            return tokenizer
    from transformers import AutoTokenizer

    if isinstance(hf_config, HFConfig):
        try:
            return AutoTokenizer.from_pretrained(str(path), config=hf_config)
        except Exception as e:  # noqa: BLE001 - the plain call below reports the real problem
            logger.debug("AutoTokenizer with keel's config failed (%s); reading the folder", e)
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as e:
        logger.warning("No usable tokenizer in %s (%s): only token-id prompts will work.", path, e)
        return None


# The names transformers gives its generic tokenizers.json-backed class (v5, and v4's).
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _generic_tokenizer_folder(path, hf_config) -> bool:
    """Whether AutoTokenizer would pick transformers' generic `TokenizersBackend` here: a llama
    folder (other model types may map to their own class whatever the folder says) whose
    tokenizer_config.json names the generic class, with a tokenizer.json and no custom code.
    keel's default model, converted from its GGUF file, is such a folder."""
    import json
    from pathlib import Path

    folder = Path(path)
    if hf_config.model_type != "llama" or not (folder / "tokenizer.json").is_file():
        return False
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(cfg, dict) and cfg.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES
            and "auto_map" not in cfg)
