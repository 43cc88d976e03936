"""Megatron GPTModel vs HF: same logits on the same weights, and lossless HF round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._fixtures_megatron import ARCHS, check_equivalence, make_hf_checkpoint, spawn

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("megatron_ckpts")
    return {a: str(make_hf_checkpoint(a, root / a, seed=i)) for i, a in enumerate(ARCHS)}


def _assert_close(results: list[dict], layout: str) -> None:
    seen_logits = seen_export = 0
    for rank_res in results:
        for arch, r in rank_res.items():
            if "logits" in r:
                seen_logits += 1
                assert r["logits"] <= 1e-4, f"{arch} {layout}: logits differ by {r['logits']}"
                assert r["logprobs"] <= 1e-4, f"{arch} {layout}: log-probs differ by {r['logprobs']}"
            if "export_equal" in r:
                seen_export += 1
                assert r["export_equal"] == 1.0, f"{arch} {layout}: export(load(ckpt)) != ckpt"
    assert seen_logits >= len(ARCHS) and seen_export == len(ARCHS)


def test_single_rank_matches_hf(ckpts: dict[str, str], tmp_path: Path) -> None:
    _assert_close(spawn(check_equivalence, 1, (ckpts, 1, 1), tmp_path), "tp1pp1")


def test_tp2_matches_hf(ckpts: dict[str, str], tmp_path: Path) -> None:
    _assert_close(spawn(check_equivalence, 2, (ckpts, 2, 1), tmp_path), "tp2")


def test_pp2_matches_hf(ckpts: dict[str, str], tmp_path: Path) -> None:
    _assert_close(spawn(check_equivalence, 2, (ckpts, 1, 2), tmp_path), "pp2")
