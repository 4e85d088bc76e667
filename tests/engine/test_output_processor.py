"""OutputProcessor (with LogprobsProcessor and ParentRequest) on hand-made EngineCoreOutputs:
no model, no engine core."""

from __future__ import annotations

import numpy as np
import pytest

from keel.engine.logprobs import LogprobsProcessor
from keel.engine.output_processor import OutputProcessor
from keel.engine.parallel_sampling import ParentRequest
from keel.outputs import CompletionOutput, EngineCoreOutput, Logprob, LogprobsLists
from keel.request import Request
from keel.sampling_params import RequestOutputKind, SamplingParams
from tests.hf_models import make_tokenizer

EOS = 1
CUMULATIVE, DELTA, FINAL_ONLY = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
                                 RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def add(proc: OutputProcessor, rid: str, prompt_ids: list[int], **params) -> Request:
    req = Request(rid, list(prompt_ids), SamplingParams(**params))
    proc.add_request(req, prompt="p")
    return req


def lists(rows: list[list[tuple[int, float]]], ranks: list[int]) -> LogprobsLists:
    """rows[i] = [(sampled id, lp), (top1 id, lp), ...]: one row per position."""
    return LogprobsLists(
        np.array([[t for t, _ in r] for r in rows], dtype=np.int64),
        np.array([[lp for _, lp in r] for r in rows], dtype=np.float32),
        np.array(ranks, dtype=np.int64),
    )


def step(proc: OutputProcessor, rid: str, ids: list[int], finish: str | None = None, **kw):
    return proc.process_outputs([EngineCoreOutput(rid, list(ids), finish, **kw)])


def run_tokens(proc, rid, ids, finish="length"):
    """One token per step, the last step finishing; returns every RequestOutput."""
    outs = []
    for n, i in enumerate(ids):
        res = step(proc, rid, [i], finish if n == len(ids) - 1 else None)
        outs += res.request_outputs
    return outs


# ---- output kinds ------------------------------------------------------------------------------


def test_cumulative_delta_final_only(tok):
    ids = tok.encode("Hello world é漢")
    text = tok.decode(ids)
    by_kind = {}
    for kind in (CUMULATIVE, DELTA, FINAL_ONLY):
        proc = OutputProcessor(tok)
        add(proc, "r", [40, 41], output_kind=kind)
        by_kind[kind] = run_tokens(proc, "r", ids)
        assert not proc.has_unfinished_requests()

    cum = by_kind[CUMULATIVE]
    assert len(cum) == len(ids)
    assert [o.outputs[0].token_ids for o in cum] == [ids[:n + 1] for n in range(len(ids))]
    assert cum[-1].outputs[0].text == text and cum[-1].finished
    assert [o.finished for o in cum[:-1]] == [False] * (len(ids) - 1)
    assert cum[0].outputs[0].token_ids == ids[:1]  # earlier outputs are not changed later

    delta = by_kind[DELTA]
    assert [o.outputs[0].token_ids for o in delta] == [[i] for i in ids]
    assert "".join(o.outputs[0].text for o in delta) == text
    assert delta[-1].outputs[0].finish_reason == "length"

    final = by_kind[FINAL_ONLY]
    assert len(final) == 1 and final[0].finished
    c = final[0].outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, c.index) == (text, ids, "length", 0)
    assert final[0].request_id == "r" and final[0].prompt == "p"
    assert final[0].prompt_token_ids == [40, 41]


def test_eos_from_the_engine(tok):
    proc = OutputProcessor(tok)
    add(proc, "r", [40], skip_special_tokens=False, output_kind=FINAL_ONLY)
    ids = tok.encode("Hi")
    step(proc, "r", ids)
    res = step(proc, "r", [EOS], "stop", stop_reason=None)
    c = res.request_outputs[0].outputs[0]
    assert c.text == "Hi" and c.token_ids == [*ids, EOS]  # EOS kept as a token, not as text
    assert c.finish_reason == "stop" and c.stop_reason is None
    assert res.reqs_to_abort == []  # the engine core finished it itself


