"""keel's AMX GEMM (keel/csrc/amx_gemm.cpp) for bfloat16 passes: against a float32
reference (decode-sized passes, and prompt chunks in several panels of rows with a partial
last tile), through a linear layer (cpu_gemm: up to AMX_GEMM_MAX_ROWS rows on it, longer
passes on it where amx_prompt_chosen, else on oneDNN), and its arguments. Without AMX tiles
but with AVX512-BF16, amx_gemm and amx_gemm_argmax run the bfloat16 copy on its dot products
(keel/csrc/bf16_dot_gemm.cpp) and the same tests hold for it (`dense`); the int4 / int8
copies need the tiles. Where the build or CPU has neither, the op says so and raises (each
test checks that instead)."""

from __future__ import annotations

import pytest
import torch

from keel.cpu_ops import get_cpu_ops
from keel.model_executor.layers import amx_choice
from keel.model_executor.layers import gemm_choice as linear_mod
from keel.model_executor.layers.linear import ColumnParallelLinear
from keel.model_executor.layers.packed_weights import pack_for_cpu_gemm


@pytest.fixture(scope="module")
def ops():
    ops = get_cpu_ops()
    assert ops is not None, "the CPU kernels must build on this machine"
    return ops


def dense(ops):
    """Whether amx_gemm runs the bfloat16 copy here (AMX tiles, or AVX512-BF16's dots)."""
    return ops.amx_gemm_dense_available()


def reference(x, w, b):
    out = x.float() @ w.float().t()
    return out if b is None else out + b.float()


@pytest.mark.parametrize("m, n, k", [(1, 48, 64), (5, 960, 576), (16, 576, 576),
                                     (37, 3072, 576), (64, 576, 1536), (64, 80, 96),
                                     (130, 112, 32), (256, 64, 64), (300, 112, 96),
                                     (523, 960, 576)])
