"""Bucket planning, validation against an engine's parameter list, settings and flags."""

from __future__ import annotations

import argparse

import pytest
import torch

from weight_sync.arguments import add_arguments, settings_from_args
from weight_sync.interfaces import TensorSpec, WeightSyncSettings
from weight_sync.plan import check_against_engine, check_tensors, plan_buckets


def _specs(*items):
    return [TensorSpec(n, tuple(s), d) for n, s, d in items]


def test_buckets_respect_size_dtype_and_order():
    specs = _specs(("a", (4, 4), "float32"), ("b", (4,), "float32"), ("c", (8, 8), "float32"),
                   ("d", (2,), "bfloat16"), ("e", (2,), "float32"))
    # 64 + 16 = 80 bytes fit in 100; c (256 B) is larger than a bucket and travels alone.
    bs = plan_buckets(specs, bucket_bytes=100)
    assert [[s.name for s in b.specs] for b in bs] == [["a", "b"], ["c"], ["d"], ["e"]]
    assert [b.dtype for b in bs] == ["float32", "float32", "bfloat16", "float32"]
    assert [b.nbytes for b in bs] == [80, 256, 4, 8]
    assert [i for b in bs for i in b.indices] == list(range(5))  # push order kept
    p = bs[0].payload()
    assert p == {"names": ["a", "b"], "dtypes": ["float32", "float32"], "shapes": [[4, 4], [4]]}


def test_one_bucket_when_everything_fits():
    specs = _specs(*[(f"w{i}", (10,), "float32") for i in range(10)])
    assert len(plan_buckets(specs, 512 * 1024 ** 2)) == 1
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(specs, 0)


def test_check_tensors_names_the_bad_tensor():
    t = torch.zeros(2)
    assert check_tensors([("x", t)]) == [TensorSpec("x", (2,), "float32")]
    with pytest.raises(ValueError, match="'x'.*twice"):
        check_tensors([("x", t), ("x", t)])
    with pytest.raises(ValueError, match="'y'.*torch.Tensor"):
        check_tensors([("y", [1, 2])])
    with pytest.raises(ValueError, match="no tensors"):
        check_tensors([])


def test_check_against_engine_names_the_tensor():
    engine = {s.name: s for s in _specs(("a", (2, 3), "bfloat16"), ("b", (3,), "bfloat16"))}
    ok = _specs(("a", (2, 3), "bfloat16"), ("b", (3,), "bfloat16"))
    check_against_engine(ok, engine, "http://e0")
    with pytest.raises(ValueError, match=r"'a'.*shape \[3, 2\].*\[2, 3\]"):
        check_against_engine(_specs(("a", (3, 2), "bfloat16"), ("b", (3,), "bfloat16")), engine, "http://e0")
    check_against_engine(_specs(("a", (2, 3), "bfloat16"), ("b", (3,), "float32")), engine, "http://e0")  # cast at push
    with pytest.raises(ValueError, match="'b'.*dtype int64.*bfloat16"):
        check_against_engine(_specs(("a", (2, 3), "bfloat16"), ("b", (3,), "int64")), engine, "http://e0")
    with pytest.raises(ValueError, match="'zzz'.*no parameter"):
        check_against_engine(ok + _specs(("zzz", (1,), "bfloat16")), engine, "http://e0")
    with pytest.raises(ValueError, match="'b'.*does not include"):
        check_against_engine(ok[:1], engine, "http://e0")


def test_settings_validate_names_the_field():
    WeightSyncSettings().validate()
    for kw, field in [({"transport": "rdma"}, "transport"), ({"bucket_bytes": 0}, "bucket_bytes"),
                      ({"backend": "mpi"}, "backend"), ({"transport": "disk"}, "disk_dir"),
                      ({"transport": "disk", "disk_dir": "/x"}, "hf_checkpoint"),
                      ({"timeout_s": 0}, "timeout_s"), ({"load_format": "x"}, "load_format")]:
        with pytest.raises(ValueError, match=field):
            WeightSyncSettings(**kw).validate()


def test_flags_roundtrip_and_errors_name_the_flag():
    p = argparse.ArgumentParser()
    add_arguments(p)
    p.add_argument("--hf-checkpoint", default=None)  # the rollout manager's flag
    s = settings_from_args(p.parse_args([]))
    assert s == WeightSyncSettings()  # defaults come from the dataclass
    s = settings_from_args(p.parse_args(["--update-weight-transport", "disk", "--update-weight-disk-dir", "/x",
                                         "--update-weight-buffer-size", "1024", "--check-weight-update-equal",
                                         "--hf-checkpoint", "/m"]))
    assert (s.transport, s.disk_dir, s.bucket_bytes, s.check_equal, s.hf_checkpoint) == ("disk", "/x", 1024, True, "/m")
    with pytest.raises(ValueError, match="--update-weight-disk-dir"):
        settings_from_args(p.parse_args(["--update-weight-transport", "disk"]))
    with pytest.raises(ValueError, match="--hf-checkpoint"):
        settings_from_args(p.parse_args(["--update-weight-transport", "disk", "--update-weight-disk-dir", "/x"]))
    with pytest.raises(ValueError, match="--update-weight-buffer-size"):
        settings_from_args(p.parse_args(["--update-weight-buffer-size", "-1"]))
