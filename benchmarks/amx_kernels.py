"""keel's AMX kernels against what they replace, on the default model's shapes (bfloat16):

- a long prompt chunk's causal attention (9 heads, 3 KV heads, head size 64): keel's AMX
  kernel (csrc/prefill_attention_amx.cpp), keel's AVX kernel (csrc/prefill_attention.cpp) and
  torch's SDPA;
- a decode step's GEMMs (30 layers' qkv / o / gate_up / down at 64 and 16 rows, each layer's
  own weight, so that they stream from memory as in a step, and layer 0's thirty times, in
  cache) and the LM head: keel's AMX GEMM (csrc/amx_gemm.cpp) and oneDNN's packed GEMM;
- decode attention over 30 layers' caches (64 requests x 632 keys, blocks in order): keel's
  paged-attention kernel from memory and with one layer's cache read thirty times (in cache).

    .venv/bin/python benchmarks/amx_kernels.py

On a CPU without AMX tiles the AMX columns say so and the rest is measured.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


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
    print(f"# {cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads | "
          f"AMX attention {'yes' if amx_attn else 'no'}, AMX GEMM {'yes' if amx_gemm else 'no'}")
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

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # qkv, o, gate_up, down
    weights = [(torch.randn(n, k) * 0.05).to(bf) for n, k in shapes]
    onednn = [pack_weight(w) for w in weights]
    tiles = [ops.amx_gemm_pack(w) for w in weights] if amx_gemm else []
    mb = sum(w.numel() * 2 for w in weights) / 1e6
    print(f"\na decode step's GEMMs (30 layers, {mb:.0f} MB of weights), ms")
    print("  rows  oneDNN from memory  AMX from memory  oneDNN in cache  AMX in cache")
    def gemms(rows: int, kind: str, hot: bool) -> float:
        if kind == "amx" and not amx_gemm:
            return float("nan")
        xs = {k: torch.randn(rows, k).to(bf) for k in (576, 1536)}
        idx = [i % 4 for i in range(120)] if hot else range(120)
        if kind == "amx":
            return best_seconds(lambda: [ops.amx_gemm(xs[shapes[i][1]], tiles[i], shapes[i][0])
                                         for i in idx], 10)
        return best_seconds(lambda: [packed_linear(xs[shapes[i][1]], onednn[i]) for i in idx],
                            10)

    for rows in (64, 16):
        t = {(kind, hot): gemms(rows, kind, hot) for kind in ("onednn", "amx")
             for hot in (False, True)}
        print(f"  {rows:4d}  {t['onednn', False] * 1e3:18.1f}  {t['amx', False] * 1e3:15.1f}"
              f"  {t['onednn', True] * 1e3:15.1f}  {t['amx', True] * 1e3:12.1f}")
    head = (torch.randn(49152, 576) * 0.05).to(bf)
    x = torch.randn(64, 576).to(bf)
    packed = pack_weight(head)
    one = best_seconds(lambda: packed_linear(x, packed), 10)
    amx = float("nan")
    if amx_gemm:
        head_tiles = ops.amx_gemm_pack(head)
        amx = best_seconds(lambda: ops.amx_gemm(x, head_tiles, 49152), 10)
    print(f"  LM head 64 x 49152 x 576: oneDNN {one * 1e3:.2f} ms, AMX {amx * 1e3:.2f} ms")

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
