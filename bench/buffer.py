"""Put+get throughput of the buffer actor against a bare Ray actor passing the same bytes.

Groups of 8 samples with 1k-token responses (tokens, log-probs, loss masks), pushed and pulled
through (a) a bare Ray actor that only keeps a deque, (b) the buffer actor in memory, (c) the
buffer actor persisting to a directory (Arrow segments, no fsync), and (d) with fsync (reported,
not a target). Trials alternate between the variants; we report medians of groups/s.
Targets: (b)/(a) >= 0.8, (c)/(a) >= 0.5.

Run (loopback-only network namespace, as all Ray code here):
    unshare -n bash -c 'ip link set lo up && exec python bench/buffer.py'
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from buffer import BufferSettings, Sample, Status, create_buffer  # noqa: E402

TARGET_MEMORY, TARGET_PERSIST = 0.8, 0.5


@ray.remote(num_cpus=0)
class BareActor:
    """The ceiling: a Ray actor that stores and returns the same objects, doing nothing else."""

    def __init__(self) -> None:
        self.q: collections.deque = collections.deque()

    def put(self, groups: list) -> int:
        self.q.extend(groups)
        return len(groups)

    def get(self, n: int) -> list:
        return [self.q.popleft() for _ in range(n)]


def make_groups(count: int, n: int, prompt_len: int, response_len: int, seed: int) -> list[list[Sample]]:
    rng = random.Random(seed)
    groups = []
    for g in range(count):
        groups.append([Sample(
            group_index=g, index=g * n + i, prompt="What is 12 + 30? " * 4, label="42",
            tokens=[rng.randrange(32000) for _ in range(prompt_len + response_len)],
            response="x" * response_len, response_length=response_len, loss_mask=[1] * response_len,
            rollout_log_probs=[-rng.random() for _ in range(response_len)], reward=float(rng.random() > 0.5),
            status=Status.COMPLETED, weight_versions=[0]) for i in range(n)])
    return groups


def run_trial(handle, batches: list[list[list[Sample]]], groups_per_put: int) -> float:
    """Put every batch and get it back; returns groups/s."""
    t0 = time.perf_counter()
    for batch in batches:
        ray.get(handle.put.remote(batch))
        got = ray.get(handle.get.remote(groups_per_put))
        assert len(got) == groups_per_put
    return len(batches) * groups_per_put / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--samples-per-group", type=int, default=8)
    p.add_argument("--response-len", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--groups-per-put", type=int, default=4)
    p.add_argument("--puts-per-trial", type=int, default=25)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "buffer.json"))
    args = p.parse_args(argv)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    tmp = tempfile.TemporaryDirectory(prefix="bench-buffer-")
    try:
        groups = make_groups(args.puts_per_trial * args.groups_per_put, args.samples_per_group, args.prompt_len,
                             args.response_len, seed=0)
        batches = [groups[i:i + args.groups_per_put] for i in range(0, len(groups), args.groups_per_put)]
        n = args.samples_per_group
        variants = {
            "bare_actor": BareActor.remote(),
            "buffer_memory": create_buffer("bench-mem", BufferSettings(n_samples_per_prompt=n)),
            "buffer_persist": create_buffer("bench-disk", BufferSettings(
                n_samples_per_prompt=n, persist_dir=str(Path(tmp.name) / "disk"))),
            "buffer_persist_fsync": create_buffer("bench-fsync", BufferSettings(
                n_samples_per_prompt=n, persist_dir=str(Path(tmp.name) / "fsync"), fsync=True)),
        }
        rates: dict[str, list[float]] = {k: [] for k in variants}
        for h in variants.values():  # warm-up: worker imports, first object-store transfers
            run_trial(h, batches[:3], args.groups_per_put)
        for _ in range(args.trials):
            for k, h in variants.items():  # interleaved, so machine noise hits every variant alike
                rates[k].append(run_trial(h, batches, args.groups_per_put))
        disk = ray.get(variants["buffer_persist"].metrics.remote())["bytes_on_disk"]
    finally:
        ray.shutdown()
        tmp.cleanup()

    med = {k: statistics.median(v) for k, v in rates.items()}
    base = med["bare_actor"]
    group_mb = sum(4 * len(s.tokens) + 12 * s.response_length for s in groups[0]) / 1e6  # int32/float64/int32
    metrics = {
        "groups_per_s": {k: round(v, 1) for k, v in med.items()},
        "ratio_memory": round(med["buffer_memory"] / base, 3),
        "ratio_persist": round(med["buffer_persist"] / base, 3),
        "ratio_persist_fsync": round(med["buffer_persist_fsync"] / base, 3),
        "trials_groups_per_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "group_payload_mb": round(group_mb, 3),
        "bytes_on_disk_after_run": disk,
        "config": vars(args) | {"out": None},
    }
    result = {
        "name": "buffer", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "command": "unshare -n bash -c 'ip link set lo up && exec python bench/buffer.py'",
        "metrics": metrics | {"target_persist": TARGET_PERSIST}, "ratio": metrics["ratio_memory"],
        "target": TARGET_MEMORY,
    }
    print(f"{'variant':<24}{'groups/s (median)':>20}{'ratio':>10}")
    for k, v in med.items():
        print(f"{k:<24}{v:>20.1f}{v / base:>10.3f}")
    print(f"targets: buffer_memory >= {TARGET_MEMORY}, buffer_persist >= {TARGET_PERSIST} of bare_actor")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
