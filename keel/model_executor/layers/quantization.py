"""Weights that stay quantized in memory: int4 groupwise and int8 per output channel,
computed by the kernels torch ships for the CPU.

- int4: `_convert_weight_to_int4pack_for_cpu` packs q in [0, 15] ([N, K] -> [N, K / 2]
  bytes); `_weight_int4pack_mm_for_cpu` computes x @ W^T with W[n, k] = (q - 8) * scale + zero
  per group of `group_size` along K (scales and zeros [K / G, N, 2] in the compute dtype).
  GGUF's Q4_1 (`d * q + m` per block of 32) is exactly scale = d, zero = m + 8 d; Q4_0
  (`d * (q - 8)`) is zero = 0; Q4_K's sub-blocks of 32 (`d sc q - dmin m`) are scale = d sc,
  zero = 8 d sc - dmin m. The checkpoint's own numbers, no requantization.
- int8: `_weight_int8pack_mm` with one scale per output row, W[n, k] = q * scale[n].
  Q8_0 and Q6_K (GGUF blocks of 32 / 16) have no exact int8-per-row form: they are
  requantized from their float values, |error| <= scale[n] / 2 = max_k |W[n, k]| / 254.
  So are HF float weights with `quantization="int8"`; `"int4"` groups them with the
  asymmetric min/max form (|error| <= (max - min) / 30 per group).

A layer whose K is not a multiple of the group is padded with zero columns (and its input
with zeros) so the kernel's shape rules hold.

keel's own kernels (csrc/quant_gemm.cpp, AVX2 + FMA: int4 in groups of 32 and int8 per row,
up to 4 rows a call, activations as ACTIVATION_PARTS below says) run these where they are
built: with float32 activations, at one row, they were already 2-2.6x faster than torch's
int4 kernel and 1.5x its int8 one here; integer activations gained 1.5-2x more. Otherwise
torch's kernels compute with bfloat16 activations and scales (float32 accumulation): they
are vectorized for bfloat16 only, and with float32 activations ran 10-70x slower than the
dense GEMM here. A float32 model's activations are then rounded to bfloat16 on the way in,
and the output goes back to float32.

`max_rows`: passes with more rows than this use the layer's dense weight instead, when the
model keeps one (rows_per_pass.py measures where the kernels stop winning).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

INT4_GROUP_SIZES = (128, 64, 32)
COMPUTE_DTYPE = torch.bfloat16
ALL_ROWS = 1 << 62
_INNER_K_TILES = 8  # the packing's K tile (x 16 elements): K must be a multiple of 128


@dataclass
class Int4Weight:
    """torch's packed form, or (groups of 32, keel's kernels built) keel's: `keel` =
    (q as two nibbles per byte [N, K32 / 2], d [N, K32 / 32], m [N, K32 / 32]) with
    W = q d + m, d and m in float16 when exact else float32, K32 = K rounded up to 32."""

    packed: torch.Tensor | None  # uint8 [N_pad, K_pad / 2]
    scales_and_zeros: torch.Tensor | None  # [K_pad / G, N_pad, 2] in the compute dtype
    group_size: int
    in_features: int  # K before padding
    out_features: int
    max_rows: int = ALL_ROWS
    keel: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        tensors = self.keel if self.keel is not None else (self.packed, self.scales_and_zeros)
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Int8Weight:
    q: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # [N] in the compute dtype
    out_features: int
    max_rows: int = ALL_ROWS
    scales_f32: torch.Tensor | None = None  # [N] float32, for keel's kernel

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * self.scales.element_size()


@dataclass
class W8A8Weight:
    """`quantization="w8a8"`: int8 weights per output row *and* int8 activations per token,
    through torch's fbgemm GEMM (`quantized::linear_dynamic`: u8 x s8 products, int32 sums),
    at every pass size. fbgemm takes one activation scale per pass; keel divides each row by
    its own max |x| first (and multiplies the output back), which makes that one scale a
    per-token one. The activations get 7 bits (`reduce_range`: without VNNI, u8 x s8 pairs
    could overflow int16), so each input is within max|x_row| / 127 and each weight within
    max|W_row| / 254: lossy, and opt-in, like vLLM's W8A8."""

    packed: object  # fbgemm's LinearPackedParams
    out_features: int
    in_features: int
    nbytes: int
    max_rows: int = ALL_ROWS


QuantizedWeight = Int4Weight | Int8Weight | W8A8Weight


def choose_group_size(k: int, wanted: int | None = None) -> int:
    """32 where keel's kernels are built (they take groups of 32, and ran 2-2.6x faster than
    torch's int4 kernel at one row); else the largest of 128, 64, 32 that divides K (else 32:
    K gets padded) for torch's kernel."""
    if wanted is not None:
        return wanted
    if _keel_ops() is not None:
        return 32
    return next((g for g in INT4_GROUP_SIZES if k % g == 0), 32)


