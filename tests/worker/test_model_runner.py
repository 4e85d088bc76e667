"""ModelRunner driven by hand-built SchedulerOutputs: the diff, the layout, the two calls.

One tiny llama (max_position_embeddings raised to 1024 so the seed's 600-token request fits) is
loaded once per module; each test gets a fresh runner around it (cheap: buffers only).
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from keel.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from keel.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from keel.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from keel.sampling_params import SamplingParams
from keel.worker.model_runner import ExecuteModelState, ModelRunner
from tests.hf_models import VOCAB, make_hf_model

BLOCK = 4
MAX_LEN = 1024
MAX_REQS = 8
MAX_TOKENS = 64
NUM_BLOCKS = 320
GREEDY = SamplingParams(temperature=0.0)
STATE_ERROR = "State error: sample_tokens() must be called after execute_model() returns None."


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    folder = make_hf_model("llama", tmp_path_factory.mktemp("llama1024"))
    # make_hf_model fixes max_position_embeddings=512 (an override collides with it), and the
    # weights do not depend on it: raise it in config.json so a 600-token request fits.
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = MAX_LEN
    cfg_path.write_text(json.dumps(cfg))
    return EngineConfig(
        ModelConfig(str(folder), dtype="float32", max_model_len=MAX_LEN, device="cpu"),
        CacheConfig(block_size=BLOCK),
        SchedulerConfig(max_num_seqs=MAX_REQS, max_num_batched_tokens=MAX_TOKENS),
    )


@pytest.fixture(scope="module")
def model(config):
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    return runner.model


@pytest.fixture
def make_runner(config, model):
    def make() -> ModelRunner:
        runner = ModelRunner(config, torch.device("cpu"))
        runner.model = model  # shared weights; each runner binds its own KV cache
        runner.initialize_kv_cache(NUM_BLOCKS)
        return runner

    return make


# ---- hand-built scheduler outputs ----------------------------------------------------------


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(n)]


def new_req(req_id, prompt_ids, block_ids, computed=0, sp=GREEDY) -> NewRequestData:
    return NewRequestData(req_id, list(prompt_ids), sp, (list(block_ids),), computed)


def cached(*entries, resumed=()) -> CachedRequestData:
    """entries: (req_id, num_computed_tokens, new_block_ids list or None)."""
    data = CachedRequestData(resumed_req_ids=set(resumed))
    for req_id, computed, blocks in entries:
        data.req_ids.append(req_id)
        data.num_computed_tokens.append(computed)
        data.new_block_ids.append(None if blocks is None else (list(blocks),))
        data.new_token_ids.append([])
    return data


def sched(new=(), cached_reqs=None, nst=None, finished=()) -> SchedulerOutput:
    nst = dict(nst or {})
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached_reqs or CachedRequestData(),
        num_scheduled_tokens=nst,
        total_num_scheduled_tokens=sum(nst.values()),
        finished_req_ids=set(finished),
    )


def step(runner: ModelRunner, so: SchedulerOutput) -> ModelRunnerOutput:
    assert runner.execute_model(so) is None
    out = runner.sample_tokens(None)
    assert isinstance(out, ModelRunnerOutput)
    return out


def sampled(out: ModelRunnerOutput, req_id: str) -> list[int]:
    return out.sampled_token_ids[out.req_id_to_index[req_id]]


def reference_greedy(make_runner, prompt_ids: list[int], n: int) -> list[int]:
    """The request alone, never interrupted: prefill, then n - 1 decodes."""
    runner = make_runner()
    blocks = list(range(-(-(len(prompt_ids) + n) // BLOCK)))
    out = step(runner, sched([new_req("ref", prompt_ids, blocks)], nst={"ref": len(prompt_ids)}))
    tokens = sampled(out, "ref")
    for i in range(n - 1):
        computed = len(prompt_ids) + i
        out = step(runner, sched(cached_reqs=cached(("ref", computed, None)), nst={"ref": 1}))
        tokens += sampled(out, "ref")
    return tokens


def block_row(runner: ModelRunner, req_id: str) -> list[int]:
    row = runner.input_batch.req_id_to_index[req_id]
    bt = runner.input_batch.block_table
    return bt.block_table.np[row, : bt.num_blocks_per_row[row]].tolist()


def token_row(runner: ModelRunner, req_id: str) -> list[int]:
    row = runner.input_batch.req_id_to_index[req_id]
    return runner.input_batch.token_ids_cpu[row, : runner.input_batch.num_tokens[row]].tolist()


# ---- the seed's worked example ---------------------------------------------------------------

P1, P2, P3 = prompt(102, 1), prompt(600, 2), prompt(60, 3)
B1 = [200 + i for i in range(26)]  # positions 0..103
B2 = [17, 5]  # positions 0..7
B3 = [100 + 3 * i for i in range(11)]  # positions 0..43


def seed_example() -> SchedulerOutput:
    # num_scheduled_tokens [2, 5, 3], num_computed_tokens [100, 0, 40], totals 102, 600, 60.
    return sched(
        [new_req("R1", P1, B1, 100), new_req("R2", P2, B2, 0), new_req("R3", P3, B3, 40)],
        nst={"R1": 2, "R2": 5, "R3": 3},
    )


def test_seed_worked_example_layout(make_runner):
    runner = make_runner()
    so = seed_example()
    runner._update_states(so)
    assert runner.input_batch.req_ids[:3] == ["R1", "R2", "R3"]
    logits_indices, spec = runner._prepare_inputs(so, np.array([2, 5, 3], dtype=np.int32))

    qsl = runner.query_start_loc.np
    assert qsl[:4].tolist() == [0, 2, 7, 10]
    assert qsl[4:].tolist() == [10] * (MAX_REQS + 1 - 4)  # padded to the end of the buffer
    assert len(qsl) == MAX_REQS + 1
    assert logits_indices.tolist() == [1, 6, 9]
    assert spec is None
    assert runner.discard_request_mask.np[:3].tolist() == [False, True, True]
    assert runner.seq_lens.np[:3].tolist() == [102, 5, 43]

    positions = [100, 101, 0, 1, 2, 3, 4, 40, 41, 42]
    assert runner.positions.np[:10].tolist() == positions
    expected_ids = [P1[100], P1[101], *P2[:5], *P3[40:43]]
    assert runner.input_ids.np[:10].tolist() == expected_ids
    tables = [B1] * 2 + [B2] * 5 + [B3] * 3
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK for t, p in zip(tables, positions)]
    assert runner.input_batch.block_table.slot_mapping.np[:10].tolist() == slots


def test_only_logits_rows_are_projected_and_partial_rows_are_discarded(
    make_runner, model, monkeypatch
):
    runner = make_runner()
    rows_seen = []
    original = model.compute_logits

    def recording(hidden, float32=True):
        rows_seen.append(hidden.shape[0])
        return original(hidden, float32)

    monkeypatch.setattr(model, "compute_logits", recording)
    assert runner.execute_model(seed_example()) is None
    state = runner.execute_model_state
    # 10 tokens in the pass; the model returned only the 3 rows at logits_indices.
    assert state.hidden_states.shape[0] == 3
    assert rows_seen == [3] == [runner.input_batch.num_reqs]
    assert state.logits.shape == (3, VOCAB)

    out = runner.sample_tokens(None)
    # R1 finished its prompt: one real token. R2 and R3 are mid-prefill: sampled, discarded.
    assert out.req_ids == ["R1", "R2", "R3"]
    assert len(out.sampled_token_ids[0]) == 1
    assert out.sampled_token_ids[1:] == [[], []]
    (tok,) = out.sampled_token_ids[0]
    assert runner.requests["R1"].output_token_ids == [tok]
    assert runner.requests["R2"].output_token_ids == []
    assert runner.requests["R3"].output_token_ids == []
    assert runner.input_batch.num_tokens[:3].tolist() == [103, 600, 60]
    assert token_row(runner, "R1") == P1 + [tok]


@pytest.mark.parametrize("fused", [False, True])
def test_last_layer_computes_only_the_sampled_rows_and_changes_no_logit(
    make_runner, model, monkeypatch, fused
):
    """The last layer's output projection and MLP run on the logits rows only (every token's
    K and V are still written); the logits are the same as a pass over every row. In the
    Python layers (their MLP hooked to count its rows) and in the fused pass's plan."""
    if not fused:
        monkeypatch.setattr(model.model.fused_decode, "plan", False)
    mlp_rows = []
    hook = model.model.layers[-1].mlp.register_forward_hook(
        lambda _m, args, _out: mlp_rows.append(args[0].shape[0]))
    try:
        runner = make_runner()
        assert runner.execute_model(seed_example()) is None
        pruned = runner.execute_model_state.logits.clone()
        assert runner.execute_model_state.hidden_states.shape[0] == 3
        pruned_tokens = runner.sample_tokens(None).sampled_token_ids
        caches = [c.clone() for c in runner.kv_caches]
        if fused:  # the plan ran the pass: the Python MLP never did
            assert model.model.fused_decode.plan and mlp_rows == []
        else:
            assert mlp_rows == [3]

        monkeypatch.setattr(model, "supports_output_rows", False)
        full_runner = make_runner()
        assert full_runner.execute_model(seed_example()) is None
        full = full_runner.execute_model_state.logits
        assert full_runner.execute_model_state.hidden_states.shape[0] == 10
        assert full_runner.sample_tokens(None).sampled_token_ids == pruned_tokens
        assert mlp_rows == ([] if fused else [3, 10])
    finally:
        hook.remove()
    torch.testing.assert_close(pruned, full, rtol=1e-5, atol=1e-5)
    for a, b in zip(caches, full_runner.kv_caches):  # the last layer's K/V for all 10 tokens
        assert torch.equal(a, b)


