from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from keel.cpu_ops import get_cpu_ops
from keel.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from keel.model_executor.layers import amx_choice, gemm_choice
from keel.model_executor.layers.linear import default_weight_loader
from keel.model_executor.layers.packed_weights import (
    cpu_gemm,
    cpu_gemm_argmax,
    pack_for_cpu_gemm,
)
from keel.model_executor.layers.quantization import Int8Weight, quantized_linear, uses_kernel


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split across ranks (rank r holds a contiguous slice)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=None) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.shard = -(-num_embeddings // self.tp_size)
        self.start = self.tp_rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, embedding_dim, dtype=dtype), False)
        self.weight.weight_loader = self.weight_loader
        # ParallelLMHead only: int8 rows for the logits (keel/model_executor/quantize_model.py).
        self.quant: Int8Weight | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.tp_size > 1:
            # The last shard may run past the vocabulary: its tail rows stay zero (never
            # looked up; their logits are cut off in compute_logits).
            loaded = loaded[self.start : self.start + self.shard]
            param.data[loaded.shape[0]:].zero_()
            param = param.data[: loaded.shape[0]]
        default_weight_loader(param, loaded, "embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        return tensor_model_parallel_all_reduce(out.masked_fill(mask[:, None], 0))


# Candidate columns a row may hold per thread while the screening runs (greedy_head's `cap`):
# past it the row's every column is computed exactly. On the default model's hidden states of
# random-token prompts 1,024 left 12 rows of 512 whole, 4,096 none (sixty-eighth round).
_GREEDY_HEAD_CAP = 4096


def greedy_head_chosen() -> bool:
    """Whether a greedy step's LM head screens the vocabulary on int8 dot products
    (csrc/greedy_head.cpp): where keel's kernels have AVX512-VNNI and the CPU has no AMX tiles
    (keel's AMX GEMM is faster there). `KEEL_GREEDY_HEAD=0` keeps the head's own GEMM."""
    mode = os.environ.get("KEEL_GREEDY_HEAD", "1")
    if mode not in ("0", "1"):
        raise ValueError(f"KEEL_GREEDY_HEAD must be 0 or 1, got {mode!r}.")
    if mode == "0":
        return False
    ops = get_cpu_ops()
    return ops is not None and ops.greedy_head_available() and not ops.amx_gemm_available()


class ParallelLMHead(VocabParallelEmbedding):
    """The vocabulary projection. Shares its weight with the embedding when `tied`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=None) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype)
        self.tied = False
        self.packed_weight: torch.Tensor | None = None
        self.packed_by = ""  # as LinearBase's (layers/linear.py)
        self.packed_rows = 0
        self.amx_weight: torch.Tensor | None = None
        # A GGUF Q8_0 head's own (q int8 [N, K], d [N, K / 32]), set by quantize_model where
        # the AMX GEMM is chosen: the AMX copy is made from it, then it is dropped.
        self.q8_blocks: tuple[torch.Tensor, torch.Tensor] | None = None
        # greedy_head_pack's (int8 panels, scales, norms) of the weight, where a greedy step's
        # tokens are found by screening (greedy_token_ids); the dense weight stays beside it.
        self.greedy_screen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def process_weights_after_loading(self) -> None:
        """Pack for the CPU's GEMM (see gemm_choice.py). A tied weight stays: the embedding
        still looks rows up in it."""
        if not self.weight.numel():
            return
        w = self.weight.detach()
        if self.q8_blocks is not None and w.dtype == torch.bfloat16 and self.tp_size == 1 \
                and amx_choice.amx_compressed_copy_chosen("int8"):
            # The AMX GEMM over the file's int8 blocks, where every value widens to exactly
            # `w`: 64 x 49152 x 576 from memory, oneDNN 3.5-4.6 ms, the int8 copy 3.0-3.5
            # (benchmarks/amx_kernels.py).
            copy = gemm_choice._keel_ops.amx_gemm_pack_int8(*self.q8_blocks, w)
            if copy.numel() and amx_choice._amx_budget(copy.numel()):
                self.amx_weight = copy
        self.q8_blocks = None
        # Else a bfloat16 head gets the AMX GEMM's bfloat16 copy where it is chosen (as the
        # decoder's layers do; 56 MB more for the default model's). Its logits run at about
        # oneDNN's packed speed, and a greedy step takes each row's token in the GEMM's
        # epilogue without writing the logits (greedy_token_ids): 64 x 49152 x 576 from
        # memory 3.34 ms against 3.60 for the logits and their argmax_rows
        # (benchmarks/kernel_ab.py, BENCHMARKS.md forty-ninth round).
        pack_for_cpu_gemm(self, release_dense=not self.tied,
                          amx=self.amx_weight is None and self.tp_size == 1)
        # A greedy step's tokens by int8 screening and exact rescoring over the dense weight,
        # which a tied head keeps anyway: at 64 rows ~0.71x the time of the head's own GEMM with
        # its argmax, at one row 0.43-0.56x (BENCHMARKS.md, sixty-eighth round).
        if (greedy_head_chosen() and self.tied and self.tp_size == 1 and self.quant is None
                and w.shape[1] % 32 == 0 and w.dtype in (torch.float32, torch.bfloat16)):
            self.greedy_screen = get_cpu_ops().greedy_head_pack(w)

    def greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """compute_logits(hidden).argmax(-1) [n] int64 without the logits: from greedy_head
        where the head has its screening copy (the argmax of the float32 logits, or of their
        bfloat16 rounding), else where the head runs on keel's AMX GEMM or i16_gemm for these
        rows (the argmax in its epilogue, over the same values); None elsewhere, for the
        caller to compute the logits."""
        if self.greedy_screen is not None and hidden.dim() == 2 and hidden.shape[0] > 0 \
                and hidden.dtype in (torch.float32, torch.bfloat16):
            # The argmax of the float32 logits (bfloat16-rounded for a bfloat16 pass, as its
            # GEMM rounds them), ties to the first, as torch's argmax.
            return get_cpu_ops().greedy_head(
                hidden, *self.greedy_screen, self.weight, self.num_embeddings,
                round_bf16=hidden.dtype == torch.bfloat16, cap=_GREEDY_HEAD_CAP)[0]
        if self.tp_size > 1 or self.packed_weight is None or (
                self.quant is not None and uses_kernel(self.quant, hidden, True)):
            return None
        return cpu_gemm_argmax(self, hidden, self.num_embeddings)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden: [n, hidden] (only the rows to be sampled) -> [n, vocab] in float32, or
        (float32=False) in the GEMM's own dtype, for a caller that widens only if it must."""
        if self.quant is not None and uses_kernel(
                self.quant, hidden, self.packed_weight is not None or self.weight.numel() > 0):
            logits = quantized_linear(hidden, self.quant)
        elif self.packed_weight is not None:
            logits = cpu_gemm(self, hidden, None)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits)
        logits = logits[:, : self.num_embeddings]
        return logits.float() if float32 else logits
