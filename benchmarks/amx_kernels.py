"""keel's AMX kernels against what they replace, on the default model's shapes (bfloat16):

- a long prompt chunk's causal attention (9 heads, 3 KV heads, head size 64): keel's AMX
  kernel (csrc/prefill_attention_amx.cpp), keel's AVX kernel (csrc/prefill_attention.cpp) and
  torch's SDPA;
- a decode step's GEMMs (30 layers' qkv / o / gate_up / down at 64 and 16 rows, each layer's
  own weight, so that they stream from memory as in a step, and layer 0's thirty times, in
  cache) and the LM head: keel's AMX GEMM (csrc/amx_gemm.cpp) over its bfloat16 copy and over
  the int4 (layers) or int8 (LM head) copy of a GGUF file's blocks, and oneDNN's packed GEMM;
- decode attention over 30 layers' caches (64 requests x 632 keys, blocks in order): keel's
  paged-attention kernel from memory and with one layer's cache read thirty times (in cache).

    .venv/bin/python benchmarks/amx_kernels.py

On a CPU without AMX tiles the AMX columns say so and the rest is measured; where it has
AVX512-BF16 instead, the bfloat16 copy's columns are keel's GEMM on its dot products
(csrc/bf16_dot_gemm.cpp), which amx_gemm runs there.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _unpack(pairs):
    """Nibble pairs [N, K / 2] -> q [N, K] (element 2j in byte j's low nibble)."""
    import torch

    return torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).reshape(pairs.shape[0], -1)


