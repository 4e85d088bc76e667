"""A linear layer's weight packed for the CPU GEMM chosen for it (gemm_choice.py), and the
GEMM over it: `pack_for_cpu_gemm` at load (`process_weights_after_loading`), `cpu_gemm` in each
forward. Where the CPU has AMX tiles, a bfloat16 layer on oneDNN also gets the AMX GEMM's copy
of its weight here, if that GEMM is chosen and the copies' memory budget allows.

The choices are read through the `gemm_choice` module at call time (`choice.<name>`): they
are made there once per process, and tests replace them there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from keel.model_executor.layers import amx_choice
from keel.model_executor.layers import gemm_choice as choice

logger = logging.getLogger(__name__)


def _amx_copy(module: nn.Module, w: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """The AMX GEMM's copy of the bfloat16 weight `w` (its rows in `order` if given): from the
    layer's int4 groups where it keeps keel's int4 form (a GGUF file's Q4 tensors; for a dense
    folder keel converted from one, `amx_int4`: quantize_model.attach_gguf_amx_sources) and they
    widen to exactly `w` (0.75 bytes a weight read per pass instead of 2), else `w` in
    bfloat16 tiles."""
    int4 = getattr(getattr(module, "quant", None), "keel", None) or getattr(
        module, "amx_int4", None)
    if order is not None:
        w = w[order]
        int4 = None if int4 is None else tuple(t[order] for t in int4)
    if int4 is not None and int4[0].shape[1] * 2 == w.shape[1] \
            and amx_choice.amx_compressed_copy_chosen("int4"):
        copy = choice._keel_ops.amx_gemm_pack_int4(*(t.contiguous() for t in int4),
                                                   w.contiguous())
        if copy.numel():
            return copy
    return choice._keel_ops.amx_gemm_pack(w.contiguous())


def _fp16_pack(module: nn.Module, w: torch.Tensor, kind: str) -> bool:
    """Pack the float32 weight `w` for the reduced-precision GEMM `kind`
    (gemm_choice.fp16_gemm_chosen): fp16_gemm (packed_by "fp16", its largest |W| in
    `fp16_w_max`) or i16_gemm (packed_by "i16", its blocks' scales in `i16_scales`); False
    where the kernel cannot hold its values (it then stays float32). A [gate; up] layer that
    only feeds silu_and_mul gets its rows interleaved by 16 (`fp16_silu`, its bias alike in
    `fp16_bias`): gemm_silu takes silu in the epilogue, and a plain pass puts its columns back
    by `fp16_unorder`."""
    n = w.shape[0]
    pairs = getattr(module, "silu_pairs", False) and n % 32 == 0
    order = choice.silu_pair_order(n) if pairs else None
    pack = (choice._keel_ops.fp16_gemm_pack if kind == "fp16"
            else choice._keel_ops.i16_gemm_pack)
    try:
        packed, extra = pack(w if order is None else w[order])
    except RuntimeError as e:  # a value beyond float16's range, or not finite
        logger.warning("A [%d, %d] weight stays on the float32 GEMM: %s", *w.shape, e)
        return False
    module.packed_weight, module.packed_by = packed, kind
    if kind == "fp16":
        module.fp16_w_max = extra
    else:
        module.i16_scales = extra
    module.fp16_silu = pairs
    module.fp16_bias = (module.bias.detach()[order].float().contiguous()
                        if pairs and module.bias is not None else None)
    module.fp16_unorder = torch.argsort(order) if pairs else None
    return True


def release_packed(module: nn.Module) -> None:
    """Drop the module's packed dense copy and what goes with it: a quantized layer whose kernel
    was faster at every pass size keeps no dense weight (rows_per_pass.py). Left behind, an
    int16 copy's scales without its panels stopped the fused decode pass's plan from being
    built (`PlanLinear: i16_scales come with the int16 panels`)."""
    module.packed_weight, module.packed_by = None, ""
    for name, empty in (("i16_scales", None), ("fp16_w_max", 0.0), ("fp16_silu", False),
                        ("fp16_bias", None), ("fp16_unorder", None)):
        if hasattr(module, name):
            setattr(module, name, empty)


def pack_for_cpu_gemm(module: nn.Module, release_dense: bool = True, amx: bool = True) -> None:
    """Pack `module.weight` into `module.packed_weight` for the GEMM chosen for it
    (`module.packed_by`: "fp16" or "i16" for a float32 weight on float16 FMAs or int16 dot
    products where dtype="auto" allows them (_fp16_pack), "keel", "onednn", or "onednn-upcast" for a bfloat16 weight given
    to oneDNN as its float32 upcast), and (unless told to keep it) release the dense copy, as
    vLLM's CPU backend does. Nothing is packed where neither GEMM takes the weight. `amx`:
    whether a bfloat16 weight may also get the AMX GEMM's copy; a float32 weight of bfloat16
    values gets its copy for float32 passes either way (_amx_f32_copy)."""
    if module.packed_weight is not None:
        return
    w = module.weight
    in_float32 = choice.bf16_gemm_in_float32(w)
    low = (choice.fp16_gemm_chosen() if w.dtype == torch.float32 and w.device.type == "cpu"
           else None)
    if low is not None and _fp16_pack(module, w.detach(), low):
        pass  # packed for fp16_gemm or i16_gemm (dtype="auto" on an AVX-512 CPU without AMX)
    elif (w.dtype == torch.float32 or in_float32) and w.device.type == "cpu" \
            and choice.keel_gemm_chosen():
        module.packed_weight, module.packed_by = choice._keel_ops.gemm_pack(w.detach()), "keel"
    elif in_float32 and choice._onednn_available():
        module.packed_weight, module.packed_by = choice.pack_weight(w.float()), "onednn-upcast"
    elif choice.onednn_gemm_supported(w):
        module.packed_weight, module.packed_by = choice.pack_weight(w), "onednn"
        n, k = w.shape
        if amx and w.dtype == torch.bfloat16 and n % 16 == 0 and k % 32 == 0 \
                and amx_choice.amx_gemm_chosen() \
                and _keep_tile_copy(module, lambda order: _amx_copy(module, w.detach(), order)):
            for silu in (True, False):  # all measured now, at load, not in a prompt
                amx_choice.amx_long_chosen(silu)
        elif w.dtype == torch.bfloat16 and amx_choice._dots_beat_float32:
            # bfloat16 only for keel's GEMM on AVX512-BF16's dots (oneDNN's measured slower
            # than float32): a layer without its copy (the copies' memory budget spent, a
            # shape it does not take) is computed in float32, as it was before.
            module.packed_weight, module.packed_by = (
                (choice._keel_ops.gemm_pack(w.detach()), "keel") if choice.keel_gemm_chosen()
                else (choice.pack_weight(w.float()), "onednn-upcast"))
        module.amx_int4 = None  # a converted folder's int4 groups were only for the copy
    else:
        return
    module.packed_rows = w.shape[0]
    # The LM head's too (amx=False is for bfloat16 copies); not beside fp16_gemm's panels.
    if w.dtype == torch.float32 and module.packed_by not in choice.LOW_PRECISION_KINDS:
        _amx_f32_copy(module, w.detach())
    if release_dense:
        module.weight = nn.Parameter(w.new_empty(0), False)


def _keep_tile_copy(module: nn.Module, make: Callable[[torch.Tensor | None], torch.Tensor]
                    ) -> bool:
    """Keep the AMX GEMM's copy of `module`'s weight, `make(order)`, where the copies' memory
    budget allows. A [gate; up] layer that only feeds silu_and_mul gets its rows interleaved
    by 16 (`order`), so that each pair of tiles is 16 gate columns and their 16 up columns (the
    epilogue: amx_silu, with amx_bias alike)."""
    n = module.weight.shape[0]
    pairs = getattr(module, "silu_pairs", False) and n % 32 == 0
    order = choice.silu_pair_order(n) if pairs else None
    copy = make(order)
    if not amx_choice._amx_budget(copy.numel() * copy.element_size()):
        return False
    module.amx_weight, module.amx_silu = copy, pairs
    if pairs and module.bias is not None:
        module.amx_bias = module.bias.detach()[order].contiguous()
    return True


def _amx_f32_copy(module: nn.Module, w: torch.Tensor) -> None:
    """A float32 weight whose values are all bfloat16 (a bfloat16 checkpoint run in float32)
    also gets a bfloat16 tile copy where amx_f32_chosen: float32 passes then run on the AMX
    tiles (amx_gemm_f32, float32 results), every row count."""
    n, k = w.shape
    if n % 16 or k % 32 or not amx_choice.amx_f32_chosen():
        return
    w16 = w.bfloat16()
    if not torch.equal(w16.float(), w):
        return  # not a bfloat16 checkpoint's values: the copy would round them
    if _keep_tile_copy(module, lambda order: choice._keel_ops.amx_gemm_pack(
            (w16 if order is None else w16[order]).contiguous())):
        module.amx_f32 = True


def cpu_gemm(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ packed weight (+ bias); in float32 for a bfloat16 weight computed in float32,
    rounded back."""
    if module.packed_by in choice.LOW_PRECISION_KINDS:
        return _fp16_gemm(module, x, bias)
    amx = getattr(module, "amx_weight", None)
    if (amx is not None and getattr(module, "amx_f32", False) and not module.amx_silu
            and x.dim() == 2 and x.dtype == torch.float32):
        return choice._keel_ops.amx_gemm_f32(x, amx, module.packed_rows,
                                             None if bias is None else bias.float())
    if _amx_bf16_pass(module, x):
        return choice._keel_ops.amx_gemm(x, amx, module.packed_rows, bias)
    if module.packed_by == "keel":
        out = choice._keel_ops.gemm(x.float(), module.packed_weight, module.packed_rows,
                                    None if bias is None else bias.float())
        return out if x.dtype == torch.float32 else out.to(x.dtype)
    if module.packed_by == "onednn-upcast":
        out = choice.packed_linear(x.float(), module.packed_weight,
                                   None if bias is None else bias.float())
        return out.to(x.dtype)
    return choice.packed_linear(x, module.packed_weight, bias)


def cpu_gemm_argmax(module: nn.Module, x: torch.Tensor, n_valid: int) -> torch.Tensor | None:
    """Each row's argmax over columns [0, n_valid) of cpu_gemm(module, x, None), without its
    output, where cpu_gemm would take keel's AMX GEMM (amx_gemm_argmax: the same bfloat16
    values compared as torch's argmax compares them, so the same indices) or i16_gemm over a
    float32 x (i16_gemm_argmax: the same float32 values); None elsewhere."""
    if module.packed_by == "i16" and x.dim() == 2 and x.dtype == torch.float32:
        return choice._keel_ops.i16_gemm_argmax(x, module.packed_weight, module.i16_scales,
                                                module.packed_rows, n_valid)
    if module.packed_by in choice.LOW_PRECISION_KINDS or not _amx_bf16_pass(module, x):
        return None
    return choice._keel_ops.amx_gemm_argmax(x, module.amx_weight, module.packed_rows, n_valid)


def _amx_bf16_pass(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether cpu_gemm runs this bfloat16 pass on keel's AMX GEMM (amx_gemm) over the
    module's tile copy (a plain copy: not a [gate; up] one interleaved for SiLU)."""
    amx = getattr(module, "amx_weight", None)
    return (amx is not None and not getattr(module, "amx_silu", False) and x.dim() == 2
            and x.dtype == torch.bfloat16
            and amx_choice.amx_takes(amx, x.shape[0], silu=False))


def _low_gemm(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              silu_mul: bool = False) -> torch.Tensor:
    """fp16_gemm or i16_gemm over the module's packed weight (packed_by), float32 x."""
    ops = choice._keel_ops
    if module.packed_by == "fp16":
        return ops.fp16_gemm(x, module.packed_weight, module.packed_rows, module.fp16_w_max,
                             bias, silu_mul)
    return ops.i16_gemm(x, module.packed_weight, module.i16_scales, module.packed_rows, bias,
                        silu_mul)


def _fp16_gemm(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """cpu_gemm on fp16_gemm or i16_gemm (float32 in and out); an interleaved [gate; up]
    layer's columns put back in order."""
    if module.fp16_silu and bias is not None:
        bias = module.fp16_bias
    out = _low_gemm(module, x.float(), None if bias is None else bias.float())
    if module.fp16_silu:
        out = out.index_select(1, module.fp16_unorder)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def fp16_gemm_silu(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of an interleaved [gate; up] layer on fp16_gemm or i16_gemm (float32
    x)."""
    return _low_gemm(module, x, module.fp16_bias, True)