def test_prompt_logprobs_keep_every_row(make_runner, model):
    """A request that wants its prompt's logprobs reads every row's hidden state."""
    runner = make_runner()
    p = prompt(12, 7)
    sp = SamplingParams(temperature=0.0, prompt_logprobs=1)
    out = step(runner, sched([new_req("a", p, [0, 1, 2, 3], sp=sp)], nst={"a": 12}))
    assert runner.execute_model_state is None
    lp = out.prompt_logprobs_dict["a"]
    assert lp is not None and len(lp.logprob_token_ids) == 11


def test_discarded_rows_then_the_prefill_completes(make_runner):
    p = prompt(10, 4)
    ref = reference_greedy(make_runner, p, 2)
    runner = make_runner()
    out = step(runner, sched([new_req("a", p, [0, 1, 2])], nst={"a": 4}))  # chunk 1 of 10
    assert out.sampled_token_ids == [[]]
    assert runner.requests["a"].output_token_ids == []
    assert runner.input_batch.num_tokens[0] == 10
    assert token_row(runner, "a") == p
    out = step(runner, sched(cached_reqs=cached(("a", 4, None)), nst={"a": 6}))
    assert sampled(out, "a") == ref[:1]
    out = step(runner, sched(cached_reqs=cached(("a", 10, None)), nst={"a": 1}))
    assert sampled(out, "a") == ref[1:2]
    assert runner.requests["a"].output_token_ids == ref


