"""The persistent batch against a reference.

Random sequences of add_request / remove_request / in-place updates / condense run on a real
InputBatch; a pure-Python model of the row semantics (add fills the lowest free row, condense
moves the highest used rows down into the lowest holes) predicts where every request sits. After
each condense a second InputBatch is built directly, by adding the surviving requests in the
predicted row order, and every field of the two batches is compared.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from keel.sampling_params import SamplingParams
from keel.worker.input_batch import CachedRequestState, InputBatch

MAX_REQS, MAX_LEN, MAX_TOKENS, BLOCK = 16, 64, 64, 4
MAX_BLOCKS = MAX_LEN // BLOCK


VOCAB = 30000


def make_batch() -> InputBatch:
    return InputBatch(MAX_REQS, MAX_LEN, MAX_TOKENS, BLOCK, torch.device("cpu"), vocab_size=VOCAB)


def random_params(rng: random.Random) -> SamplingParams:
    """Every per-row feature, each used by some requests and not others."""
    maybe = lambda p, value, default=None: value if rng.random() < p else default
    sp = SamplingParams(
        temperature=0.0 if rng.random() < 0.4 else rng.choice([0.5, 0.8, 1.0, 1.3]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        top_k=rng.choice([0, 0, 5, 20]),
        min_p=rng.choice([0.0, 0.0, 0.05]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, 0.0, -0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
        seed=rng.choice([None, rng.randrange(1000)]),
        min_tokens=rng.choice([0, 0, 3]),
        logprobs=maybe(0.3, rng.randrange(0, 6)),
        prompt_logprobs=maybe(0.2, rng.randrange(0, 3)),
        logit_bias=maybe(0.3, {rng.randrange(VOCAB): 2.0, rng.randrange(VOCAB): -1.0}),
        allowed_token_ids=maybe(0.2, rng.sample(range(VOCAB), 5)),
    )
    # What InputProcessor fills in when the request is added.
    sp._all_stop_token_ids = {rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))}
    sp._bad_words_token_ids = maybe(0.3, [[rng.randrange(VOCAB)], [7, 8, 9]], [])
    return sp


def random_state(rng: random.Random, req_id: str) -> CachedRequestState:
    n_prompt = rng.randint(1, 40)
    n_out = rng.randint(0, 8)
    sp = random_params(rng)
    n_blocks = rng.randint(1, -(-(n_prompt + n_out) // BLOCK))
    gen = None
    if sp.seed is not None and not sp.greedy:
        gen = torch.Generator().manual_seed(sp.seed)
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=[rng.randrange(1, 30000) for _ in range(n_prompt)],
        sampling_params=sp,
        generator=gen,
        block_ids=([rng.randrange(0, 10000) for _ in range(n_blocks)],),
        num_computed_tokens=rng.randint(0, n_prompt + n_out),
        output_token_ids=[rng.randrange(1, 30000) for _ in range(n_out)],
    )


class RowModel:
    """The expected req_id of every row, from the documented semantics only."""

    def __init__(self) -> None:
        self.rows: list[str | None] = []

    def add(self, req_id: str) -> int:
        for i, r in enumerate(self.rows):
            if r is None:
                self.rows[i] = req_id
                return i
        self.rows.append(req_id)
        return len(self.rows) - 1

    def remove(self, req_id: str) -> int:
        i = self.rows.index(req_id)
        self.rows[i] = None
        return i

    def condense(self) -> None:
        n = sum(r is not None for r in self.rows)
        while None in self.rows[:n]:
            hole = self.rows.index(None)
            last = max(i for i, r in enumerate(self.rows) if r is not None)
            self.rows[hole], self.rows[last] = self.rows[last], None
        del self.rows[n:]

    def index(self) -> dict[str, int]:
        return {r: i for i, r in enumerate(self.rows) if r is not None}


def assert_membership(batch: InputBatch, model: RowModel) -> None:
    expected = model.index()
    assert batch.req_id_to_index == expected
    assert batch.num_reqs == len(expected)
    for req_id, row in expected.items():
        assert batch.req_ids[row] == req_id


def assert_rows_match(batch: InputBatch, ref: InputBatch, n: int) -> None:
    """Every per-row field of rows [0, n) of `batch` equals `ref`'s."""
    assert batch.req_ids[:n] == ref.req_ids[:n]
    assert batch.req_id_to_index == ref.req_id_to_index
    assert batch.num_reqs == ref.num_reqs == n
    np.testing.assert_array_equal(batch.num_tokens[:n], ref.num_tokens[:n])
    np.testing.assert_array_equal(batch.num_prompt_tokens[:n], ref.num_prompt_tokens[:n])
    np.testing.assert_array_equal(
        batch.num_computed_tokens_cpu[:n], ref.num_computed_tokens_cpu[:n]
    )
    for row in range(n):
        k = ref.num_tokens[row]
        np.testing.assert_array_equal(batch.token_ids_cpu[row, :k], ref.token_ids_cpu[row, :k])
    bt, rbt = batch.block_table, ref.block_table
    np.testing.assert_array_equal(bt.num_blocks_per_row[:n], rbt.num_blocks_per_row[:n])
    for row in range(n):
        k = rbt.num_blocks_per_row[row]
        np.testing.assert_array_equal(bt.block_table.np[row, :k], rbt.block_table.np[row, :k])
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalties",
                 "frequency_penalties", "repetition_penalties"):
        np.testing.assert_array_equal(getattr(batch, name).np[:n], getattr(ref, name).np[:n],
                                      err_msg=name)
    for name in ("greedy_reqs", "random_reqs", "top_p_reqs", "top_k_reqs", "min_p_reqs",
                 "penalty_reqs", "logit_bias", "allowed_token_ids", "bad_words_token_ids",
                 "min_tokens", "num_logprobs", "num_prompt_logprobs"):
        assert getattr(batch, name) == getattr(ref, name), name
    assert batch.generators.keys() == ref.generators.keys()
    for row, gen in ref.generators.items():
        assert batch.generators[row] is gen
    # The metadata the sampler reads, rebuilt from the moved rows, equals the reference's.
    batch.sampling_metadata = ref.sampling_metadata = None
    batch.refresh_metadata()
    ref.refresh_metadata()
    assert_same_metadata(batch.sampling_metadata, ref.sampling_metadata)