@pytest.mark.parametrize("bias", [None, torch.bfloat16, torch.float32])
def test_matches_float32_reference(ops, m, n, k, bias):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).to(bias) if bias is not None else None
    if not dense(ops):
        with pytest.raises(RuntimeError, match="no AMX-BF16 tiles nor AVX512-BF16"):
            ops.amx_gemm(x, ops.amx_gemm_pack(w), n, b)
        return
    out = ops.amx_gemm(x, ops.amx_gemm_pack(w), n, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    want = reference(x, w, b)
    # float32 sums rounded once to bfloat16 (2^-8 relative), in another order than torch's.
    assert ((out.float() - want).abs() <= 1e-2 * want.abs() + 1e-2).all()


@pytest.mark.parametrize("shape, message", [((48, 40), "K % 32"), ((40, 64), "N % 16")])
def test_pack_needs_whole_tiles(ops, shape, message):
    with pytest.raises(RuntimeError, match=message):
        ops.amx_gemm_pack(torch.zeros(shape, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.amx_gemm_pack(torch.zeros(64, 64))


@pytest.mark.parametrize("prompt", [False, True])
def test_layer_takes_it_for_short_passes_or_all(ops, monkeypatch, prompt):
    """A bfloat16 layer keeps oneDNN's packed weight and, where the AMX GEMM is chosen, its
    tile copy: passes of up to AMX_GEMM_MAX_ROWS rows go to amx_gemm, longer ones too where
    amx_prompt_chosen for plain passes (else to oneDNN; the [gate; up] + SiLU kind's choice is
    set the other way, to show that it is not the one read); all match the dense product."""
    monkeypatch.setattr(amx_choice, "_amx_gemm_faster", True)
    monkeypatch.setattr(amx_choice, "_amx_plain_prompt_faster", prompt)
    monkeypatch.setattr(amx_choice, "_amx_plain_long_faster", prompt)
    monkeypatch.setattr(amx_choice, "_amx_prompt_faster", not prompt)  # the other kind's
    monkeypatch.setattr(amx_choice, "_amx_long_faster", not prompt)
    monkeypatch.setattr(amx_choice, "_amx_bytes_left", 1 << 30)
    monkeypatch.setattr(linear_mod, "_keel_ops", ops)
    layer = ColumnParallelLinear(96, 80, bias=True, dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.05)
    torch.nn.init.normal_(layer.bias)
    dense_w, dense_b = layer.weight.detach().clone(), layer.bias.detach().clone()
    if not dense(ops):
        monkeypatch.setattr(amx_choice, "_amx_gemm_faster", None)
        assert not amx_choice.amx_gemm_chosen()  # no tiles, no AVX512-BF16: never chosen
        return
    pack_for_cpu_gemm(layer)
    if layer.packed_by != "onednn":
        return  # a torch without oneDNN's bfloat16: the plain layer (test_linear.py)
    assert layer.amx_weight is not None
    calls = []
    real = ops.amx_gemm
    monkeypatch.setattr(ops, "amx_gemm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 64, 65, 200):
        x = torch.randn(rows, 96).bfloat16()
        out = layer(x)
        want = reference(x, dense_w, dense_b)
        assert ((out.float() - want).abs() <= 1e-2 * want.abs() + 2e-2).all(), rows
    assert calls == ([1, 64, 65, 200] if prompt else [1, 64])


def test_copies_stop_at_the_memory_budget(monkeypatch):
    monkeypatch.setattr(amx_choice, "_amx_bytes_left", 1000)
    assert amx_choice._amx_budget(600)
    assert not amx_choice._amx_budget(600)  # 400 left
    assert not amx_choice._amx_budget(10)  # stopped for good


def int4_weight(n, k, g, half=True):
    """keel's int4 form (nibble pairs, d, m: W = q d + m per group of 32) and its dense
    bfloat16 weight, rounded from q d + m in float32 as a GGUF file's dequantized values."""
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    dtype = torch.float16 if half else torch.float32
    d = (torch.rand(n, k // 32, generator=g) * 0.01).to(dtype)
    m = (-torch.rand(n, k // 32, generator=g) * 0.08).to(dtype)
    w = (q.float().view(n, k // 32, 32) * d.float()[..., None] + m.float()[..., None])
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), d, m, w.view(n, k).bfloat16()


@pytest.mark.parametrize("m, n, k", [(1, 48, 64), (5, 960, 576), (37, 3072, 576),
                                     (64, 576, 1536), (130, 112, 32), (300, 112, 96)])
@pytest.mark.parametrize("half", [True, False])
def test_int4_copy_gives_the_bfloat16_copys_bits(ops, m, n, k, half):
    """The int4 copy widens to the same bfloat16 tiles, so the output is bit-identical; a copy
    whose int4 values do not give the dense weight exactly is refused (empty)."""
    g = torch.Generator().manual_seed(m + n + k)
    pairs, d, mins, w = int4_weight(n, k, g, half)
    if not ops.amx_gemm_available():
        with pytest.raises(RuntimeError, match="no AMX-BF16 tiles"):
            ops.amx_gemm_pack_int4(pairs, d, mins, w)
        return
    copy = ops.amx_gemm_pack_int4(pairs, d, mins, w)
    assert copy.dtype == torch.uint8 and copy.numel() * 4 == ((n + 31) // 32 * 32) * k * 3
    x = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    assert torch.equal(ops.amx_gemm(x, copy, n, b), ops.amx_gemm(x, ops.amx_gemm_pack(w), n, b))
    off = w.clone()
    off[n // 2, k - 1] = off[n // 2, k - 1] * 2 + 1  # one weight that int4 does not give
    assert ops.amx_gemm_pack_int4(pairs, d, mins, off).numel() == 0


def test_quantized_layer_keeps_the_int4_copy(ops, monkeypatch):
    """A layer that also keeps keel's int4 form gets the int4 copy (0.375x the bytes of the
    bfloat16 one), and its short passes are bit-identical to the bfloat16 copy's."""
    from keel.model_executor.layers.quantization import pack_int4_pairs

    monkeypatch.setattr(amx_choice, "_amx_gemm_faster", True)
    monkeypatch.setattr(amx_choice, "_amx_bytes_left", 1 << 30)
    monkeypatch.setattr(linear_mod, "_keel_ops", ops)
    if not dense(ops):
        monkeypatch.setattr(amx_choice, "_amx_gemm_faster", None)
        assert not amx_choice.amx_gemm_chosen()  # no AMX GEMM: no copy of either kind
        return
    tiles = ops.amx_gemm_available()  # else AVX512-BF16's dots: the bfloat16 copy only
    g = torch.Generator().manual_seed(3)
    pairs, d, mins, w = int4_weight(96, 128, g)
    x = torch.randn(20, 128, generator=g).bfloat16()
    for faster in (True, False):  # as amx_compressed_copy_chosen measured it on this CPU
        monkeypatch.setattr(amx_choice, "_compressed_faster", {"int4": faster})
        layer = ColumnParallelLinear(128, 96, bias=False, dtype=torch.bfloat16)
        layer.weight.data.copy_(w)
        # pack_int4_pairs takes pack_int4's (scale, zero) form: zero = m + 8 d
        layer.quant = pack_int4_pairs(pairs, d.float(), mins.float() + 8 * d.float(), 128)
        layer.quant.max_rows = 0  # every pass on the dense side
        layer.process_weights_after_loading()
        if faster and tiles:
            assert layer.amx_weight.dtype == torch.uint8
            assert layer.amx_weight.numel() == ops.amx_gemm_pack(w).numel() * 3 // 4
        else:
            assert layer.amx_weight.dtype == torch.bfloat16
        assert torch.equal(layer(x), ops.amx_gemm(x, ops.amx_gemm_pack(w), 96))


def test_compressed_copies_are_chosen_by_measuring(ops, monkeypatch):
    """The int4 and int8 copies are taken only where they measured faster than the bfloat16
    copy (once per process and kind); KEEL_AMX_COMPRESSED forces the answer."""
    monkeypatch.setattr(linear_mod, "_keel_ops", ops)
    if not ops.amx_gemm_available():  # no tiles: no copy of either kind, nothing measured
        monkeypatch.setattr(amx_choice, "_compressed_faster", {"int4": True, "int8": True})
        monkeypatch.setattr(amx_choice, "_time_compressed_copy", lambda kind: 1 / 0)
        assert not amx_choice.amx_compressed_copy_chosen("int4")
        assert not amx_choice.amx_compressed_copy_chosen("int8")
        return
    real, calls = amx_choice._time_compressed_copy, []

    def timed(kind):
        calls.append(kind)
        return kind == "int4"

    monkeypatch.setattr(amx_choice, "_time_compressed_copy", timed)
    monkeypatch.setattr(amx_choice, "_compressed_faster", {})
    monkeypatch.delenv("KEEL_AMX_COMPRESSED", raising=False)
    assert amx_choice.amx_compressed_copy_chosen("int4")
    assert not amx_choice.amx_compressed_copy_chosen("int8")
    assert amx_choice.amx_compressed_copy_chosen("int4") and calls == ["int4", "int8"]
    monkeypatch.setattr(amx_choice, "_compressed_faster", {})
    monkeypatch.setenv("KEEL_AMX_COMPRESSED", "0")
    assert not amx_choice.amx_compressed_copy_chosen("int4") and len(calls) == 2
    # Any other value is a clear error (it was silently measured), and nothing is cached.
    monkeypatch.setattr(amx_choice, "_compressed_faster", {})
    monkeypatch.setenv("KEEL_AMX_COMPRESSED", "yes")
    with pytest.raises(ValueError, match="KEEL_AMX_COMPRESSED='yes': expected 0"):
        amx_choice.amx_compressed_copy_chosen("int8")
    assert amx_choice._compressed_faster == {} and len(calls) == 2
    # The real measurement runs on both kinds (which answer depends on the CPU).
    assert all(isinstance(real(kind, layers=2), bool) for kind in ("int4", "int8"))


@pytest.mark.parametrize("m", [1, 20, 64, 300])
@pytest.mark.parametrize("int4, bias", [(False, None), (True, None), (False, torch.bfloat16),
                                        (True, torch.float32)])
def test_silu_epilogue_gives_silu_and_mul_of_the_gemm(ops, monkeypatch, m, int4, bias):
    """A [gate; up] layer that feeds silu_and_mul keeps its AMX copy interleaved by 16 rows;
    gemm_silu takes it with silu in the epilogue: bit-identical to silu_and_mul of the plain
    GEMM. A plain call of the layer does not use the interleaved copy. A prompt-sized pass
    (300 rows) takes the epilogue on the bfloat16 copy where amx_prompt_chosen, and never on
    an int4 copy (gemm_silu then says None: silu_and_mul after oneDNN's GEMM)."""
    from keel.model_executor.layers.linear import MergedColumnParallelLinear
    from keel.model_executor.layers.quantization import pack_int4_pairs

    monkeypatch.setattr(amx_choice, "_amx_gemm_faster", True)
    monkeypatch.setattr(amx_choice, "_amx_bytes_left", 1 << 30)
    monkeypatch.setattr(linear_mod, "_keel_ops", ops)
    monkeypatch.setattr(amx_choice, "_compressed_faster", {"int4": True})
    monkeypatch.setattr(amx_choice, "_amx_prompt_faster", True)
    monkeypatch.setattr(amx_choice, "_amx_long_faster", True)
    monkeypatch.setattr(amx_choice, "_amx_plain_prompt_faster", False)  # the other kind's
    monkeypatch.setattr(amx_choice, "_amx_plain_long_faster", False)
    if not dense(ops):
        monkeypatch.setattr(amx_choice, "_amx_gemm_faster", None)
        assert not amx_choice.amx_gemm_chosen()
        return
    int4_copy = int4 and ops.amx_gemm_available()  # AVX512-BF16's dots: the bfloat16 copy
    g = torch.Generator().manual_seed(m)
    inter, k = 96, 128
    pairs, d, mins, w = int4_weight(2 * inter, k, g)
    layer = MergedColumnParallelLinear(k, [inter, inter], bias=bias is not None,
                                       dtype=torch.bfloat16)
    layer.weight.data.copy_(w)
    if bias is not None:
        layer.bias.data.copy_(torch.randn(2 * inter, generator=g))
    if int4:
        layer.quant = pack_int4_pairs(pairs, d.float(), mins.float() + 8 * d.float(), k)
        layer.quant.max_rows = 0
    layer.silu_pairs = True
    layer.process_weights_after_loading()
    assert layer.amx_silu
    assert layer.amx_weight.dtype == (torch.uint8 if int4_copy else torch.bfloat16)
    x = torch.randn(m, k, generator=g).bfloat16()
    plain = ops.amx_gemm(x, ops.amx_gemm_pack(w), 2 * inter,
                         None if bias is None else layer.bias.to(bias))
    want = ops.silu_and_mul(plain)
    got = layer.gemm_silu(x)
    if int4_copy and m > amx_choice.AMX_GEMM_MAX_ROWS:
        assert got is None
    else:
        assert got.shape == (m, inter) and torch.equal(got, want)
    assert torch.equal(layer(x), linear_mod.packed_linear(x, layer.packed_weight, layer.bias))


def q8_0_weight(n, k, g):
    """A GGUF Q8_0 tensor's numbers: q in [-127, 127] with 127 reached in each block of 32,
    d a float16 per block; w = q d in float32."""
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g, dtype=torch.int32)
    q[:, :, 5] = 127 * torch.where(torch.rand(n, k // 32, generator=g) < 0.5, -1, 1)
    d = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    return q.to(torch.int8).view(n, k), d, (q.float() * d[..., None]).view(n, k)


@pytest.mark.parametrize("m, n, k", [(1, 48, 64), (37, 3072, 576), (64, 49152 // 16, 576)])
def test_int8_copy_gives_the_bfloat16_copys_bits(ops, m, n, k):
    """The int8 copy (a GGUF Q8_0 head's q and d per group of 32) likewise: the same output
    bits as the bfloat16 copy; refused where q d does not round to the dense weight."""
    g = torch.Generator().manual_seed(m + n)
    q, d, w32 = q8_0_weight(n, k, g)
    w = w32.bfloat16()
    if not ops.amx_gemm_available():
        with pytest.raises(RuntimeError, match="no AMX-BF16 tiles"):
            ops.amx_gemm_pack_int8(q, d, w)
        return
    copy = ops.amx_gemm_pack_int8(q, d, w)
    assert copy.dtype == torch.int8 and copy.numel() * 8 == ((n + 31) // 32 * 32) * k * 9
    x = torch.randn(m, k, generator=g).bfloat16()
    assert torch.equal(ops.amx_gemm(x, copy, n), ops.amx_gemm(x, ops.amx_gemm_pack(w), n))
    off = w.clone()
    off[0, 0] = off[0, 0] + 1
    assert ops.amx_gemm_pack_int8(q, d, off).numel() == 0


def test_q8_0_blocks_are_recovered_exactly_or_refused():
    """quantize_model recovers a Q8_0 head's own (q, d) from its float32 values; a tensor that
    is not q d per block of 32 gives None."""
    from keel.model_executor.quantize_model import q8_0_blocks_of

    g = torch.Generator().manual_seed(0)
    q, d, w = q8_0_weight(64, 128, g)
    w[3, 32:64] = 0.0  # an all-zero block: d = 0
    q[3, 32:64] = 0
    d[3, 1] = 0.0
    got = q8_0_blocks_of(w)
    assert got is not None and torch.equal(got[0], q) and torch.equal(got[1], d)
    assert q8_0_blocks_of(torch.randn(64, 128, generator=g)) is None
    assert q8_0_blocks_of(w[:, :100].contiguous()) is None  # K not a multiple of 32


def _unset_prompt_choices(monkeypatch):
    for name in ("_amx_prompt_faster", "_amx_long_faster", "_amx_plain_prompt_faster",
                 "_amx_plain_long_faster"):
        monkeypatch.setattr(amx_choice, name, None)


def test_prompt_passes_are_chosen_by_measuring(ops, monkeypatch):
    """Prompt-sized passes go to the AMX GEMM only where they measured faster on it than on
    oneDNN, in two kinds apart ([gate; up] with SiLU in the epilogue, timed on a prompt
    chunk's MLP; plain passes, timed on qkv, o and down), once per process; past
    AMX_PROMPT_SPLIT_ROWS rows a second choice, measured at 2,048; never without the AMX GEMM
    for decode passes; KEEL_AMX_PROMPT forces every answer."""
    monkeypatch.setattr(linear_mod, "_keel_ops", ops)
    _unset_prompt_choices(monkeypatch)
    monkeypatch.setattr(amx_choice, "_amx_gemm_faster", False)
    monkeypatch.setenv("KEEL_AMX_PROMPT", "1")
    for silu in (True, False):  # no AMX GEMM at all: not for prompts either
        assert not amx_choice.amx_prompt_chosen(silu)
    _unset_prompt_choices(monkeypatch)
    monkeypatch.setenv("KEEL_AMX_PROMPT", "on")  # a bad value is refused without AMX too
    with pytest.raises(ValueError, match="KEEL_AMX_PROMPT='on': expected 0"):
        amx_choice.amx_prompt_chosen(silu=True)
    if not dense(ops):
        return
    monkeypatch.setattr(amx_choice, "_amx_gemm_faster", True)
    _unset_prompt_choices(monkeypatch)
    monkeypatch.setenv("KEEL_AMX_PROMPT", "yes")
    with pytest.raises(ValueError, match="KEEL_AMX_PROMPT='yes': expected 0"):
        amx_choice.amx_prompt_chosen(silu=False)
    for forced in ("0", "1"):
        _unset_prompt_choices(monkeypatch)
        monkeypatch.setenv("KEEL_AMX_PROMPT", forced)
        for silu in (True, False):
            assert amx_choice.amx_prompt_chosen(silu) == (forced == "1")
            assert amx_choice.amx_long_chosen(silu) == (forced == "1")
    # Measured: the MLP faster on keel's at 512 rows and on oneDNN's at 2,048; the plain
    # GEMMs faster on oneDNN's at both -> [gate; up] + SiLU on keel's up to the split only,
    # plain passes never.
    calls = []

    def timing(kind, keel_faster_at):
        def time_of(kernel, rows=512):
            def run():
                calls.append((kind, kernel, rows))
                return 1.0 if (kernel == "amx") == (rows in keel_faster_at) else 2.0
            return run
        return time_of

    monkeypatch.setattr(amx_choice, "_time_prompt_mlp", timing("mlp", {512}))
    monkeypatch.setattr(amx_choice, "_time_prompt_plain", timing("plain", set()))
    _unset_prompt_choices(monkeypatch)
    monkeypatch.delenv("KEEL_AMX_PROMPT")
    assert amx_choice.amx_prompt_chosen(silu=True) and amx_choice.amx_prompt_chosen(silu=True)
    assert not amx_choice.amx_long_chosen(silu=True) and not amx_choice.amx_long_chosen(silu=True)
    assert not amx_choice.amx_prompt_chosen(silu=False)
    assert not amx_choice.amx_long_chosen(silu=False)  # (no plain prompt passes: not measured)
    assert sorted(set(calls)) == [("mlp", "amx", 512), ("mlp", "amx", 2048),
                                  ("mlp", "onednn", 512), ("mlp", "onednn", 2048),
                                  ("plain", "amx", 512), ("plain", "onednn", 512)]
    assert len(calls) == 12  # 2 rounds of each pair, each measured once
    split = amx_choice.AMX_PROMPT_SPLIT_ROWS
    bf16 = torch.empty(0, dtype=torch.bfloat16)
    assert amx_choice.amx_takes(bf16, 65, silu=True)
    assert amx_choice.amx_takes(bf16, split, silu=True)
    assert not amx_choice.amx_takes(bf16, split + 1, silu=True)
    assert amx_choice.amx_takes(bf16, 64, silu=False)
    assert not amx_choice.amx_takes(bf16, 65, silu=False)
    monkeypatch.setattr(amx_choice, "_amx_long_faster", True)
    assert amx_choice.amx_takes(bf16, 1 << 20, silu=True)
    # An int4 copy never takes a prompt pass, whatever was chosen.
    assert not amx_choice.amx_takes(torch.empty(0, dtype=torch.uint8), 65, silu=True)


def test_prompt_mlp_timing_runs(ops, monkeypatch):
    """The real measurements time both kernels' MLP and plain GEMMs (which is faster depends
    on the CPU)."""
    monkeypatch.setattr(linear_mod, "_keel_ops", ops)
    if not dense(ops):
        return
    for kernel in ("amx", "onednn"):
        t = amx_choice._time_prompt_mlp(kernel, rows=64, inter=128, hidden=64)()
        assert 0 < t < 10
        t = amx_choice._time_prompt_plain(kernel, rows=64, inter=128, hidden=64, qkv=96)()
        assert 0 < t < 10


def test_a_rows_output_does_not_depend_on_the_pass(ops):
    """Every row is summed in the same order whatever the pass's size, panel or tile: a
    prompt chunk's rows (panels of 512 where a pair of the weight fits in L1, as at K = 576,
    else of 128; a padded last tile) give the bits that the same rows give in decode-sized
    passes, or alone. (On AVX512-BF16's dots: tiles of 1-10 rows, items of one or two pairs
    of panels.)"""
    if not dense(ops):
        return
    g = torch.Generator().manual_seed(5)
    m, n, k = 1100, 160, 576
    x = torch.randn(m, k, generator=g).bfloat16()
    packed = ops.amx_gemm_pack((torch.randn(n, k, generator=g) * 0.05).bfloat16())
    whole = ops.amx_gemm(x, packed, n)
    assert torch.equal(torch.cat([ops.amx_gemm(x[i : i + 64], packed, n)
                                  for i in range(0, m, 64)]), whole)
    for i in (0, 127, 128, 511, 512, 1099):
        assert torch.equal(ops.amx_gemm(x[i : i + 1], packed, n), whole[i : i + 1])


@pytest.mark.parametrize("onednn_faster_by", [1.1, 2.0])
def test_amx_gemm_choice_favours_keel_within_the_margin(ops, monkeypatch, onednn_faster_by):
    """The AMX GEMM is measured against oneDNN's once per process, with the weight hot, 5
    rounds in turn, and kept unless oneDNN's is faster by more than OWN_KERNEL_MARGIN: the
    hot measurement understates its lead when a decode step reads the weights from memory."""
    calls = []

    def fake_timer(dtype, kernel="onednn", *args):
        return lambda: calls.append(kernel) or {"amx": onednn_faster_by, "onednn": 1.0}[kernel]

    monkeypatch.delenv("KEEL_AMX_GEMM", raising=False)
    monkeypatch.delenv("KEEL_CPU_GEMM", raising=False)
    monkeypatch.setattr(linear_mod, "_gemm_timer", fake_timer)
    monkeypatch.setattr(amx_choice, "_amx_gemm_faster", None)
    if not (dense(ops) and linear_mod._onednn_available()):
        assert not amx_choice.amx_gemm_chosen() and not calls  # nothing to measure
        return
    keel = onednn_faster_by < linear_mod.OWN_KERNEL_MARGIN
    assert amx_choice.amx_gemm_chosen() == keel and amx_choice.amx_gemm_chosen() == keel
    assert sorted(calls) == ["amx"] * 5 + ["onednn"] * 5  # measured once, 5 rounds in turn


def _torch_argmax(out: torch.Tensor) -> torch.Tensor:
    return out.float().argmax(dim=-1)


@pytest.mark.parametrize("m, n, n_valid", [(1, 96, 96), (5, 1024, 1000), (16, 49152, 49152),
                                           (64, 3072, 3072), (70, 480, 470), (300, 960, 960)])
@pytest.mark.parametrize("copy", ["bfloat16", "int8"])
def test_argmax_in_the_epilogue_is_torchs_argmax_of_the_output(ops, m, n, n_valid, copy):
    """amx_gemm_argmax (greedy sampling in the LM head): each row's index of its largest value
    among columns [0, n_valid), as torch's argmax of amx_gemm's bfloat16 output gives it: ties
    (equal columns, and +0 / -0) go to the first, a NaN beats every number and the first NaN
    wins, padded columns are never chosen; over several panels of rows and a partial tile."""
    g = torch.Generator().manual_seed(m + n)
    k = 576
    q, d, _ = q8_0_weight(n, k, g)
    x = torch.randn(m, k, generator=g).bfloat16()
    x[m // 2] = 0  # a row of zeros: every column ties (with -0 and +0 among them)
    if not dense(ops):
        with pytest.raises(RuntimeError, match="no AMX-BF16 tiles"):
            ops.amx_gemm_argmax(x, torch.empty(0, dtype=torch.bfloat16), n, n_valid)
        return
    if copy == "int8" and not ops.amx_gemm_available():  # AVX512-BF16's dots: no int8 copy
        with pytest.raises(RuntimeError, match="no AMX-BF16 tiles"):
            ops.amx_gemm_pack_int8(q, d, q.float().bfloat16())
        return
    # Ties: column 7 made large (the argmax of about half the rows) and copied into a later
    # column, which another thread computes; past n_valid, a padded column twice as large.
    d[7] *= 8
    q[n - 40], d[n - 40] = q[7], d[7]
    if n_valid < n:
        q[n - 1], d[n - 1] = q[7], d[7] * 2
    w = (q.float().view(n, k // 32, 32) * d[..., None]).view(n, k).bfloat16()
    packed = ops.amx_gemm_pack_int8(q, d, w) if copy == "int8" else ops.amx_gemm_pack(w)
    assert packed.numel()
    out = ops.amx_gemm(x, packed, n)
    want = _torch_argmax(out[:, :n_valid])
    got = ops.amx_gemm_argmax(x, packed, n, n_valid)
    assert got.dtype == torch.int64 and got.shape == (m,)
    assert torch.equal(got, want)
    assert int(got[m // 2]) == 0
    assert m < 5 or (got == 7).sum() >= m // 4  # the tie was there to break
    # A NaN column (a NaN weight) beats every number; of two, the first.
    w_nan = w.clone()
    w_nan[n_valid - 3, 5] = float("nan")
    w_nan[n_valid - 2, 9] = float("nan")
    nan_packed = ops.amx_gemm_pack(w_nan)
    got = ops.amx_gemm_argmax(x, nan_packed, n, n_valid)
    assert torch.equal(got, _torch_argmax(ops.amx_gemm(x, nan_packed, n)[:, :n_valid]))
    assert (got == n_valid - 3).all()


def test_argmax_in_the_epilogue_checks_its_arguments(ops):
    x = torch.randn(3, 64).bfloat16()
    if not dense(ops):
        with pytest.raises(RuntimeError, match="no AMX-BF16 tiles"):
            ops.amx_gemm_argmax(x, torch.empty(0, dtype=torch.bfloat16), 64, 64)
        return
    packed = ops.amx_gemm_pack(torch.randn(64, 64).bfloat16())
    for bad in (0, 65):
        with pytest.raises(RuntimeError, match="n_valid"):
            ops.amx_gemm_argmax(x, packed, 64, bad)
    with pytest.raises(RuntimeError, match="another shape"):
        ops.amx_gemm_argmax(x, packed, 32, 32)
    with pytest.raises(RuntimeError, match="bfloat16 x"):
        ops.amx_gemm_argmax(x.float(), packed, 64, 64)
    assert ops.amx_gemm_argmax(x[:0], packed, 64, 64).shape == (0,)


def test_dots_take_the_bfloat16_copy_where_there_are_no_tiles(ops):
    """amx_gemm runs the bfloat16 copy wherever the build has AMX tiles or AVX512-BF16
    (bf16_dot_gemm, the latter's `vdpbf16ps`); an int4 or int8 copy without the tiles is
    refused with a message that says so."""
    has_bf16 = "avx512_bf16" in ops.built_for()
    assert ops.bf16_dot_gemm_available() == has_bf16
    assert dense(ops) == (ops.amx_gemm_available() or has_bf16)
    if ops.amx_gemm_available() or not has_bf16:
        return
    x = torch.randn(4, 64).bfloat16()
    fake_int4 = torch.zeros(2 * 768, dtype=torch.uint8)  # [N = 64, K = 64] in size
    with pytest.raises(RuntimeError, match="an int4 or int8 copy needs them"):
        ops.amx_gemm(x, fake_int4, 64)
    with pytest.raises(RuntimeError, match="an int4 or int8 copy needs them"):
        ops.amx_gemm_argmax(x, torch.zeros(2 * 1152, dtype=torch.int8), 64, 64)


@pytest.mark.parametrize("m", [9, 64, 300])
def test_non_temporal_weight_prefetch_gives_the_same_bits(ops, m):
    """The dense copy's passes give the same bits with the weights prefetched non-temporally
    or into L2 (gemm_prefetch_nta: bf16_dot_gemm's and i16_gemm's decode passes, on AMD by
    default): plain, with SiLU, and the argmax."""
    if not dense(ops):
        return
    g = torch.Generator().manual_seed(m)
    n, k = 1536, 576
    x = torch.randn(m, k, generator=g).bfloat16()
    packed = ops.amx_gemm_pack((torch.randn(n, k, generator=g) * 0.05).bfloat16())
    bias = torch.randn(n, generator=g)
    default = ops.gemm_prefetch_nta()
    try:
        outs = []
        for nta in (True, False):
            assert ops.gemm_prefetch_nta(nta) is nta
            outs.append((ops.amx_gemm(x, packed, n, bias), ops.amx_gemm(x, packed, n, bias, True),
                         ops.amx_gemm_argmax(x, packed, n, n - 5, bias)))
        for a, b in zip(*outs):
            assert torch.equal(a, b)
    finally:
        ops.gemm_prefetch_nta(default)


@pytest.mark.parametrize("dots_faster_at", [(64, 512), (64,), ()])
def test_dots_are_measured_against_float32_where_onednn_bfloat16_is_slower(
        ops, monkeypatch, dots_faster_at):
    """Where oneDNN's bfloat16 GEMMs measure slower than float32 (an Intel Xeon with
    AVX512-BF16 and no AMX), a CPU with AVX512-BF16 and no tiles also times keel's GEMM on its
    dot products against the float32 GEMM a bfloat16 layer would take (keel's over the
    bfloat16 weight), at 64 and at 512 rows: bfloat16 layers stay bfloat16 only where it wins
    at both. Elsewhere nothing more is measured."""
    calls, real_timer = [], linear_mod._gemm_timer

    def fake_timer(dtype, kernel="onednn", rows=64, *args):
        def run():
            calls.append((dtype, kernel, rows))
            if kernel == "amx":
                return 1.0 if rows in dots_faster_at else 3.0
            return 4.0 if (dtype, kernel) == (torch.bfloat16, "onednn") else 2.0
        return run

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True,
                        raising=False)
    monkeypatch.setattr(linear_mod, "_gemm_timer", fake_timer)
    monkeypatch.setattr(linear_mod, "_keel_gemm_faster", True)
    monkeypatch.setattr(linear_mod, "_bf16_slower_than_fp32", None)
    monkeypatch.setattr(amx_choice, "_dots_beat_float32", None)
    monkeypatch.delenv("KEEL_AMX_GEMM", raising=False)
    monkeypatch.delenv("KEEL_CPU_GEMM", raising=False)
    in_float32 = linear_mod.bf16_gemm_in_float32(torch.zeros(64, 64, dtype=torch.bfloat16))
    if not linear_mod._onednn_available():
        return  # no oneDNN: float32 without measuring (test_packed_linear.py)
    dots = [c for c in calls if c[1] == "amx"]
    if ops.amx_gemm_available() or not dense(ops):
        assert in_float32 and not dots
        return
    assert in_float32 == (dots_faster_at != (64, 512))
    measured = [64] if 64 not in dots_faster_at else [64, 512]
    from collections import Counter

    # oneDNN's two precisions once (3 rounds), then the dots against keel's float32 GEMM over
    # the bfloat16 weight, 5 rounds each, at 64 rows and (where that won) at 512.
    assert Counter(calls) == Counter(
        {(torch.float32, "onednn", 64): 3, (torch.bfloat16, "onednn", 64): 3,
         **{(torch.bfloat16, k, r): 5 for k in ("amx", "keel") for r in measured}})
    n = len(calls)
    assert linear_mod.bf16_gemm_in_float32(torch.zeros(64, 64, dtype=torch.bfloat16)) == \
        in_float32 and len(calls) == n  # once per process
    # The real timings run (which side wins depends on the CPU).
    monkeypatch.setattr(linear_mod, "_gemm_timer", real_timer)
    monkeypatch.setattr(amx_choice, "_dots_beat_float32", None)
    assert isinstance(amx_choice.bf16_dots_beat_float32(), bool)


def test_a_layer_without_its_copy_is_computed_in_float32_where_the_dots_chose_bfloat16(
        ops, monkeypatch):
    """Where bfloat16 layers stay bfloat16 only because keel's GEMM on AVX512-BF16's dots beat
    float32 (bf16_dots_beat_float32; oneDNN's bfloat16 measured slower), a layer that gets no
    copy (here: the copies' memory budget spent) is computed in float32 on keel's GEMM, as it
    was before, not on oneDNN's slower bfloat16; with its copy it keeps oneDNN's packed weight
    beside it for the longer passes. Both match the dense product."""
    if not dense(ops) or ops.amx_gemm_available():
        return  # (AMX tiles, or no AVX512-BF16: the dots never decide this)
    monkeypatch.setattr(linear_mod, "_keel_ops", ops)
    monkeypatch.setattr(linear_mod, "_keel_gemm_faster", True)
    monkeypatch.setattr(linear_mod, "_bf16_slower_than_fp32", False)
    monkeypatch.setattr(amx_choice, "_dots_beat_float32", True)
    monkeypatch.setattr(amx_choice, "_amx_gemm_faster", True)
    for name in ("_amx_prompt_faster", "_amx_long_faster", "_amx_plain_prompt_faster",
                 "_amx_plain_long_faster"):
        monkeypatch.setattr(amx_choice, name, False)
    for budget, packed_by in ((1 << 30, "onednn"), (-1, "keel")):
        monkeypatch.setattr(amx_choice, "_amx_bytes_left", budget)
        layer = ColumnParallelLinear(96, 80, bias=True, dtype=torch.bfloat16)
        torch.nn.init.normal_(layer.weight, std=0.05)
        torch.nn.init.normal_(layer.bias)
        dense_w, dense_b = layer.weight.detach().clone(), layer.bias.detach().clone()
        pack_for_cpu_gemm(layer)
        assert layer.packed_by == packed_by
        assert (getattr(layer, "amx_weight", None) is not None) == (packed_by == "onednn")
        for rows in (4, 100):
            x = torch.randn(rows, 96).bfloat16()
            want = reference(x, dense_w, dense_b)
            assert ((layer(x).float() - want).abs() <= 1e-2 * want.abs() + 2e-2).all()
