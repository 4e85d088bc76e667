"""With pipeline stages the scheduler sends each pass's tokens to the runners
(scheduled_cached_reqs.new_token_ids), since only the last stage samples."""

from __future__ import annotations

from keel.config import CacheConfig, SchedulerConfig
from keel.core.scheduler import Scheduler
from keel.outputs import ModelRunnerOutput
from keel.request import Request
from keel.sampling_params import SamplingParams


def _run(pipeline_parallel: bool):
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16)
    sc.max_model_len = 64
    sched = Scheduler(sc, CacheConfig(block_size=16), num_blocks=16,
                      pipeline_parallel=pipeline_parallel)
    sched.add_request(Request("a", list(range(100, 124)), SamplingParams(max_tokens=5),
                              max_tokens=5))
    seen = []
    for step in range(4):
        out = sched.schedule()
        seen.append(out.scheduled_cached_reqs.new_token_ids)
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=["a"], req_id_to_index={"a": 0},
            sampled_token_ids=[[] if step == 0 else [step]]))
    return seen


def test_new_token_ids_carry_the_tokens_of_each_pass_only_with_pipeline_stages():
    # 24-token prompt, budget 16: a chunk of 16 (new request), the last 8 prompt tokens
    # (sampling 1), then two decodes of the tokens sampled before them.
    assert _run(True) == [[], [list(range(116, 124))], [[1]], [[2]]]
    assert _run(False) == [[], [[]], [[]], [[]]]
