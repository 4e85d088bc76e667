"""PoolingParams: what one embedding request asks for (vLLM's names).

`task`: "embed" (the folder's pooling, normalised when the folder says so: what `LLM.embed`
and /v1/embeddings return) or "encode" (the same pooling, never normalised: the raw pooled
hidden state, `LLM.encode`). `normalize` overrides the folder's choice for "embed".
`truncate_prompt_tokens`: keep only this many prompt tokens (the tokenizer's truncation side,
right for BERT: the first k, as sentence-transformers does), -1 for max_model_len; None:
a prompt that does not fit is an error. `dimensions`: must be the model's own size (keel has no
Matryoshka models), else a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass

TASKS = ("embed", "encode")


@dataclass(slots=True)
class PoolingParams:
    task: str = "embed"
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"PoolingParams.task must be one of {TASKS}, got {self.task!r}.")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t == 0 or t < -1):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer or -1 "
                             f"(max_model_len), got {t!r}.")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}.")