def main() -> None:
    logging.disable(logging.WARNING)
    import torch
    import torch.nn.functional as F

    from keel.cpu_ops import get_cpu_ops
    from keel.model_executor.layers.linear import pack_weight, packed_linear
    from keel.utils import best_seconds, cpu_model

    ops = get_cpu_ops()
    assert ops is not None, "keel's CPU kernels did not build here"
    amx_attn = ops.prefill_attention_amx_available()
    amx_gemm = ops.amx_gemm_available()
    # The bfloat16 copy also runs without tiles, on AVX512-BF16's dot products (bf16_dot_gemm).
    dense = ops.amx_gemm_dense_available()
    print(f"# {cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads | "
          f"AMX attention {'yes' if amx_attn else 'no'}, AMX GEMM {'yes' if amx_gemm else 'no'}"
          + ("" if amx_gemm or not dense else ", its bfloat16 copy on vdpbf16ps"))
    torch.manual_seed(0)
    bf = torch.bfloat16

    print("\nprefill attention, one causal chunk (9 heads, 3 KV heads, D 64), ms")
    print("  tokens  AMX kernel  AVX kernel    SDPA")
    def chunk(n: int) -> tuple[float, float, float]:
        q, k, v = (torch.randn(n, h, 64).to(bf) for h in (9, 3, 3))
        out = torch.empty(n, 9 * 64, dtype=bf)
        qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        amx = (best_seconds(lambda: ops.prefill_attention_amx(q, k, v, out, 0.125, 0), 10)
               if amx_attn else float("nan"))
        avx = best_seconds(lambda: ops.prefill_attention(q, k, v, out, 0.125, 0), 5)
        sdpa = best_seconds(lambda: F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, enable_gqa=True), 10)
        return amx, avx, sdpa

    for n in (300, 512, 800):
        amx, avx, sdpa = chunk(n)
        print(f"  {n:6d}  {amx * 1e3:10.2f}  {avx * 1e3:10.2f}  {sdpa * 1e3:6.2f}")

    # Weights as a GGUF Q4_1 file's (q d + m per group of 32, d and m float16), so that the AMX
    # GEMM's int4 copy widens to exactly the bfloat16 weight.
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # qkv, o, gate_up, down
    int4 = []
    for n, k in shapes:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        d = (torch.rand(n, k // 32) * 0.01).half()
        m = (-torch.rand(n, k // 32) * 0.08).half()
        int4.append(((q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), d, m))
    weights = [(q8.float().view(n, k // 32, 32) * d.float()[..., None]
                + m.float()[..., None]).view(n, k).to(bf)
               for (n, k), (q8, d, m) in zip(shapes, ((_unpack(p), d, m) for p, d, m in int4))]
    onednn = [pack_weight(w) for w in weights]
    tiles = [ops.amx_gemm_pack(w) for w in weights] if dense else []
    tiles4 = ([ops.amx_gemm_pack_int4(*c, w) for c, w in zip(int4, weights)]
              if amx_gemm else [])
    mb = sum(w.numel() * 2 for w in weights) / 1e6
    print(f"\na decode step's GEMMs (30 layers, {mb:.0f} MB of bfloat16 weights), ms")
    print("  rows  weights   oneDNN  AMX bf16 copy  AMX int4 copy")
    def gemms(rows: int, kind: str, hot: bool) -> float:
        if (kind == "amx" and not dense) or (kind == "amx4" and not amx_gemm):
            return float("nan")
        xs = {k: torch.randn(rows, k).to(bf) for k in (576, 1536)}
        idx = [i % 4 for i in range(120)] if hot else range(120)
        if kind != "onednn":
            copies = tiles if kind == "amx" else tiles4
            return best_seconds(lambda: [ops.amx_gemm(xs[shapes[i][1]], copies[i], shapes[i][0])
                                         for i in idx], 10)
        return best_seconds(lambda: [packed_linear(xs[shapes[i][1]], onednn[i]) for i in idx],
                            10)

    for rows in (64, 16):
        for hot in (False, True):
            t = [gemms(rows, kind, hot) * 1e3 for kind in ("onednn", "amx", "amx4")]
            print(f"  {rows:4d}  {'in cache' if hot else 'memory':8s}  {t[0]:7.1f}  {t[1]:13.1f}"
                  f"  {t[2]:13.1f}")

    # The LM head as a GGUF Q8_0 tensor's (q d per block of 32, d float16), from memory (an
    # 800 MB sweep in between) and in cache.
    q = torch.randint(-127, 128, (49152, 576), dtype=torch.int8)
    d = (torch.rand(49152, 576 // 32) * 0.01).half().float()
    head = (q.float().view(49152, 18, 32) * d[..., None]).view(49152, 576).to(bf)
    x = torch.randn(64, 576).to(bf)
    packed = pack_weight(head)
    sweep = torch.empty(800 << 20, dtype=torch.uint8)

    def head_ms(fn, cold: bool) -> float:
        ts = []
        for _ in range(8):
            if cold:
                sweep.add_(1)
            ts.append(best_seconds(fn, 1))
        return sorted(ts)[len(ts) // 2] * 1e3

    fns = {"oneDNN": lambda: packed_linear(x, packed)}
    if dense:
        head_tiles = ops.amx_gemm_pack(head)
        fns["AMX bf16 copy"] = lambda: ops.amx_gemm(x, head_tiles, 49152)
    if amx_gemm:
        head8 = ops.amx_gemm_pack_int8(q, d, head)
        fns["AMX int8 copy"] = lambda: ops.amx_gemm(x, head8, 49152)
    for cold in (True, False):
        print(f"  LM head 64 x 49152 x 576, {'from memory' if cold else 'in cache'}: "
              + ", ".join(f"{k} {head_ms(f, cold):.2f} ms" for k, f in fns.items()))

    print("\ndecode attention, 30 layers, 64 requests x 632 keys (bfloat16 K/V), ms")
    layers, reqs, ctx, bs = 30, 64, 632, 16
    per = -(-ctx // bs)
    caches = [(torch.randn(reqs * per, 3, bs, 64).to(bf), torch.randn(reqs * per, 3, bs, 64).to(bf))
              for _ in range(layers)]
    table = torch.arange(reqs * per, dtype=torch.int32).view(reqs, per)
    lens = torch.full((reqs,), ctx, dtype=torch.long)
    q = torch.randn(reqs, 9, 64).to(bf)

    def attend(cs):
        return lambda: [ops.paged_attention(q, k, v, table, lens, None, 0.125, 0) for k, v in cs]

    cold = best_seconds(attend(caches), 5)
    hot = best_seconds(attend([caches[0]] * layers), 5)
    gb = layers * reqs * ctx * 3 * 64 * 2 * 2 / 1e9
    print(f"  from memory {cold * 1e3:.1f} ms ({gb / cold:.1f} GB/s of K/V); one layer's cache "
          f"x30 (in cache) {hot * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