def test_stop_string_finishes_and_asks_for_abort(tok):
    proc = OutputProcessor(tok)
    add(proc, "a", [40], stop=["lazy"], output_kind=DELTA)
    add(proc, "b", [40], output_kind=DELTA)
    texts, aborted = [], []
    for i in tok.encode("The lazy dog"):
        res = proc.process_outputs([EngineCoreOutput("a", [i]), EngineCoreOutput("b", [i])])
        aborted += res.reqs_to_abort
        texts += [o.outputs[0].text for o in res.request_outputs if o.request_id == "a"]
        if aborted:
            last = next(o for o in res.request_outputs if o.request_id == "a")
            break
    assert aborted == ["a"]
    assert last.finished and last.outputs[0].finish_reason == "stop"
    assert last.outputs[0].stop_reason == "lazy"
    assert "".join(texts) == "The "
    # "a" is gone; the engine core may still send one more step for it: ignored.
    assert proc.get_num_unfinished_requests() == 1
    res = proc.process_outputs([EngineCoreOutput("a", [50])])
    assert res.request_outputs == [] and res.reqs_to_abort == []


def test_stop_string_on_the_engines_last_step_is_not_aborted(tok):
    proc = OutputProcessor(tok)
    add(proc, "r", [40], stop=["fox"], output_kind=FINAL_ONLY)
    res = step(proc, "r", tok.encode("a fox"), "length")
    c = res.request_outputs[0].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("a ", "stop", "fox")
    assert res.reqs_to_abort == []


def test_no_tokenizer_gives_ids_only():
    proc = OutputProcessor(None)
    add(proc, "r", [3], output_kind=FINAL_ONLY, logprobs=1)
    res = step(proc, "r", [5], "length", new_logprobs=lists([[(5, -0.5), (6, -0.1)]], [2]))
    c = res.request_outputs[0].outputs[0]
    assert c.text == "" and c.token_ids == [5]
    assert c.logprobs == [{5: Logprob(-0.5, 2, None), 6: Logprob(pytest.approx(-0.1), 1, None)}]


# ---- logprobs -----------------------------------------------------------------------------------


def test_sample_logprobs_shaped_like_vllm_and_trimmed(tok):
    proc = OutputProcessor(tok)
    add(proc, "r", [40], logprobs=2, output_kind=CUMULATIVE)
    # The batch's widest request asked for 4: the engine sends 5 columns.
    pos0 = [(50, -2.0), (60, -0.5), (61, -1.0), (62, -1.5), (63, -1.75)]  # sampled not in top 2
    pos1 = [(60, -0.25), (60, -0.25), (61, -2.0), (62, -3.0), (63, -4.0)]  # sampled is top 1
    res = step(proc, "r", [50, 60], new_logprobs=lists([pos0, pos1], [5, 1]))
    c = res.request_outputs[0].outputs[0]
    assert len(c.logprobs) == 2
    first, second = c.logprobs
    assert list(first) == [50, 60, 61]  # sampled first, then the request's 2, no more
    assert first[50].rank == 5 and first[60].rank == 1 and first[61].rank == 2
    assert first[60].logprob == -0.5 and first[61].logprob == -1.0
    assert list(second) == [60, 61] and second[60].rank == 1 and second[61].rank == 2
    assert first[50].decoded_token == tok.convert_tokens_to_string(
        [tok.convert_ids_to_tokens(50)])
    for entry in (first, second):
        for token_id, lp in entry.items():
            assert type(token_id) is int and type(lp.logprob) is float and type(lp.rank) is int
            assert isinstance(lp.decoded_token, str)
    assert c.cumulative_logprob == pytest.approx(-2.25)
    assert type(c.cumulative_logprob) is float


