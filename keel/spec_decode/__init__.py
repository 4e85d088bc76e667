"""Speculative decoding: a proposer drafts tokens, the model scores them all in one pass, the
rejection sampler (keel/sample/rejection_sampler.py) keeps the ones the target agrees with."""
