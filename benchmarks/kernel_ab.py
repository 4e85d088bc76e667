"""Two builds of keel's CPU kernels timed against each other in one process, alternating.

On the shared hosts keel is measured on, a process can meet a phase of the host 30-60% slower
than the one before it, so a kernel change timed in one process and its predecessor in the
next can read either way. Here both builds are loaded side by side (each is its own module,
named by a digest of its sources: `~/.cache/torch_extensions/keel/keel_cpu_ops_<digest>`; the
bindings' classes are module-local so that two load together) and each round runs one
workload on A, then on B, then the next round in the other order; the report is each build's
median, first quartile and best over the rounds, and B's median / A's.

Build B first by importing keel from the other tree (it prints the folder's name), e.g.:

    git worktree add /tmp/old HEAD~1
    PYTHONPATH=/tmp/old .venv/bin/python -c "import keel.cpu_ops as c; print(c.get_cpu_ops())"
    .venv/bin/python benchmarks/kernel_ab.py keel_cpu_ops_<new> keel_cpu_ops_<old> \\
        --cases gemm head attention

Cases, on the default model's shapes (bfloat16 unless said, 64 rows as a decode step of 64 requests):
- `gemm`: a decode step's 120 decoder GEMMs on amx_gemm (each layer's own weight, 212 MB
  streamed from memory as in a step; [gate; up] with SiLU in the epilogue).
- `head`: the LM head, 64 x 49,152 x 576 from memory (a 256 MB sweep before each call, not
  timed): amx_gemm then argmax_rows, and amx_gemm_argmax.
- `attention`: paged_attention over 30 layers' bfloat16 caches, 64 rows x 364-864 keys, with
  bfloat16 queries and with float32 ones (`auto` on a CPU without AMX).
- `tokens`: paged_attention over float32 caches: 64 decode rows and 64 x 5 tokens (a
  speculative step) over 364-864 keys, 30 layers' caches; 64 short prompts' tokens.
- `prefill`: prefill_attention over 5 whole prompts of 310-790 tokens (the long workload's
  lengths), float32 and bfloat16, views of one [L, q + 2 kv] output as in a prompt pass.
- `f32gemm`: float32 GEMMs without AMX, keel's `gemm` / `gemm_silu` and (with AVX512-VNNI)
  `i16_gemm`: the four layer kinds at 2,052 rows, and a decode step's 120 at 64 rows (each
  build packs `i16_gemm`'s weights itself: two builds' blocks may differ).

Builds older than the module-local bindings do not load beside another (pybind11 refuses a
second "PlanLinear"); such a build can be made loadable by adding `pybind11::module_local()`
to its three classes in bindings.cpp (its kernels' sources untouched).
"""

from __future__ import annotations

import argparse
from time import perf_counter

import torch

from keel.cpu_ops import _build_root, _import_built

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # qkv, o, gate_up, down


def load(name: str):
    module = _import_built(name, _build_root() / name)
    if module is None:
        raise SystemExit(f"No finished build named {name} in {_build_root()} (or it did not "
                         "load beside the other: see this script's docstring).")
    return module


def gemm_case(ops_any, g):
    bf = torch.bfloat16
    tiles = [ops_any.amx_gemm_pack((torch.randn(n, k, generator=g) * 0.05).to(bf))
             for n, k in SHAPES]
    xs = {k: torch.randn(64, k, generator=g).to(bf) for k in (576, 1536)}

    def run(ops):
        for i, (n, k) in enumerate(SHAPES):
            ops.amx_gemm(xs[k], tiles[i], n, None, i % 4 == 2)
    return {"120 decode GEMMs (amx_gemm)": (run, None)}


def head_case(ops_any, g):
    bf = torch.bfloat16
    tiles = ops_any.amx_gemm_pack((torch.randn(49152, 576, generator=g) * 0.05).to(bf))
    x = torch.randn(64, 576, generator=g).to(bf)
    sweep = torch.empty(256 << 20, dtype=torch.uint8)  # the head from memory, as in a step

    def logits_then_argmax(ops):
        ops.argmax_rows(ops.amx_gemm(x, tiles, 49152))

    def fused(ops):
        if hasattr(ops, "amx_gemm_argmax"):
            ops.amx_gemm_argmax(x, tiles, 49152, 49152)
        else:  # a build before it: what the step did then
            ops.argmax_rows(ops.amx_gemm(x, tiles, 49152))

    def from_memory():
        sweep.add_(1)
    return {"LM head, then argmax_rows": (logits_then_argmax, from_memory),
            "LM head's argmax in its epilogue": (fused, from_memory)}