def test_logprobs_zero_keeps_only_the_sampled_token(tok):
    proc = OutputProcessor(tok)
    add(proc, "r", [40], logprobs=0, detokenize=False, output_kind=FINAL_ONLY)
    row = [(70, -1.5), (71, -0.1), (72, -0.2)]
    res = step(proc, "r", [70], "length", new_logprobs=lists([row], [3]))
    c = res.request_outputs[0].outputs[0]
    assert c.logprobs == [{70: Logprob(-1.5, 3, None)}]  # detokenize=False: no decoded text
    assert c.cumulative_logprob == -1.5


def test_no_logprobs_requested_means_none(tok):
    proc = OutputProcessor(tok)
    add(proc, "r", [40, 41], output_kind=FINAL_ONLY)
    row = [(70, -1.5), (71, -0.1)]
    res = step(proc, "r", [70], "length", new_logprobs=lists([row], [3]),
                new_prompt_logprobs=lists([row], [3]))
    out = res.request_outputs[0]
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert out.prompt_logprobs is None


def test_delta_logprobs_follow_the_new_tokens(tok):
    proc = OutputProcessor(tok)
    add(proc, "r", [40], logprobs=1, output_kind=DELTA)
    r1 = step(proc, "r", [50], new_logprobs=lists([[(50, -1.0), (51, -0.5)]], [2]))
    r2 = step(proc, "r", [52, 53], "length",
              new_logprobs=lists([[(52, -0.1), (52, -0.1)], [(53, -0.2), (54, -0.1)]], [1, 2]))
    c1, c2 = r1.request_outputs[0].outputs[0], r2.request_outputs[0].outputs[0]
    assert [list(d) for d in c1.logprobs] == [[50, 51]]
    assert [list(d) for d in c2.logprobs] == [[52], [53, 54]]
    assert c2.cumulative_logprob == pytest.approx(-1.3)


def test_prompt_logprobs_over_two_chunks(tok):
    prompt = [40, 41, 42, 43, 44]
    for kind in (CUMULATIVE, DELTA):
        proc = OutputProcessor(tok)
        add(proc, "r", prompt, prompt_logprobs=1, output_kind=kind)
        # Chunked prefill: positions 1-2 in one pass (no token sampled yet), 3-4 in the next.
        chunk1 = lists([[(41, -1.0), (41, -1.0), (9, -2.0)], [(42, -3.0), (9, -0.5), (10, -1.0)]],
                       [1, 4])
        chunk2 = lists([[(43, -0.5), (43, -0.5), (9, -2.0)], [(44, -0.7), (10, -0.2), (44, -0.7)]],
                       [1, 2])
        r0 = step(proc, "r", [], new_prompt_logprobs=chunk1)
        assert r0.request_outputs == []  # nothing for the user yet
        r1 = step(proc, "r", [50], new_prompt_logprobs=chunk2)
        plp = r1.request_outputs[0].prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        assert [list(d) for d in plp[1:]] == [[41], [42, 9], [43], [44, 10]]
        assert plp[2][42].rank == 4 and plp[2][9].rank == 1 and plp[4][44].rank == 2
        assert plp[2][42].decoded_token == tok.convert_tokens_to_string(
            [tok.convert_ids_to_tokens(42)])
        r2 = step(proc, "r", [51], "length")
        later = r2.request_outputs[0].prompt_logprobs
        if kind == DELTA:
            assert later is None  # sent with the first output only
        else:
            assert later == plp


def test_logprobs_processor_alone_skips_missing_arrays(tok):
    req = Request("r", [1, 2], SamplingParams(logprobs=1))
    lp = LogprobsProcessor.from_new_request(tok, req)
    lp.update_from_output(EngineCoreOutput("r", [5]))
    assert lp.logprobs == [] and lp.cumulative_logprob == 0.0 and lp.prompt_logprobs is None


# ---- n > 1 -------------------------------------------------------------------------------------