def assert_same_metadata(a, b) -> None:
    import dataclasses

    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "generators":
            assert x.keys() == y.keys()
        elif f.name == "history":
            assert (x is None) == (y is None)
        elif dataclasses.is_dataclass(x):
            for g in dataclasses.fields(x):
                np.testing.assert_array_equal(np.asarray(getattr(x, g.name)),
                                              np.asarray(getattr(y, g.name)), err_msg=g.name)
        elif isinstance(x, tuple):
            assert len(x) == len(y)
            for u, v in zip(x, y):
                np.testing.assert_array_equal(u.numpy(), v.numpy(), err_msg=f.name)
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
        else:
            assert x == y, f.name


def build_reference(states: dict[str, CachedRequestState], rows: list[str]) -> InputBatch:
    ref = make_batch()
    for i, req_id in enumerate(rows):
        assert ref.add_request(states[req_id]) == i
    return ref


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ops_match_reference(seed):
    rng = random.Random(seed)
    batch, model = make_batch(), RowModel()
    states: dict[str, CachedRequestState] = {}
    next_id, num_condense = 0, 0
    for _ in range(400):
        op = rng.random()
        live = list(model.index())
        if op < 0.35 and len(live) < MAX_REQS:
            req_id = f"r{next_id}"
            next_id += 1
            states[req_id] = random_state(rng, req_id)
            row = batch.add_request(states[req_id])
            assert row == model.add(req_id)
        elif op < 0.6 and live:
            req_id = rng.choice(live)
            assert batch.remove_request(req_id) == model.remove(req_id)
            del states[req_id]
        elif op < 0.65:
            assert batch.remove_request("never-added") is None
        elif op < 0.8 and live:
            # What the runner does to a request that stays: one more token, maybe one more
            # block, a new computed count -- written into its current row, in place.
            req_id = rng.choice(live)
            st, row = states[req_id], model.index()[req_id]
            if st.num_tokens < MAX_LEN:
                tok = rng.randrange(1, 30000)
                batch.append_sampled_tokens(np.array([row]), np.array([tok]))
                st.output_token_ids.append(tok)
            if len(st.block_ids[0]) < MAX_BLOCKS and rng.random() < 0.5:
                new = [rng.randrange(0, 10000)]
                batch.block_table.append_row(new, row)
                st.block_ids[0].extend(new)
            st.num_computed_tokens = rng.randint(0, st.num_tokens)
            batch.num_computed_tokens_cpu[row] = st.num_computed_tokens
        else:
            batch.condense()
            model.condense()
            num_condense += 1
            ref = build_reference(states, model.rows)
            assert_rows_match(batch, ref, len(model.rows))
            assert len(batch.req_ids) == len(model.rows)  # exactly the batch after condense
        assert_membership(batch, model)
    assert num_condense > 20


