"""Drive a model directly through the paged KV cache, without the engine.

A reference path for the model layer: each request owns a fixed range of blocks, and `step`
runs one flat batch in which each request contributes any number of new tokens (a prefill, a
chunk of one, or a single decode token). The engine's runner builds the same metadata from its
persistent batch; this exists so the model layer can be tested, and used, on its own.
"""

from __future__ import annotations

import torch
from torch import nn

from keel.attention import build_attention_metadata, set_forward_context
from keel.attention.layer import allocate_kv_caches


class DirectRunner:
    def __init__(
        self, model: nn.Module, max_reqs: int, max_len: int, block_size: int = 16,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        p = next(model.parameters())
        self.device, self.block_size = p.device, block_size
        self.blocks_per_req = -(-max_len // block_size)
        num_blocks = max_reqs * self.blocks_per_req
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, dtype or p.dtype, p.device)
        # Request i owns blocks [i * blocks_per_req, (i + 1) * blocks_per_req).
        self.block_table = torch.arange(num_blocks, dtype=torch.int32, device=p.device).view(
            max_reqs, self.blocks_per_req
        )

    @torch.inference_mode()
    def step(
        self, reqs: list[int], new_tokens: list[list[int]], context_lens: list[int],
        all_rows: bool = False,
    ) -> torch.Tensor:
        """Run one pass. reqs[i] owns the blocks; new_tokens[i] start at position
        context_lens[i]. Returns logits [len(reqs), vocab] of each request's last new token
        (or of every token with all_rows)."""
        dev = self.device
        q_lens = torch.tensor([len(t) for t in new_tokens], device=dev)
        ctx = torch.tensor(context_lens, device=dev)
        input_ids = torch.tensor([t for ts in new_tokens for t in ts], device=dev)
        req_idx = torch.repeat_interleave(torch.arange(len(reqs), device=dev), q_lens)
        qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32, device=dev)
        qsl[1:] = torch.cumsum(q_lens, 0)
        positions = ctx[req_idx] + torch.arange(len(input_ids), device=dev) - qsl[req_idx]
        block_table = self.block_table[torch.tensor(reqs, device=dev)]
        slots = block_table[req_idx, positions // self.block_size].long() * self.block_size
        slot_mapping = slots + positions % self.block_size
        meta = build_attention_metadata(
            qsl, ctx + q_lens, block_table, slot_mapping, self.block_size
        )
        with set_forward_context(meta):
            hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden if all_rows else hidden[qsl[1:] - 1])

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Prefill all prompts in one pass, then decode them together, greedily."""
        reqs = list(range(len(prompts)))
        ctx = [0] * len(prompts)
        chunks = [list(p) for p in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        for _ in range(max_new_tokens):
            next_ids = self.step(reqs, chunks, ctx).argmax(-1).tolist()
            for i, tok in enumerate(next_ids):
                ctx[i] += len(chunks[i])
                chunks[i] = [tok]
                out[i].append(tok)
        return out