def test_parent_request_child_info():
    params = SamplingParams(n=3, seed=10, temperature=0.8)
    parent = ParentRequest("req", params)
    infos = [parent.get_child_info(i) for i in range(3)]
    assert [cid for cid, _ in infos] == ["0_req", "1_req", "2_req"]
    assert [p.seed for _, p in infos] == [10, 11, 12]
    assert all(p.n == 1 and p.temperature == 0.8 for _, p in infos)
    assert params.n == 3 and params.seed == 10  # the user's params are untouched
    unseeded = ParentRequest("u", SamplingParams(n=2))
    assert [unseeded.get_child_info(i)[1].seed for i in range(2)] == [None, None]


def test_parent_get_outputs_final_only():
    parent = ParentRequest("req", SamplingParams(n=2, output_kind=FINAL_ONLY))
    a, b = (parent.get_child_info(i)[0] for i in range(2))
    done = [CompletionOutput(i, f"t{i}", [i], finish_reason="length") for i in range(2)]
    assert parent.get_outputs(b, done[1]) == ([], False)
    outs, finished = parent.get_outputs(a, done[0])
    assert finished and [c.index for c in outs] == [0, 1]


def add_children(proc: OutputProcessor, n: int, kind: RequestOutputKind, prompt=(40, 41)):
    parent = ParentRequest("req", SamplingParams(n=n, output_kind=kind))
    ids = []
    for i in range(n):
        cid, params = parent.get_child_info(i)
        proc.add_request(Request(cid, list(prompt), params), "p", parent, i)
        ids.append(cid)
    return ids


def test_n3_final_only_aggregates(tok):
    proc = OutputProcessor(tok)
    ids = add_children(proc, 3, FINAL_ONLY)
    texts = ["a fox", "the dog", "hello"]
    toks = [tok.encode(t) for t in texts]
    # Children finish out of order: 1, then 2, then 0.
    assert step(proc, ids[0], toks[0][:1]).request_outputs == []
    assert step(proc, ids[1], toks[1], "length").request_outputs == []
    assert step(proc, ids[2], toks[2] + [EOS], "stop", stop_reason=EOS).request_outputs == []
    assert proc.get_num_unfinished_requests() == 1
    res = step(proc, ids[0], toks[0][1:], "length")
    assert len(res.request_outputs) == 1
    out = res.request_outputs[0]
    assert out.request_id == "req" and out.finished
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.text for c in out.outputs] == texts
    assert [c.finish_reason for c in out.outputs] == ["length", "length", "stop"]
    assert out.outputs[2].stop_reason == EOS and out.outputs[2].token_ids[-1] == EOS
    assert not proc.has_unfinished_requests() and proc.parent_requests == {}


def test_n3_delta_streams_each_child(tok):
    proc = OutputProcessor(tok)
    ids = add_children(proc, 3, DELTA)
    texts = ["ab", "cd", "ef"]
    got: dict[int, str] = {0: "", 1: "", 2: ""}
    finished_flags = []
    for k in range(2):
        for idx, cid in enumerate(ids):
            finish = "length" if k == 1 else None
            res = step(proc, cid, tok.encode(texts[idx][k]), finish)
            (out,) = res.request_outputs
            assert out.request_id == "req" and len(out.outputs) == 1
            assert out.outputs[0].index == idx
            got[idx] += out.outputs[0].text
            finished_flags.append(out.finished)
    assert got == {0: "ab", 1: "cd", 2: "ef"}
    # Only the last child's last output finishes the parent.
    assert finished_flags == [False] * 5 + [True]


def test_abort_parent_aborts_its_children(tok):
    proc = OutputProcessor(tok)
    ids = add_children(proc, 3, DELTA)
    add(proc, "other", [40])
    step(proc, ids[1], [50], "length")  # one child already done
    assert sorted(proc.abort_requests(["req", "unknown"])) == [ids[0], ids[2]]
    assert proc.get_num_unfinished_requests() == 1 and proc.parent_requests == {}
    assert proc.abort_requests(["other"]) == ["other"]
    assert not proc.has_unfinished_requests()


def test_duplicate_request_id_is_refused(tok):
    proc = OutputProcessor(tok)
    add(proc, "r", [40])
    with pytest.raises(ValueError, match="already"):
        add(proc, "r", [40])
