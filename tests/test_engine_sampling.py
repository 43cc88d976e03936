"""Embedded engine, the sampler: the two-level inverse-CDF draw samples each token with its
probability (across vocabulary blocks and the tail), never picks a zero-weight entry at the
extremes of the uniform draw, and returns log-probs equal to a full log-softmax."""

from __future__ import annotations

import pytest
import torch

from embedded_engine import sampling
from embedded_engine.protocol import SamplingParams
from embedded_engine.sampling import build_row_params, sample

V = 2 * sampling._BLOCK + 452  # two full blocks and a tail


@pytest.mark.parametrize("V", [V, 200])  # two levels; one level (a vocabulary within one block)
def test_draw_frequencies_match_probabilities(V):
    logits = torch.full((V,), -30.0)  # [V] tokens with negligible mass
    hot = {3: 2.0, 1023: 1.0, 1024: 0.5, 1500: 1.5, V - 1: 0.0, 2100: -1.0}  # across blocks and the tail
    hot = {t: v for t, v in hot.items() if t < V} | {V // 2: 0.7}
    for t, v in hot.items():
        logits[t] = v
    probs = torch.softmax(logits.double(), 0)  # [V]
    B, steps = 400, 50
    rows = build_row_params([SamplingParams(temperature=1.0)] * B, [None] * B, V, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, dtype=torch.float64)  # [V]
    for _ in range(steps):
        tok, lp = sample(logits.expand(B, V), rows, g)
        counts += torch.bincount(tok, minlength=V).double()
        torch.testing.assert_close(lp, torch.log_softmax(logits, 0)[tok], rtol=0, atol=1e-6)
    n = B * steps
    assert set(counts.nonzero().flatten().tolist()) <= set(hot)  # mass 1e-13 each elsewhere
    for t in hot:  # within 5 standard deviations of the expected count
        p = float(probs[t])
        assert abs(counts[t] - n * p) <= 5 * (n * p * (1 - p)) ** 0.5, (t, float(counts[t]), n * p)


def test_draw_extremes_never_pick_zero_weight():
    w = torch.zeros(3, V)  # [3, V]
    w[:, 5] = 1.0
    w[:, 1030] = 2.0
    w[:, 2000] = 1.0  # nothing after 2000 (the rest of block 1 and the tail are empty)
    almost_one = 1.0 - 2.0 ** -53
    got = sampling._draw(w, torch.tensor([0.0, almost_one, 0.5], dtype=torch.float64))
    assert got.tolist() == [5, 2000, 1030]
    # a target that rounding put at (or past) the full mass takes the last nonzero entry
    cdf = torch.tensor([[0.0, 1.0, 1.0, 3.0, 3.0]], dtype=torch.float64)  # [1, 5]
    assert sampling._first_above(cdf, torch.tensor([[3.0]], dtype=torch.float64)).item() == 3
    assert sampling._first_above(cdf, torch.tensor([[0.0]], dtype=torch.float64)).item() == 1


def test_seeded_rows_reproduce_and_greedy_rows_take_the_argmax():
    torch.manual_seed(1)
    logits = torch.randn(3, V)  # [3, V]
    params = [SamplingParams(temperature=0.8, sampling_seed=7), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2)]

    def run(shared_seed: int) -> list[list[int]]:
        rows = build_row_params(params, [torch.Generator().manual_seed(7), None, None], V, torch.device("cpu"))
        g = torch.Generator().manual_seed(shared_seed)
        return [sample(logits, rows, g)[0].tolist() for _ in range(20)]

    a, b = run(0), run(1)
    assert [t[0] for t in a] == [t[0] for t in b]  # the seeded row ignores the shared generator
    assert len({t[0] for t in a}) > 1 and [t[2] for t in a] != [t[2] for t in b]
    assert all(t[1] == int(logits[1].argmax()) for t in a)