# ---- the two calls ---------------------------------------------------------------------------


def test_state_error_and_parked_state(make_runner):
    runner = make_runner()
    so = sched([new_req("a", prompt(5, 5), [0, 1])], nst={"a": 5})
    assert runner.execute_model(so) is None
    state = runner.execute_model_state
    assert isinstance(state, ExecuteModelState)
    assert state[0] is so and state.scheduler_output is so
    assert state.logits.shape == (1, VOCAB)

    so2 = sched(cached_reqs=cached(("a", 5, None)), nst={"a": 1})
    with pytest.raises(RuntimeError) as exc:
        runner.execute_model(so2)
    assert str(exc.value) == STATE_ERROR
    assert runner.execute_model_state is state  # not overwritten

    out = runner.sample_tokens(None)
    assert runner.execute_model_state is None
    assert len(sampled(out, "a")) == 1
    assert runner.sample_tokens(None) is None  # nothing parked
    # Ready for the next pass again.
    assert runner.execute_model(so2) is None
    assert runner.sample_tokens(None) is not None


def test_zero_token_pass_returns_empty_after_the_diff(make_runner):
    runner = make_runner()
    step(runner, sched([new_req("a", prompt(5, 6), [0, 1]), new_req("b", prompt(3, 7), [2])],
                       nst={"a": 5, "b": 3}))
    out = runner.execute_model(sched(finished={"a"}))
    assert out is EMPTY_MODEL_RUNNER_OUTPUT
    assert runner.execute_model_state is None
    # Finished: gone from both collections. Unscheduled: out of the batch, still known.
    assert "a" not in runner.requests
    assert "a" not in runner.input_batch.req_id_to_index
    assert "b" not in runner.input_batch.req_id_to_index
    assert "b" in runner.requests
    assert runner.input_batch.num_reqs == 0