def test_add_fills_lowest_free_row_and_condense_moves_highest_down():
    rng = random.Random(7)
    batch = make_batch()
    states = {f"r{i}": random_state(rng, f"r{i}") for i in range(7)}
    for i in range(6):
        assert batch.add_request(states[f"r{i}"]) == i
    batch.remove_request("r1")
    batch.remove_request("r3")
    batch.remove_request("r4")
    # Holes 1, 3, 4: the next add takes the lowest one.
    assert batch.add_request(states["r6"]) == 1
    batch.condense()
    # Rows were [r0, r6, r2, -, -, r5]: the highest used row (r5) moves into the lowest hole
    # below num_reqs (3); the hole at 4 is past the batch and simply dropped.
    assert batch.req_ids[:4] == ["r0", "r6", "r2", "r5"]
    assert batch.req_id_to_index == {"r0": 0, "r6": 1, "r2": 2, "r5": 3}
    assert len(batch.req_ids) == 4
    # After condense the free rows start right after the batch.
    assert batch.add_request(states["r1"]) == 4


def test_req_index_changes_after_condense_but_req_id_and_row_contents_stay():
    rng = random.Random(3)
    batch = make_batch()
    states = {f"r{i}": random_state(rng, f"r{i}") for i in range(4)}
    for i in range(4):
        batch.add_request(states[f"r{i}"])
    before = batch.req_id_to_index["r3"]
    st = states["r3"]
    batch.remove_request("r0")
    batch.condense()
    after = batch.req_id_to_index["r3"]
    assert (before, after) == (3, 0)
    assert batch.req_ids[after] == "r3"
    n = st.num_tokens
    assert batch.num_tokens[after] == n
    assert batch.num_prompt_tokens[after] == len(st.prompt_token_ids)
    assert batch.token_ids_cpu[after, :n].tolist() == st.prompt_token_ids + st.output_token_ids
    assert batch.num_computed_tokens_cpu[after] == st.num_computed_tokens
    k = batch.block_table.num_blocks_per_row[after]
    assert batch.block_table.block_table.np[after, :k].tolist() == st.block_ids[0]
    # r1 and r2 did not move: condense moves only what fills a hole.
    assert batch.req_id_to_index["r1"] == 1 and batch.req_id_to_index["r2"] == 2


def test_swap_states_swaps_everything():
    a = CachedRequestState(
        req_id="a", prompt_token_ids=[11, 12, 13, 14, 15, 16, 17], sampling_params=SamplingParams(
            temperature=0.7, top_p=0.8, top_k=5, seed=3),
        generator=torch.Generator().manual_seed(3), block_ids=([40, 41],),
        num_computed_tokens=6, output_token_ids=[18, 19],
    )
    b = CachedRequestState(
        req_id="b", prompt_token_ids=[21, 22], sampling_params=SamplingParams(temperature=0.0),
        generator=None, block_ids=([50],), num_computed_tokens=1,
    )
    batch = make_batch()
    batch.add_request(a)
    batch.add_request(b)
    batch.swap_states(0, 1)
    assert batch.req_id_to_index == {"b": 0, "a": 1}
    assert_rows_match(batch, build_reference({"a": a, "b": b}, ["b", "a"]), 2)
    # And back again: the original arrangement, field for field.
    batch.swap_states(0, 1)
    assert_rows_match(batch, build_reference({"a": a, "b": b}, ["a", "b"]), 2)


def test_refresh_metadata_follows_membership():
    batch = make_batch()
    g = CachedRequestState("g", [1, 2], SamplingParams(temperature=0.0), None, ([0],), 0)
    r = CachedRequestState("r", [3], SamplingParams(temperature=0.5, top_p=0.9), None, ([1],), 0)
    batch.add_request(g)
    batch.refresh_metadata()
    meta = batch.sampling_metadata
    assert meta.all_greedy and meta.temperature is None and meta.top_p is None
    batch.refresh_metadata()
    assert batch.sampling_metadata is meta  # unchanged membership: reused, not rebuilt
    batch.add_request(r)
    batch.refresh_metadata()
    meta = batch.sampling_metadata
    assert not meta.all_greedy and not meta.all_random
    assert meta.temperature.tolist() == pytest.approx([0.0, 0.5])
    assert meta.top_p.tolist() == pytest.approx([1.0, 0.9])
    assert meta.top_k is None