def quantize_int4(w: torch.Tensor, group_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group: (q [N, K] int32 in 0..15, scale [N, K/G], zero [N, K/G]),
    W ~= (q - 8) * scale + zero. K must be a multiple of group_size."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    q = ((wg - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.int32)
    return q.reshape(n, k), scale, lo + 8 * scale


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (q [N, K] int8, scale [N]), W ~= q * scale."""
    w = w.float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-10)
    q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
              dtype: torch.dtype = COMPUTE_DTYPE) -> Int4Weight:
    """q [N, K] in 0..15, scale/zero [N, K/G] -> the kernel's layout, K padded to a multiple
    of 128 (the packing's tile) and N to a multiple of 16, with zero weights. Groups of 32
    go to keel's kernel when it is built (float32, no padding of N, K to 32)."""
    n, k = q.shape
    if group_size == 32 and _keel_ops() is not None:
        k32 = -(-k // 32) * 32
        if k32 != k:
            q = F.pad(q, (0, k32 - k), value=8)
        q = q.to(torch.uint8)
        return pack_int4_pairs(q[:, 0::2] | (q[:, 1::2] << 4), scale, zero, k)
    k_pad = -(-k // max(group_size, 16 * _INNER_K_TILES)) * max(group_size, 16 * _INNER_K_TILES)
    if k_pad != k:
        extra = (k_pad - k) // group_size
        # Padded columns: q = 8 with zero = 0 is exactly 0.
        q = F.pad(q, (0, k_pad - k), value=8)
        scale = F.pad(scale, (0, extra), value=1.0)
        zero = F.pad(zero, (0, extra), value=0.0)
    n_pad = -(-n // 16) * 16  # the packing takes N in multiples of 16: zero rows, cut after
    if n_pad != n:
        q = F.pad(q, (0, 0, 0, n_pad - n), value=8)
        scale = F.pad(scale, (0, 0, 0, n_pad - n), value=1.0)
        zero = F.pad(zero, (0, 0, 0, n_pad - n), value=0.0)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(),
                                                                _INNER_K_TILES)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return Int4Weight(packed, sz, group_size, k, n)


def pack_int4_pairs(pairs: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    k: int) -> Int4Weight:
    """keel's kernel form (groups of 32) from q already two nibbles per byte: `pairs` uint8
    [N, K32 / 2], element 2i in the low nibble (pack_int4's and a converted GGUF file's
    form); scale/zero [N, >= K32 / 32] as pack_int4 takes them."""
    n, k32 = pairs.shape[0], pairs.shape[1] * 2
    # The kernel's form is Q4_1's, W = q d + m: float16 where that is exact (a Q4_0 or
    # Q4_1 file's own d and m: half the bytes a token reads for them), else float32.
    d = scale[:, : k32 // 32].double()
    m = zero[:, : k32 // 32].double() - 8 * d
    exact = torch.equal(d.half().double(), d) and torch.equal(m.half().double(), m)
    dtype16 = torch.float16 if exact else torch.float32
    keel = (pairs.contiguous(), d.to(dtype16).contiguous(), m.to(dtype16).contiguous())
    return Int4Weight(None, None, 32, k, n, keel=keel)


def pack_int8(q: torch.Tensor, scale: torch.Tensor,
              dtype: torch.dtype = COMPUTE_DTYPE) -> Int8Weight:
    f32 = scale.float().contiguous() if _keel_ops() is not None else None
    return Int8Weight(q.contiguous(), scale.to(dtype).contiguous(), q.shape[0], scales_f32=f32)


def w8a8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def pack_w8a8(w: torch.Tensor) -> W8A8Weight:
    if not w8a8_available():
        raise NotImplementedError("quantization='w8a8' needs torch's fbgemm (x86 CPUs); this "
                                  "torch has none: use int8 (weight-only) instead.")
    q, scale = quantize_int8(w)
    n = q.shape[0]
    engine = torch.backends.quantized.engine
    with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm's op is not
        warnings.simplefilter("ignore", UserWarning)
        qw = torch._make_per_channel_quantized_tensor(q, scale.double(),
                                                      torch.zeros(n, dtype=torch.long), 0)
        try:
            torch.backends.quantized.engine = "fbgemm"
            packed = torch.ops.quantized.linear_prepack(qw, None)
        finally:
            torch.backends.quantized.engine = engine
    return W8A8Weight(packed, n, q.shape[1], q.numel() + scale.numel() * 4)


def w8a8_linear(x: torch.Tensor, w: W8A8Weight) -> torch.Tensor:
    """x [T, K] @ W^T in x's dtype, with x as int8 per token (see W8A8Weight)."""
    xf = x.float()
    # max |x| per row in one pass, without an |x| temporary (exact, like abs().amax()).
    s = torch.linalg.vector_norm(xf, float("inf"), -1, True).clamp_(min=1e-30)
    out = torch.ops.quantized.linear_dynamic(xf / s, w.packed, True).mul_(s)
    return out.to(x.dtype)


def keel_int4_form() -> bool:
    """Whether int4 groups of 32 take keel's kernel form (pack_int4_pairs)."""
    return _keel_ops() is not None


def _keel_ops():
    """keel's compiled kernels when they include the quantized GEMMs (AVX2 + FMA CPUs)."""
    from keel.cpu_ops import get_cpu_ops

    ops = get_cpu_ops()
    return ops if ops is not None and ops.quant_gemm_available() else None


KEEL_MAX_ROWS = 4  # rows per call of keel's kernels (larger passes are split)
# keel's kernels take the activations as integers, per group of 32 (scale s = amax / 127),
# and compute integer dot products (maddubs), as llama.cpp does; at one row 1.5-2x faster
# than widening each weight to float here. KEEL_QUANT_ACTIVATIONS chooses how:
# - "int16" (default): two int8 parts, x = s / 254 (254 x1 + x2), each input within s / 508
#   (~15 bits): the dequantized model's answers (the default model's 16 prompts agree as in
#   float32), for twice the integer work;
# - "int8": one part, within s / 2: llama.cpp's Q8 activations, fastest, and on the default
#   135M model as lossy as llama.cpp is ("What is the capital of France?" loses "Paris");
# - "float32": float activations, each weight widened to float.
# tests/model_executor/test_quantization.py states each bound.
_ACTIVATIONS = {"int16": 2, "int8": 1, "float32": 0}


def activation_parts_from_env() -> int:
    value = os.environ.get("KEEL_QUANT_ACTIVATIONS", "int16")
    if value not in _ACTIVATIONS:
        raise ValueError(f"KEEL_QUANT_ACTIVATIONS={value!r}: use one of "
                         f"{', '.join(_ACTIVATIONS)}.")
    return _ACTIVATIONS[value]


ACTIVATION_PARTS = activation_parts_from_env()


def _keel_linear(x: torch.Tensor, w: QuantizedWeight, parts: int | None = None) -> torch.Tensor:
    """keel's kernels (csrc/quant_gemm.cpp `quant_linear`): float32 in and out, 4 rows per
    call, activations as ACTIVATION_PARTS (or `parts`) says."""
    fn = _keel_ops().quant_linear
    parts = ACTIVATION_PARTS if parts is None else parts
    xf = x.float().contiguous()
    if isinstance(w, Int8Weight):
        args = (w.q, w.scales_f32, None, parts)
    else:
        args = (*w.keel, parts)
        k32 = w.keel[0].shape[1] * 2
        if xf.shape[-1] != k32:
            xf = F.pad(xf, (0, k32 - xf.shape[-1]))
    if xf.shape[0] <= KEEL_MAX_ROWS:
        return fn(xf, *args)
    return torch.cat([fn(xf[i : i + KEEL_MAX_ROWS], *args)
                      for i in range(0, xf.shape[0], KEEL_MAX_ROWS)])


def quantized_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
                     activation_parts: int | None = None) -> torch.Tensor:
    """x [T, K] @ W^T (+ bias) -> [T, N] in x's dtype (float32 in keel's kernels, with the
    activations as ACTIVATION_PARTS, or `activation_parts`, says; else bfloat16 inputs in
    torch's)."""
    dtype = x.dtype
    if isinstance(w, W8A8Weight):
        out = w8a8_linear(x, w)
        return out if bias is None else out + bias
    if (w.keel if isinstance(w, Int4Weight) else w.scales_f32) is not None:
        out = _keel_linear(x, w, activation_parts)
    elif isinstance(w, Int8Weight):
        xq = x.to(w.scales.dtype)
        out = torch.ops.aten._weight_int8pack_mm(xq.contiguous(), w.q, w.scales)
    else:
        xq = x.to(w.scales_and_zeros.dtype)
        k_pad = w.packed.shape[1] * 2
        if xq.shape[-1] != k_pad:
            xq = F.pad(xq, (0, k_pad - xq.shape[-1]))
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(xq.contiguous(), w.packed,
                                                         w.group_size, w.scales_and_zeros)
        if out.shape[-1] != w.out_features:
            out = out[..., : w.out_features]
    out = out.to(dtype)
    return out if bias is None else out + bias


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The float32 weight [N, K] the kernel computes with (tests, and rows of a table)."""
    if isinstance(w, Int8Weight):
        return w.q.float() * w.scales.float()[:, None]
    if isinstance(w, W8A8Weight):
        return torch.ops.quantized.linear_unpack(w.packed)[0].dequantize()
    eye = torch.eye(w.in_features, dtype=torch.bfloat16 if w.keel is None else torch.float32)
    return quantized_linear(eye, w, activation_parts=0).float().t().contiguous()


def uses_kernel(w: QuantizedWeight | None, x: torch.Tensor, has_dense: bool) -> bool:
    """Whether this pass goes to the quantized kernel (else the dense weight)."""
    return w is not None and (not has_dense or x.shape[0] <= w.max_rows)