# ---- unscheduled and resumed requests --------------------------------------------------------


def test_unscheduled_request_leaves_batch_and_comes_back_intact(make_runner):
    pa, pb = prompt(6, 8), prompt(5, 9)
    ref_a, ref_b = reference_greedy(make_runner, pa, 3), reference_greedy(make_runner, pb, 2)
    runner = make_runner()
    out = step(runner, sched([new_req("b", pb, [2, 3]), new_req("a", pa, [0, 1])],
                             nst={"b": 5, "a": 6}))
    assert runner.input_batch.req_id_to_index == {"b": 0, "a": 1}
    assert sampled(out, "a") == ref_a[:1] and sampled(out, "b") == ref_b[:1]

    # Pass 2: only a runs. b leaves the batch (not finished); a moves down to row 0.
    out = step(runner, sched(cached_reqs=cached(("a", 6, None)), nst={"a": 1}))
    assert runner.input_batch.req_id_to_index == {"a": 0}
    assert "b" in runner.requests
    assert runner.requests["b"].output_token_ids == ref_b[:1]
    assert out.req_ids == ["a"] and sampled(out, "a") == ref_a[1:2]

    # Pass 3: b is scheduled again as a cached request the batch does not hold: re-added
    # from runner.requests, its token row rebuilt as prompt + outputs.
    # Both get a new block this pass: a (in the batch) by append_row, b (re-added) by the
    # extended list in its cached state -- one copy each, not two.
    so = sched(cached_reqs=cached(("a", 7, [4]), ("b", 5, [6])), nst={"a": 1, "b": 1})
    assert runner.execute_model(so) is None
    assert runner.input_batch.req_id_to_index == {"a": 0, "b": 1}
    assert token_row(runner, "b") == pb + ref_b[:1]
    assert runner.input_batch.num_computed_tokens_cpu[1] == 5
    assert runner.requests["b"].block_ids == ([2, 3, 6],)
    assert block_row(runner, "b") == [2, 3, 6]
    assert block_row(runner, "a") == [0, 1, 4]
    assert runner.requests["a"].block_ids == ([0, 1, 4],)
    out = runner.sample_tokens(None)
    assert sampled(out, "a") == ref_a[2:3]
    assert sampled(out, "b") == ref_b[1:2]
    assert runner.requests["b"].output_token_ids == ref_b
    assert token_row(runner, "b") == pb + ref_b


