"""The fused log-prob/entropy head (train_backend/megatron/loss_head.py) equals the plain path:
log-probs, entropies and gradients wrt the logits, with a padded vocabulary (incl. a TP rank whose
slice is all padding), temperature != 1, several chunks, on one rank and under TP=2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._fixtures_loss_head import check_loss_head
from tests._fixtures_megatron import spawn

pytest.importorskip("megatron.core")

CASES = [
    # padded vocabulary (37 of 48; TP=2: rank 1 holds 13 real columns), temperature 0.7, 4 chunks
    dict(rows=23, n=17, vocab=37, padded_vocab=48, temperature=0.7, scale=3.0, chunk_rows=5,
         dtype=torch.float32, impls=["chunked"]),
    # TP=2: rank 1's slice is all padding; temperature 1; one chunk
    dict(rows=9, n=9, vocab=20, padded_vocab=48, temperature=1.0, scale=1.0, chunk_rows=64,
         dtype=torch.float32, impls=["chunked"]),
    # bf16 logits (the GPU case): fp32 math inside, gradient in bf16; large logits
    dict(rows=16, n=12, vocab=60, padded_vocab=64, temperature=1.3, scale=20.0, chunk_rows=3,
         dtype=torch.bfloat16, impls=["chunked"]),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(check_loss_head, 2, ([1, 2], CASES), tmp_path_factory.mktemp("loss_head"))


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fused_head_matches_reference_and_plain_path(results: list[dict[str, Any]], layout: str, case: int) -> None:
    bf16 = CASES[case]["dtype"] == torch.bfloat16
    # fp32 logits: float rounding of an fp64 reference; bf16: the gradient is rounded to bf16 once
    tol, gtol = (1e-4, 1e-2) if bf16 else (1e-5, 1e-5)
    for rank_res in results:
        r = rank_res[f"{layout}_case{case}"]
        for impl in CASES[case]["impls"]:
            assert r[f"{impl}_logp"] <= tol, r
            assert r[f"{impl}_ent"] <= tol, r
            assert r[f"{impl}_grad"] <= gtol, r
            assert r[f"{impl}_grad_logp_only"] <= gtol, r
            assert r[f"{impl}_no_entropy_logp"] <= tol, r
            assert r[f"{impl}_grad_dtype_ok"] == 1.0
            assert r[f"{impl}_metric_ent_detached"] == 1.0
            assert r[f"{impl}_no_entropy_is_none"] == 1.0
        # the plain megatron path meets the same bounds on the same inputs
        assert max(r["unfused_logp"], r["unfused_ent"]) <= tol and r["unfused_grad"] <= gtol, r


@pytest.mark.slow
def test_compiled_head_matches_reference(tmp_path: Path) -> None:
    """The torch.compile'd chunk kernels (Inductor's C++ backend on the CPU) give the same numbers."""
    cases = [dict(c, impls=["compiled"]) for c in CASES[:2]]
    for rank_res in spawn(check_loss_head, 2, ([1, 2], cases), tmp_path, timeout_s=600):
        for key, r in rank_res.items():
            assert max(r["compiled_logp"], r["compiled_ent"], r["compiled_no_entropy_logp"]) <= 1e-5, (key, r)
            assert max(r["compiled_grad"], r["compiled_grad_logp_only"]) <= 1e-5, (key, r)
            assert r["compiled_metric_ent_detached"] == 1.0 and r["compiled_grad_dtype_ok"] == 1.0
