"""keel's greedy LM head (csrc/greedy_head.cpp): each row's argmax of x @ W^T found by screening
the columns with int8 dot products and a rigorous bound, then computing exactly only the columns
the bound cannot rule out. The token must be torch's argmax of the float32 logits (of their
bfloat16 rounding with round_bf16), ties to the first column, whatever the data: outlier
channels, exact ties, a row computed whole, columns past n_valid, values that are not finite.
Where the build has no AVX512-VNNI the op says so and raises (the tests check that instead),
and the engine keeps the head's own GEMM."""

from __future__ import annotations

import pytest
import torch

from keel import LLM, SamplingParams
from keel.cpu_ops import get_cpu_ops
from keel.model_executor.layers import vocab_embedding
from tests.hf_models import make_hf_model

ops = get_cpu_ops()


def kernel_here() -> bool:
    """Whether this build has the kernel; where it has not, that its call says why."""
    assert ops is not None, "the CPU kernels must build on this machine"
    if ops.greedy_head_available():
        return True
    assert "avx512_vnni" not in ops.built_for()
    packed, scales, norms = ops.greedy_head_pack(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="AVX512-VNNI"):
        ops.greedy_head(torch.randn(1, 32), packed, scales, norms, torch.randn(16, 32), 16,
                        False, 256)
    return False


def hidden_states(rows: int, k: int, outliers: int = 4) -> torch.Tensor:
    """Rows like a model's final hidden states: a few channels far larger than the rest (what
    makes one int8 scale per row useless)."""
    x = torch.randn(rows, k)
    x[:, torch.randperm(k)[:outliers]] *= 40.0
    return x


def reference(x: torch.Tensor, w: torch.Tensor, n_valid: int, round_bf16: bool) -> torch.Tensor:
    logits = (x.double() @ w.double().T)[:, :n_valid]
    if round_bf16:
        logits = logits.float().bfloat16().float()
    return logits.argmax(-1)


def run(x, w, n_valid=None, round_bf16=False, cap=4096):
    n_valid = w.shape[0] if n_valid is None else n_valid
    packed, scales, norms = ops.greedy_head_pack(w)
    return ops.greedy_head(x, packed, scales, norms, w, n_valid, round_bf16, cap)


@pytest.mark.parametrize("n,k", [(1000, 64), (4099, 96), (160, 32)])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_tokens_are_the_exact_logits_argmax(n, k, rows):
    if not kernel_here():
        return
    w = torch.randn(n, k) * 0.05
    x = hidden_states(rows, k)
    tokens, computed = run(x, w)
    assert torch.equal(tokens, reference(x, w, n, False))
    # The screening rules most columns out (a handful computed exactly, never the whole row).
    assert (computed >= 1).all() and computed.float().mean() < n / 10, computed


def test_the_bound_keeps_a_close_runner_up():
    """Two columns whose logits differ by far less than int8's error: the screening cannot
    tell them apart, the exact pass must."""
    if not kernel_here():
        return
    k, n = 64, 512
    w = torch.randn(n, k) * 0.05
    x = hidden_states(16, k)
    best = (x @ w.T).argmax(-1)
    for r in range(16):  # column 7 a hair above the row's best, column 300 a hair below
        d = x[r] / x[r].norm() ** 2
        w[7] = w[best[r]] + 1e-4 * d
        w[300] = w[best[r]] - 1e-4 * d
        tokens, computed = run(x[r:r + 1], w)
        assert tokens.item() == 7 and computed.item() >= 2


def test_exact_ties_go_to_the_first_column():
    if not kernel_here():
        return
    k, n = 64, 300
    w = torch.randn(n, k) * 0.05
    x = hidden_states(4, k)
    winner = (x @ w.T).argmax(-1)
    w[250] = w[winner[0]]
    w[40] = w[winner[0]]
    tokens, _ = run(x[:1], w)
    assert tokens.item() == min(40, winner[0].item())