def paged_caches(g, dtype, reqs: int = 64, max_keys: int = 869):
    """64 requests' contexts of 364-864 keys, their block table, and 30 layers' K/V caches
    of the default model's shape (3 KV heads of 64, blocks of 16) in `dtype`."""
    kv_heads, dim, block = 3, 64, 16
    lens = torch.randint(364, 864, (reqs,), generator=g)
    per = -(-max_keys // block)
    table = torch.arange(reqs * per, dtype=torch.int32).view(reqs, per)
    caches = [tuple(on_cache_pages(torch.randn(reqs * per, kv_heads, block, dim, generator=g)
                                   .to(dtype)) for _ in range(2)) for _ in range(30)]
    return lens, table, caches


def on_cache_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in memory as the engine's K/V cache has it (keel.attention.layer._zeros:
    an anonymous mapping, on huge pages where keel puts the cache there), so that reading it
    meets the TLB as a real step does."""
    from keel.attention.layer import _zeros

    out = _zeros(tuple(t.shape), t.dtype, t.device)
    out.copy_(t)
    return out


def attention_case(ops_any, g):
    heads, dim, rows = 9, 64, 64
    lens, table, caches = paged_caches(g, torch.bfloat16, rows, 864)
    q = torch.randn(rows, heads, dim, generator=g).bfloat16()
    qf = q.float()  # dtype="auto" without AMX: float32 queries over the bfloat16 cache

    def run(ops, q=q):
        for k, v in caches:
            ops.paged_attention(q, k, v, table, lens, None, dim ** -0.5, 0)
    return {"decode attention, 30 layers (paged_attention)": (run, None),
            "the same with float32 queries (auto without AMX)": (lambda ops: run(ops, qf), None)}


def tokens_case(ops_any, g):
    """float32 caches, 30 layers from memory: a decode step's rows, a speculative step's (the
    token before 4 drafts, for each of 64 requests), and short prompts' tokens (16-47 each,
    no context; one layer's cache, as a prompt pass writes and reads it)."""
    heads, dim, reqs = 9, 64, 64
    lens, table, caches = paged_caches(g, torch.float32, reqs)
    q1 = torch.randn(reqs, heads, dim, generator=g)
    rows5 = torch.arange(reqs, dtype=torch.int32).repeat_interleave(5)
    lens5 = (lens[:, None] + torch.arange(5)).flatten()
    q5 = torch.randn(5 * reqs, heads, dim, generator=g)
    plens = torch.randint(16, 48, (reqs,), generator=g)
    rows_p = torch.arange(reqs, dtype=torch.int32).repeat_interleave(plens)
    lens_p = torch.cat([torch.arange(1, n + 1) for n in plens.tolist()])
    qp = torch.randn(len(rows_p), heads, dim, generator=g)

    def decode(ops):
        for k, v in caches:
            ops.paged_attention(q1, k, v, table, lens, None, dim ** -0.5, 0)

    def verify(ops):
        for k, v in caches:
            ops.paged_attention(q5, k, v, table, lens5, rows5, dim ** -0.5, 0)

    def prompts(ops):
        k, v = caches[0]
        for _ in range(30):
            ops.paged_attention(qp, k, v, table, lens_p, rows_p, dim ** -0.5, 0)
    return {"float32 decode rows, 64 x 364-864 keys, 30 layers": (decode, None),
            "float32 speculative step, 64 x 5 tokens, 30 layers": (verify, None),
            f"float32 short prompts, {len(rows_p)} tokens, 30 passes": (prompts, None)}


