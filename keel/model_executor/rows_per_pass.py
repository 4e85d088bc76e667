"""Where a quantized layer's kernel stops winning: per layer shape, the quantized kernel is
timed against the dense GEMM at 1, 8 and 64 rows (`choose_rows_per_pass`, called by the
loader after quantize_model.py), and each weight's `max_rows` set; passes with more rows take
the dense weight. The crossovers are kept per CPU in $KEEL_CACHE_DIR/quantized_rows.json."""

from __future__ import annotations

import json
import logging

import torch
from torch import nn

from keel.cpu_ops import cpu_ops_for
from keel.model_executor.layers.packed_weights import cpu_gemm, release_packed
from keel.model_executor.layers.quantization import ALL_ROWS, Int4Weight, quantized_linear
from keel.utils import best_seconds, replace_atomically

logger = logging.getLogger(__name__)


def choose_rows_per_pass(model: nn.Module, rows: tuple[int, ...] = (1, 8, 64)) -> None:
    """Per layer shape, time the quantized kernel against the dense (oneDNN-packed) GEMM at
    1, 8 and 64 rows, sweeping over that shape's layers so that the weights come from memory
    as in a real step, and set each weight's `max_rows`: the largest measured row count where
    the kernel was not slower. A memory-bound pass (one user) reads 4-8x fewer bytes and the
    kernel wins; a compute-bound one (many users) goes to the dense GEMM, whose weight is kept
    only where some pass size needs it (and released where the kernel wins throughout)."""
    groups: dict[tuple, list[nn.Module]] = {}
    for m in model.modules():
        q = getattr(m, "quant", None)
        if q is not None and getattr(m, "packed_weight", None) is not None:
            kernel = "keel" if getattr(q, "keel", None) is not None or \
                getattr(q, "scales_f32", None) is not None else "torch"
            groups.setdefault((f"{type(q).__name__}/{kernel}", q.out_features,
                               _in_features(q)), []).append(m)
    report = []
    cache = _RowsCache()
    for (kind, n, k), layers in groups.items():
        dtype = layers[0].weight.dtype
        # The dense side is whichever packed GEMM the layers got (layers/gemm_choice.py).
        key = f"{kind} {n}x{k} {dtype} vs {layers[0].packed_by}"
        max_rows = cache.get(key)
        if max_rows is None:
            layers = layers[:32]
            inputs = {r: torch.randn(r, k, dtype=dtype) for r in rows}
            times = {r: (_sweep(layers, inputs[r], True), _sweep(layers, inputs[r], False))
                     for r in rows}
            wins = [r for r in rows if times[r][0] <= times[r][1]]
            max_rows = wins[-1] if wins else 0
            cache.put(key, max_rows)
            report.append(f"{kind} {n}x{k}: " + ", ".join(
                f"{r} rows {tq * 1e3 / len(layers):.2f}/{td * 1e3 / len(layers):.2f} ms"
                for r, (tq, td) in times.items()) + f" -> kernel up to {max_rows} rows")
        else:
            report.append(f"{kind} {n}x{k}: kernel up to {max_rows} rows (measured before)")
        for m in groups[(kind, n, k)]:
            if max_rows == rows[-1]:  # the kernel wins at every size: no dense copy
                release_packed(m)
                m.quant.max_rows = ALL_ROWS
            else:
                m.quant.max_rows = max_rows
    cache.save()
    if report:
        logger.info("Quantized vs dense per layer (kernel/dense): %s", "; ".join(report))


class _RowsCache:
    """The measured crossovers, per CPU, torch build and thread count, in
    $KEEL_CACHE_DIR/quantized_rows.json: measured once per machine (~1.5 s), as the CPU
    kernels are built once."""

    def __init__(self) -> None:
        from keel.model_executor.gguf_loader import _cache_root
        from keel.utils import cpu_model

        self.path = _cache_root() / "quantized_rows.json"
        self.prefix = f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} " \
                      "threads | "
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}
        self.dirty = False

    def get(self, key: str) -> int | None:
        value = self.data.get(self.prefix + key)
        return value if isinstance(value, int) else None

    def put(self, key: str, value: int) -> None:
        self.data[self.prefix + key], self.dirty = value, True

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_atomically(self.path,
                                lambda tmp: tmp.write_text(json.dumps(self.data, indent=1)))
        except OSError as e:  # a read-only home: measure again next time
            logger.warning("Cannot save %s: %s", self.path, e)


def _sweep(layers: list[nn.Module], x: torch.Tensor, quantized: bool) -> float:
    """Seconds for x through every layer, best of two (the first one warms up). A [gate; up]
    layer whose output only goes through silu_and_mul (silu_pairs) is timed as the MLP runs
    it on each side: the kernel's product then silu_and_mul, or the dense weight's gemm_silu
    (SiLU in the GEMM's epilogue; on an interleaved copy, a plain pass would also put the
    columns back in order, which no pass of the engine does)."""

    def silu_and_mul(y: torch.Tensor) -> torch.Tensor:
        ops = cpu_ops_for(y)
        if ops is not None:
            return ops.silu_and_mul(y)
        gate, up = y.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def sweep() -> None:
        for m in layers:
            silu = getattr(m, "silu_pairs", False)
            if quantized:
                y = quantized_linear(x, m.quant)
                if silu:
                    silu_and_mul(y)
            elif not silu or m.gemm_silu(x, dense_only=True) is None:
                y = cpu_gemm(m, x, None)
                if silu:
                    silu_and_mul(y)

    return best_seconds(sweep, 2, warmup=False)


def _in_features(q) -> int:
    return q.in_features if isinstance(q, Int4Weight) else q.q.shape[1]
