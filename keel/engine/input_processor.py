"""Turns a user's prompt + SamplingParams into a scheduler Request, or a clear error.

Everything a user can get wrong about one request is caught here, before the request reaches
the engine, so a bad request costs nothing to the others."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from keel.config import EngineConfig
from keel.engine.parallel_sampling import ParentRequest
from keel.pooling_params import PoolingParams
from keel.request import Request
from keel.sampling_params import SamplingParams


@dataclass(slots=True)
class ProcessedPrompt:
    """One prompt, ready for the engine: one request, or n children sharing the prompt."""

    request_id: str  # what the user gets back (the parent's id when n > 1)
    prompt: str | None
    requests: list[Request]  # one per completion
    parent: ParentRequest | None


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any | None) -> None:
        self.max_model_len = config.model_config.max_model_len
        self.max_logprobs = config.model_config.max_logprobs
        self.vocab_size = config.model_config.vocab_size
        self.tokenizer = tokenizer
        self.runner_type = config.model_config.runner_type
        self.hidden_size = getattr(config.model_config.hf_config, "hidden_size", None)
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        if eos is None:
            eos = getattr(config.model_config.hf_config, "eos_token_id", None)
            if isinstance(eos, list):
                eos = eos[0] if eos else None
        self.eos_token_id = eos

    def prompt_token_ids(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("The prompt is empty: pass at least one character or token.")
            if self.tokenizer is None:
                raise ValueError("This model has no tokenizer: pass {'prompt_token_ids': [...]}.")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers.")
            return prompt.get("prompt"), list(ids)
        raise ValueError(
            f"A prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}."
        )

    def process(
        self, request_id: str, prompt: str | dict, params: SamplingParams
    ) -> tuple[Request, str | None]:
        if self.runner_type == "pooling":
            raise ValueError("This is a pooling model (runner='pooling'): it embeds prompts "
                             "(LLM.embed, /v1/embeddings), it does not generate text.")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        text, ids = self.prompt_token_ids(prompt)
        n = len(ids)
        if n == 0:
            raise ValueError("The prompt is empty (no tokens): pass at least one token.")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"Token id(s) {bad[:5]} are outside the vocabulary [0, {self.vocab_size})."
            )
        if n >= self.max_model_len:
            raise ValueError(
                f"The prompt ({n} tokens) is too long for max_model_len={self.max_model_len}: "
                f"shorten it to at most {self.max_model_len - 1} tokens or raise max_model_len."
            )
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - n
        elif n + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens={max_tokens} cannot fit: the prompt has {n} tokens and "
                f"max_model_len={self.max_model_len}, so max_tokens must be <= "
                f"{self.max_model_len - n}."
            )
        params = self._check_params(params)
        return Request(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            max_tokens=max_tokens,
        ), text

    def process_pooling(self, request_id: str, prompt: str | dict, params: PoolingParams
                        ) -> ProcessedPrompt:
        """One embedding request: its prompt (truncated when the request says so) and a
        request that finishes with one vector once the prompt is computed."""
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
        if self.runner_type != "pooling":
            raise ValueError("This model generates text: to embed with it, load it with "
                             "runner='pooling' (--runner pooling); its last token's hidden "
                             "state becomes the embedding.")
        if params.dimensions is not None and params.dimensions != self.hidden_size:
            raise ValueError(f"dimensions={params.dimensions}: this model's embeddings have "
                             f"{self.hidden_size} dimensions and it cannot shorten them (it is "
                             "not a Matryoshka model): drop dimensions.")
        limit = params.truncate_prompt_tokens
        if limit == -1:
            limit = self.max_model_len
        if limit is not None and limit > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens={limit} is more than max_model_len="
                             f"{self.max_model_len}: pass at most {self.max_model_len} (or -1).")
        if limit is not None and isinstance(prompt, str) and self.tokenizer is not None:
            if not prompt:
                raise ValueError("The prompt is empty: pass at least one character or token.")
            # The tokenizer's own truncation keeps its special tokens ([CLS] ... [SEP]).
            text = prompt
            ids = self.tokenizer(prompt, truncation=True, max_length=limit)["input_ids"]
        else:
            text, ids = self.prompt_token_ids(prompt)
            if limit is not None and len(ids) > limit:
                left = getattr(self.tokenizer, "truncation_side", "right") == "left"
                ids = ids[-limit:] if left else ids[:limit]
        if not ids:
            raise ValueError("The prompt is empty (no tokens): pass at least one token.")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Token id(s) {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size}).")
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"The prompt ({len(ids)} tokens) is longer than max_model_len="
                f"{self.max_model_len}: shorten it, or pass truncate_prompt_tokens (e.g. -1 "
                "for max_model_len) to cut it.")
        sp = self._check_params(SamplingParams(temperature=0.0, max_tokens=1))
        request = Request(request_id=request_id, prompt_token_ids=list(ids),
                          sampling_params=sp, max_tokens=1, pooling_params=params)
        return ProcessedPrompt(request_id, text, [request], None)

    def _check_params(self, params: SamplingParams) -> SamplingParams:
        """What SamplingParams cannot check alone (it needs the model and the tokenizer).
        Returns the request's own copy, with its stop ids and bad-word token ids filled in."""
        vocab = self.vocab_size
        ids = {
            "stop_token_ids": params.stop_token_ids,
            "allowed_token_ids": params.allowed_token_ids or [],
            "logit_bias": list(params.logit_bias or {}),
        }
        for name, values in ids.items():
            bad = [t for t in values if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} contains token id(s) {bad[:5]}, outside the "
                                 f"vocabulary [0, {vocab}).")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name}={value} is more than this engine returns: pass at "
                                 f"most {self.max_logprobs} (or raise max_logprobs).")
        if (params.stop or params.bad_words) and self.tokenizer is None:
            raise ValueError("stop strings and bad_words need a tokenizer, and this model has "
                             "none: use stop_token_ids instead.")
        if params.structured_outputs is not None:
            from keel.structured_output import validate_structured_outputs

            validate_structured_outputs(params.structured_outputs)
        params = params.clone()
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.eos_token_id is not None:
            stop_ids.add(self.eos_token_id)
        params._all_stop_token_ids = stop_ids
        params._bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        return params

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, with and without a leading space (a word reads
        differently at the start of the text and after a space), as vLLM does."""
        out: list[list[int]] = []
        for word in bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out and all(0 <= t < self.vocab_size for t in ids):
                    out.append(ids)
        return out

    def process_prompt(self, request_id: str, prompt: str | dict, params: SamplingParams
                       ) -> ProcessedPrompt:
        """`process`, then split an n > 1 request into its children (ParentRequest)."""
        request, text = self.process(request_id, prompt, params)
        if request.sampling_params.n == 1:
            return ProcessedPrompt(request_id, text, [request], None)
        parent = ParentRequest(request_id, request.sampling_params)
        children = []
        for index in range(request.sampling_params.n):
            child_id, child_params = parent.get_child_info(index)
            children.append(dataclasses.replace(
                request, request_id=child_id, sampling_params=child_params, output_token_ids=[]
            ))
        return ProcessedPrompt(request_id, text, children, parent)