def test_bfloat16_rounding_ties_go_to_the_first_column():
    """Logits 4.0 and 4.01 are one bfloat16 value: with round_bf16 the lower column wins, as
    torch's argmax of a bfloat16 head's logits; without it the larger logit does."""
    if not kernel_here():
        return
    k, n = 32, 64
    x = torch.zeros(1, k)
    x[0, 0] = 1.0
    w = torch.randn(n, k) * 0.01
    w[:, 0] = 0.0
    w[10, 0] = 4.0
    w[20, 0] = 4.01
    assert run(x.bfloat16(), w.bfloat16(), round_bf16=True)[0].item() == 10
    assert run(x, w)[0].item() == 20
    xb, wb = hidden_states(32, 64).bfloat16(), (torch.randn(700, 64) * 0.05).bfloat16()
    tokens, _ = run(xb, wb, round_bf16=True)
    assert torch.equal(tokens, reference(xb.float(), wb.float(), 700, True))


def test_a_row_past_its_cap_is_computed_whole():
    if not kernel_here():
        return
    w = torch.randn(2000, 64) * 0.05
    x = hidden_states(9, 64)
    tokens, computed = run(x, w, cap=16)
    assert (computed == -1).all()
    assert torch.equal(tokens, reference(x, w, 2000, False))


def test_columns_past_n_valid_are_never_taken():
    if not kernel_here():
        return
    w = torch.randn(200, 64) * 0.05
    x = hidden_states(5, 64)
    w[190:] = x[0] * 10.0  # by far the largest logits, past n_valid
    tokens, _ = run(x, w, n_valid=190)
    assert torch.equal(tokens, reference(x, w, 190, False)) and (tokens < 190).all()


def test_a_row_that_is_not_finite_is_computed_whole_as_torch_would():
    if not kernel_here():
        return
    w = torch.randn(100, 64) * 0.05
    x = hidden_states(3, 64)
    x[1, 5] = float("nan")
    x[2, 9] = float("inf")
    tokens, computed = run(x, w)
    assert computed[0] >= 1 and computed[1] == -1 and computed[2] == -1
    assert torch.equal(tokens, (x @ w.T).argmax(-1))


def test_bad_shapes_are_named():
    if not kernel_here():
        return
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.greedy_head_pack(torch.randn(10, 40))
    packed, scales, norms = ops.greedy_head_pack(torch.randn(10, 32))
    with pytest.raises(RuntimeError, match="0 < n_valid <= N"):
        ops.greedy_head(torch.randn(2, 32), packed, scales, norms, torch.randn(10, 32), 11,
                        False, 256)
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.greedy_head(torch.randn(2, 64), packed, scales, norms, torch.randn(10, 64), 10,
                        False, 256)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_takes_greedy_tokens_from_it(dtype, tmp_path, monkeypatch):
    """A tied head (hidden 96) gets the screening copy where chosen; its greedy tokens are the
    ones the head's own GEMM gives (KEEL_GREEDY_HEAD=0), and it is asked every step."""
    chosen = vocab_embedding.greedy_head_chosen()  # not where AMX tiles or no VNNI
    folder = make_hf_model("llama", tmp_path / "tied", tie_word_embeddings=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 33, 9] * 5, [60, 61], [1, 2, 3, 4, 5])]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    calls = []
    real = ops.greedy_head
    out = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("KEEL_GREEDY_HEAD", mode)
        monkeypatch.setattr(ops, "greedy_head",
                            lambda *a, mode=mode, **kw: calls.append(mode) or real(*a, **kw))
        llm = LLM(str(folder), dtype=dtype, kv_cache_memory_gib=0.0625)
        head = llm.engine_core.model_executor.driver_worker.model_runner.model.lm_head
        assert (head.greedy_screen is not None) == (chosen and mode == "1")
        out[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                  use_tqdm=False)]
        del llm
    assert out["1"] == out["0"]
    assert calls.count("1") >= (10 if chosen else 0) and calls.count("0") == 0


def test_a_bad_switch_is_named(monkeypatch):
    monkeypatch.setenv("KEEL_GREEDY_HEAD", "on")
    with pytest.raises(ValueError, match="KEEL_GREEDY_HEAD must be 0 or 1"):
        vocab_embedding.greedy_head_chosen()