def test_resumed_request_gets_its_block_ids_replaced(make_runner):
    p = prompt(6, 10)
    ref = reference_greedy(make_runner, p, 2)
    runner = make_runner()
    out = step(runner, sched([new_req("a", p, [0, 1])], nst={"a": 6}))
    assert sampled(out, "a") == ref[:1]
    # Preempted: not scheduled (a zero-token pass), so it leaves the batch.
    assert runner.execute_model(sched()) is EMPTY_MODEL_RUNNER_OUTPUT
    assert runner.input_batch.num_reqs == 0 and "a" in runner.requests
    # Resumed with a whole new allocation; recompute prompt + its one output token.
    so = sched(cached_reqs=cached(("a", 0, [9, 12]), resumed={"a"}), nst={"a": 7})
    assert runner.execute_model(so) is None
    assert runner.requests["a"].block_ids == ([9, 12],)
    assert block_row(runner, "a") == [9, 12]
    assert runner.input_batch.num_computed_tokens_cpu[0] == 0
    out = runner.sample_tokens(None)
    assert sampled(out, "a") == ref[1:2]


def test_resumed_request_still_in_the_batch_is_replaced_not_extended(make_runner):
    # The forced-preemption case: the request is still in the batch and resumed in the same
    # pass; `- resumed_req_ids` removes it first, so its block row is replaced.
    p = prompt(6, 11)
    ref = reference_greedy(make_runner, p, 2)
    runner = make_runner()
    step(runner, sched([new_req("a", p, [0, 1])], nst={"a": 6}))
    assert block_row(runner, "a") == [0, 1]
    so = sched(cached_reqs=cached(("a", 0, [7, 8]), resumed={"a"}), nst={"a": 7})
    assert runner.execute_model(so) is None
    assert runner.requests["a"].block_ids == ([7, 8],)
    assert block_row(runner, "a") == [7, 8]
    assert sampled(runner.sample_tokens(None), "a") == ref[1:2]


def test_buffers_are_made_once_and_overwritten(make_runner):
    """The big per-pass buffers are the same memory every pass: each pass overwrites a prefix
    (the seed: sized once at start-up for the largest batch)."""
    runner = make_runner()
    buffers = {
        "input_ids": runner.input_ids.cpu, "positions": runner.positions.cpu,
        "query_start_loc": runner.query_start_loc.cpu, "seq_lens": runner.seq_lens.cpu,
        "discard_request_mask": runner.discard_request_mask.cpu,
        "token_ids_cpu": runner.input_batch.token_ids_cpu_tensor,
        "block_table": runner.input_batch.block_table.block_table.cpu,
        "slot_mapping": runner.input_batch.block_table.slot_mapping.cpu,
    }
    ptrs = {name: t.data_ptr() for name, t in buffers.items()}
    p = prompt(9, 11)
    step(runner, sched([new_req("a", p, [3, 4])], nst={"a": 9}))
    for i in range(3):
        step(runner, sched(cached_reqs=cached(("a", 9 + i, None)), nst={"a": 1}))
    assert {name: t.data_ptr() for name, t in buffers.items()} == ptrs
    assert runner.input_ids.cpu[0].item() == token_row(runner, "a")[11]  # last pass's input


def test_attention_outside_a_forward_context_is_an_error(make_runner):
    runner = make_runner()
    with pytest.raises(RuntimeError, match="No forward context"):
        runner.model(torch.tensor([5, 6]), torch.tensor([0, 1]))


def spec_step(runner, computed, nst, drafts=None):
    so = sched(cached_reqs=cached(("a", computed, None)), nst={"a": nst})
    if drafts:
        so.scheduled_spec_decode_tokens = {"a": drafts}
    return step(runner, so)


