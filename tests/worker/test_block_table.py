"""BlockTable.compute_slot_mapping: each scheduled token's physical KV slot, block_table[req,
pos // block_size] * block_size + pos % block_size. On the CPU the runner passes each token's
request row and the mapping is computed in NumPy; it must equal the torch computation."""

from __future__ import annotations

import numpy as np
import torch

from keel.worker.block_table import BlockTable


def test_numpy_slot_mapping_equals_the_torch_one():
    rng = np.random.default_rng(0)
    table = BlockTable(max_num_reqs=8, max_num_blocks_per_req=20, max_num_batched_tokens=256,
                       block_size=16, device=torch.device("cpu"))
    num_reqs = 6
    for r in range(num_reqs):
        table.add_row(rng.choice(1000, size=20, replace=False).tolist(), r)
    # prompt chunks, decode rows and a speculative step's tokens, at positions up to 319
    counts = np.array([1, 37, 1, 5, 64, 1])
    starts = np.array([300, 0, 15, 47, 128, 319])
    req = np.repeat(np.arange(num_reqs), counts)
    pos = np.concatenate([s + np.arange(c) for s, c in zip(starts, counts)]).astype(np.int64)
    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)])).int()
    positions = torch.from_numpy(pos)
    want = table.compute_slot_mapping(num_reqs, qsl, positions).clone()
    table.slot_mapping.np[:] = -1
    got = table.compute_slot_mapping(num_reqs, qsl, positions, req)
    assert torch.equal(got, want)
    rows = table.block_table.np[req, pos // 16]
    assert np.array_equal(got.numpy(), rows * 16 + pos % 16)
    assert (table.slot_mapping.np[len(pos):] == -1).all()  # nothing past the tokens written