def prefill_case(ops_any, g):
    heads, kv_heads, dim = 9, 3, 64
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        cases = []
        for n in (310, 450, 547, 640, 790):
            qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
            q = qkv[:, :heads * dim].view(n, heads, dim)
            k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(n, kv_heads, dim)
            v = qkv[:, (heads + kv_heads) * dim:].view(n, kv_heads, dim)
            cases.append((q, k, v, torch.empty(n, heads * dim, dtype=dtype)))

        def run(ops, cases=cases):
            for q, k, v, o in cases:
                ops.prefill_attention(q, k, v, o, dim ** -0.5, 0)
        out[f"prefill attention, 5 prompts of 310-790 tokens ({str(dtype)[6:]})"] = (run, None)
    return out


def float32_gemm_case(ops_any, g):
    """The default model's four layer kinds at a prompt step's 2,052 rows (one weight each,
    hot), and a decode step's 120 at 64 rows (each layer's own weight, from memory), on keel's
    float32 `gemm` / `gemm_silu` and on `i16_gemm` (where the CPU has AVX512-VNNI)."""
    kinds = SHAPES[:4]
    xs = {(m, k): torch.randn(m, k, generator=g) for m in (64, 2052) for k in (576, 1536)}
    f32 = [ops_any.gemm_pack(torch.randn(n, k, generator=g) * 0.05) for n, k in SHAPES]
    out = {}

    def prompt(ops, pack, call):
        for i, (n, k) in enumerate(kinds):
            call(ops, xs[2052, k], pack[i], n, i == 2)

    def decode(ops, pack, call):
        for i, (n, k) in enumerate(SHAPES):
            call(ops, xs[64, k], pack[i], n, i % 4 == 2)

    def keel_f32(ops, x, p, n, silu):
        (ops.gemm_silu if silu else ops.gemm)(x, p, n, None)
    out["4 prompt GEMMs at 2,052 rows (gemm, gemm_silu)"] = (
        lambda ops: prompt(ops, f32, keel_f32), None)
    out["120 decode GEMMs at 64 rows (gemm, gemm_silu)"] = (
        lambda ops: decode(ops, f32, keel_f32), None)
    if ops_any.i16_gemm_available():
        # The same weights, packed by each build itself (two builds' blocks may differ).
        weights = [torch.randn(n, k, generator=g) * 0.05 for n, k in SHAPES]
        i16: dict[int, list] = {}

        def packs(ops):
            if id(ops) not in i16:
                i16[id(ops)] = [ops.i16_gemm_pack(w) for w in weights]
            return i16[id(ops)]

        def keel_i16(ops, x, p, n, silu):
            ops.i16_gemm(x, p[0], p[1], n, None, silu)
        out["4 prompt GEMMs at 2,052 rows (i16_gemm)"] = (
            lambda ops: prompt(ops, packs(ops), keel_i16), None)
        out["120 decode GEMMs at 64 rows (i16_gemm)"] = (
            lambda ops: decode(ops, packs(ops), keel_i16), None)
    return out


CASES = {"gemm": gemm_case, "head": head_case, "attention": attention_case,
         "tokens": tokens_case, "prefill": prefill_case, "f32gemm": float32_gemm_case}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="build A's folder name (keel_cpu_ops_<digest>)")
    ap.add_argument("b", help="build B's folder name")
    ap.add_argument("--cases", nargs="+", default=["gemm", "head"], choices=sorted(CASES))
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    builds = {"A": load(args.a), "B": load(args.b)}
    print(f"# A = {args.a}, B = {args.b}; {args.rounds} rounds, alternating; ms")
    g = torch.Generator().manual_seed(0)
    for case in args.cases:
        for label, (fn, before) in CASES[case](builds["A"], g).items():
            for ops in builds.values():
                fn(ops)  # warm-up
            times = {k: [] for k in builds}
            for r in range(args.rounds):
                for k in (("A", "B") if r % 2 == 0 else ("B", "A")):
                    if before is not None:  # untimed: e.g. caches swept
                        before()
                    t0 = perf_counter()
                    fn(builds[k])
                    times[k].append((perf_counter() - t0) * 1e3)
            stats = {}
            for k, ts in times.items():
                ts.sort()
                stats[k] = (ts[len(ts) // 2], ts[len(ts) // 4], ts[0])
            print(f"{label}:")
            for k, (med, q1, best) in stats.items():
                print(f"  {k}: median {med:.2f}  q1 {q1:.2f}  best {best:.2f}")
            print(f"  B / A (medians): {stats['B'][0] / stats['A'][0]:.3f}")


if __name__ == "__main__":
    main()