def test_drafts_accepted_and_rejected_then_the_next_step_rewrites_their_slots(make_runner):
    """Request "a" (5 prompt tokens, blocks 1 2 3 of 4 slots): a plain runner gives greedy tokens t1..t5. With
    drafts: [t2 + 1, t3] is rejected at once (output [t2]); the scheduler takes back 2 computed
    tokens, so the next pass recomputes position 6, the slot the rejected draft wrote; then
    [t4, t5] is accepted whole, with the bonus t6."""
    plain = make_runner()
    ids = prompt(5, 21)
    blocks = [1, 2, 3]
    t = [None, step(plain, sched([new_req("a", ids, blocks)], nst={"a": 5})
                    ).sampled_token_ids[0][0]]
    for computed in range(5, 10):
        t.append(spec_step(plain, computed, 1).sampled_token_ids[0][0])

    runner = make_runner()
    assert step(runner, sched([new_req("a", ids, blocks)], nst={"a": 5})
                ).sampled_token_ids == [[t[1]]]
    out = spec_step(runner, 5, 3, drafts=[(t[2] + 1) % VOCAB, t[3]])
    assert out.sampled_token_ids == [[t[2]]]
    # Scheduler: 5 + 3 computed - 2 rejected = 6. Position 6 is recomputed with the real t2.
    out = spec_step(runner, 6, 1)
    assert runner.positions.cpu[0].item() == 6 and runner.input_ids.cpu[0].item() == t[2]
    slot = runner.input_batch.block_table.slot_mapping.cpu[0].item()
    assert slot == blocks[6 // runner.block_size] * runner.block_size + 6 % runner.block_size
    assert out.sampled_token_ids == [[t[3]]]
    out = spec_step(runner, 7, 3, drafts=[t[4], t[5]])
    assert out.sampled_token_ids == [[t[4], t[5], t[6]]]
    assert token_row(runner, "a")[:10] == ids + t[1:6]
    assert runner.requests["a"].output_token_ids == t[1:7]


def test_grammar_bitmask_rows_follow_req_ids_not_rows(make_runner):
    """The scheduler's bitmask rows are in its own request order; sample_tokens maps each to
    the request's current batch row. Here the bitmask names "b" (row 1) first and "a" (row 0)
    second; each must get its own mask."""
    from keel.core.sched_output import GrammarOutput

    runner = make_runner()
    reqs = [new_req("a", prompt(5, 12), [1]), new_req("b", prompt(4, 13), [2])]
    assert runner.execute_model(sched(reqs, nst={"a": 5, "b": 4})) is None
    width = -(-VOCAB // 32)
    bitmask = torch.zeros(2, width, dtype=torch.int32)
    bitmask[0, 7 // 32] = 1 << (7 % 32)  # "b": only token 7
    bitmask[1, 40 // 32] = 1 << (40 % 32)  # "a": only token 40
    out = runner.sample_tokens(GrammarOutput(["b", "a"], bitmask))
    assert out.sampled_token_ids[out.req_id_to_index["a"]] == [40]
    assert out.sampled_token_ids[out.req_id_to_index["b"]] == [7]


def test_greedy_step_samples_the_bfloat16_logits_and_others_get_float32(config, monkeypatch):
    """A bfloat16 model's LM head gives bfloat16 logits. A step that is a greedy argmax alone
    samples them as they are (no float32 copy); a step with a random row widens them first.
    Either way the tokens are the argmax of the float32 logits. (With the LM head's own
    argmax off: where the head runs on the AMX GEMM it would take a greedy step's tokens
    itself; tests/engine/test_greedy_lm_head.py.)"""
    import dataclasses

    monkeypatch.setenv("KEEL_GREEDY_LM_HEAD", "0")

    bf16 = dataclasses.replace(config, model_config=dataclasses.replace(
        config.model_config, dtype="bfloat16"))
    runner = ModelRunner(bf16, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(NUM_BLOCKS)
    seen = []
    sampler = runner.sampler

    def recording(logits, meta):
        seen.append(logits.dtype)
        out = sampler(logits.clone(), meta)
        want = logits.float().argmax(-1)
        greedy_rows = (meta.temperature < 1e-5) if meta.temperature is not None else None
        got = out.sampled_token_ids
        assert torch.equal(got if greedy_rows is None else got[greedy_rows],
                           want if greedy_rows is None else want[greedy_rows])
        return out

    monkeypatch.setattr(runner, "sampler", recording)
    step(runner, sched(new=[new_req("a", prompt(7, 1), [0]), new_req("b", prompt(5, 2), [1])],
                       nst={"a": 7, "b": 5}))
    assert seen == [torch.bfloat16]
    step(runner, sched(new=[new_req("c", prompt(6, 3), [2],
                                    sp=SamplingParams(temperature=0.8, seed=1))],
                       cached_reqs=cached(("a", 7, None), ("b", 5, None)),
                       nst={"a": 1, "b": 1, "c": 6}))
    assert seen == [torch.bfloat16, torch.float32]


def test_greedy_step_takes_the_lm_heads_argmax_unless_a_grammar_is_in_the_batch(config,
                                                                               monkeypatch):
    """A bfloat16 head on the AMX GEMM takes an all-greedy step's tokens in its epilogue
    (ParallelLMHead.greedy_token_ids): the argmax of the logits it would give. A request with a
    grammar in the batch keeps the logits (its bitmask goes onto them); a bitmask that comes
    for a step whose head took the tokens gets the logits made from the hidden states."""
    import dataclasses

    from keel.core.sched_output import GrammarOutput
    from keel.cpu_ops import get_cpu_ops
    from keel.model_executor.layers import amx_choice, gemm_choice
    from keel.sampling_params import StructuredOutputsParams

    monkeypatch.setenv("KEEL_GREEDY_LM_HEAD", "1")
    ops = get_cpu_ops()
    on_amx = ops is not None and ops.amx_gemm_dense_available()
    if on_amx:  # the AMX GEMM chosen (the engine measures it against oneDNN's)
        monkeypatch.setattr(gemm_choice, "_keel_ops", ops)
        monkeypatch.setattr(amx_choice, "_amx_gemm_faster", True)
    bf16 = dataclasses.replace(config, model_config=dataclasses.replace(
        config.model_config, dtype="bfloat16"))
    runner = ModelRunner(bf16, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(NUM_BLOCKS)
    model = runner.model
    assert (model.lm_head.amx_weight is not None) == on_amx
    taken = []
    real = model.greedy_token_ids

    def checked(hidden):
        out = real(hidden)
        taken.append(out is not None)
        if out is not None:
            want = model.compute_logits(hidden, float32=False).float().argmax(-1)
            assert torch.equal(out, want)
        return out

    monkeypatch.setattr(model, "greedy_token_ids", checked)
    step(runner, sched(new=[new_req("a", prompt(7, 1), [0]), new_req("b", prompt(5, 2), [1])],
                       nst={"a": 7, "b": 5}))
    assert taken == [on_amx]
    grammar = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(regex="x"))
    assert runner.execute_model(sched(new=[new_req("c", prompt(6, 3), [2], sp=grammar)],
                                      cached_reqs=cached(("a", 7, None), ("b", 5, None)),
                                      nst={"a": 1, "b": 1, "c": 6})) is None
    assert runner.execute_model_state.logits is not None and taken == [on_amx]
    bitmask = torch.zeros(1, -(-VOCAB // 32), dtype=torch.int32)
    bitmask[0, 0] = 1 << 9  # "c": only token 9
    out = runner.sample_tokens(GrammarOutput(["c"], bitmask))
    assert out.sampled_token_ids[out.req_id_to_index["c"]] == [9]
    # "c" done: a greedy step again, and a bitmask for "a" all the same (never sent so).
    assert runner.execute_model(sched(cached_reqs=cached(("a", 8, None), ("b", 6, None)),
                                      nst={"a": 1, "b": 1}, finished={"c"})) is None
    assert (runner.execute_model_state.logits is None) == on_amx
    bitmask[0, 0] = 1 << 11
    out = runner.sample_tokens(GrammarOutput(["a"], bitmask))
    assert out.sampled_token_ids[out.req_id_to_index["a"]] == [11]
