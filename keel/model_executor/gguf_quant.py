"""GGUF's 4-bit blocks as the int4 form keel's kernels take, without requantizing.

`int4_groups(tensor)` reads a Q4_0, Q4_1 or Q4_K tensor's blocks and returns q in 0..15 with
one (scale, zero) per group of 32 along K such that W = (q - 8) * scale + zero, exactly the
values `gguf.quants.dequantize` gives (see layers/quantization.py for the kernel's form).
Other types return None (keel requantizes Q8_0 / Q6_K to int8 at load, and keeps float ones).
"""

from __future__ import annotations

import numpy as np

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K")  # requantized per output row
GROUP = 32


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """[n, m * half] bytes -> [n, m * 2 * half] values: each run of `half` bytes holds
    elements [0, half) in its low nibbles and [half, 2 half) in its high nibbles."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, half) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & np.uint8(0x0F)).reshape(n, -1)


def int4_groups(data: np.ndarray, type_name: str, shape: tuple[int, int]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(q uint8 [N, K], scale float32 [N, K / 32], zero float32 [N, K / 32]) or None.
    `data`: the tensor's raw bytes (GGUFReader's `tensor.data`); `shape`: (N, K), HF order."""
    import gguf

    if type_name not in INT4_TYPES:
        return None
    n, k = shape
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, type_size)
    f16 = lambda b: b.copy().view(np.float16).astype(np.float32)
    if type_name == "Q4_0":  # d, 16 bytes of nibbles: W = d (q - 8)
        d = f16(blocks[:, 0:2])
        q = _nibbles(blocks[:, 2:], 16)
        scale, zero = d, np.zeros_like(d)
    elif type_name == "Q4_1":  # d, m, nibbles: W = d q + m = (q - 8) d + (m + 8 d)
        d, m = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
        q = _nibbles(blocks[:, 4:], 16)
        scale, zero = d, m + 8 * d
    else:  # Q4_K: d, dmin, 12 bytes of 6-bit (scale, min) x 8, then 4 x 32 bytes of nibbles
        d, dmin = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        q = _nibbles(blocks[:, 16:], 32)
        scale = d * sc.astype(np.float32)  # [blocks, 8]: one per sub-block of 32
        zero = 8 * scale - dmin * mn.astype(np.float32)
    assert block_size % GROUP == 0
    q = q.reshape(n, k)
    return q, scale.reshape(n, k // GROUP), zero.reshape(n, k // GROUP)
