"""The n-gram proposer and the rejection sampler on their own (no model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from keel.sample.metadata import SamplingMetadata
from keel.sample.rejection_sampler import SpecDecodeMetadata, rejection_sample
from keel.spec_decode.ngram_proposer import NgramProposer


def rows_of(*seqs, width=32):
    ids = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    return ids, np.array([len(s) for s in seqs], dtype=np.int32)


def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    ids, lens = rows_of(
        [5, 6, 7, 8, 5, 6],  # suffix [5 6] at 0 -> [7 8 5]
        [1, 2, 3, 9, 1, 2, 4, 1, 2],  # [1 2] last seen at 4 -> [4 1 2]
        [1, 2, 3, 4],  # no repeat -> nothing
        [3, 4, 1, 3, 4, 2, 9, 3, 4],  # n=3 [9 3 4] absent; n=2 [3 4] latest at 3 -> [2 9 3]
    )
    drafts = NgramProposer(3, 2, 3).propose(ids, lens, np.arange(4))
    assert drafts == [[7, 8, 5], [4, 1, 2], [], [2, 9, 3]]
    # Only the rows asked for. Past the known followers the drafts repeat them: [6] at 1 is
    # followed by [7 8 5 6], the fifth draft is the first again.
    assert NgramProposer(5, 1, 1).propose(ids, lens, np.array([0])) == [[7, 8, 5, 6, 7]]


def test_ngram_drafts_go_on_around_a_loop_shorter_than_k():
    ids, lens = rows_of(
        [9, 1, 2, 1, 2],  # period 2: [1 2] at 1, followed by [1 2] -> then [1 2 ...] again
        [4, 7, 7, 7],  # period 1: n=2 [7 7] latest at 1 -> [7] and on
        [3, 5, 6, 8, 5, 6, 8],  # period 3: n=3 [5 6 8] at 1 -> [5 6 8 5 6]
        [1, 2, 3],  # no repeat -> nothing
    )
    drafts = NgramProposer(5, 2, 3).propose(ids, lens, np.arange(4))
    assert drafts == [[1, 2, 1, 2, 1], [7, 7, 7, 7, 7], [5, 6, 8, 5, 6], []]
    # The drafts are what the row would be if it kept repeating: appending them to the row
    # and drafting again from the end gives the same continuation.
    row = [9, 1, 2, 1, 2] + drafts[0]
    more, n = rows_of(row)
    assert NgramProposer(3, 2, 2).propose(more, n, np.array([0])) == [[2, 1, 2]]


def greedy_meta(n, temperature=None, generators=None):
    all_greedy = temperature is None
    return SamplingMetadata(temperature=temperature, all_greedy=all_greedy,
                            all_random=not all_greedy, top_p=None, top_k=None,
                            generators=generators or {})


def spec_meta(num_draft, drafts):
    num_draft = np.array(num_draft)
    return SpecDecodeMetadata(torch.tensor(drafts, dtype=torch.int64), num_draft,
                              torch.arange(len(drafts)), torch.zeros(len(num_draft)),
                              torch.zeros(0))


def test_greedy_accepts_the_leading_run_that_matches_the_argmax():
    vocab = 10
    # Request 0: drafts [3, 4, 5], target argmax [3, 4, 7] -> accepts 2, then 7.
    # Request 1: drafts [2], argmax [2] -> all accepted, then its bonus token 8.
    # Request 2: no drafts -> its bonus token 6.
    argmax = [3, 4, 7, 2]
    logits = torch.full((4, vocab), -5.0)
    logits[torch.arange(4), torch.tensor(argmax)] = 5.0
    out, accepted = rejection_sample(logits, spec_meta([3, 1, 0], [3, 4, 5, 2]),
                                     torch.tensor([9, 8, 6]), greedy_meta(3))
    assert out == [[3, 4, 7], [2, 8], [6]] and accepted.tolist() == [2, 1, 0]


@pytest.mark.parametrize("draft", [0, 2])  # a likely and an unlikely draft token
def test_random_rows_keep_the_target_distribution(draft):
    """Accept-or-resample with a point-mass draft: the first token is distributed as the
    target p (temperature 1), whatever the draft."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 40000
    logits = p.log().repeat(n, 1)
    meta = greedy_meta(n, temperature=torch.ones(n))
    out, _ = rejection_sample(logits, spec_meta([1] * n, [draft] * n),
                              torch.full((n,), 3), meta)
    first = torch.tensor([o[0] for o in out])
    freq = torch.bincount(first, minlength=4).float() / n
    assert (freq - p).abs().sum() / 2 < 0.015  # total variation


def test_seeded_rows_repeat_exactly():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = p.log().repeat(3, 1)

    def run():
        gen = torch.Generator().manual_seed(7)
        meta = greedy_meta(1, temperature=torch.ones(1), generators={0: gen})
        torch.manual_seed(123)  # unseeded draws differ from run to run...
        torch.rand(int(torch.randint(1, 5, (1,))))
        return rejection_sample(logits, spec_meta([3], [1, 1, 2]), torch.tensor([0]), meta)[0]

    assert all(run() == run() for _ in range(5))  # ...seeded ones do not
