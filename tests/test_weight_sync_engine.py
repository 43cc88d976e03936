"""WeightSender against real embedded engines (separate processes, gloo, real HTTP).

Run under a loopback-only namespace: ``unshare -n bash -c 'ip link set lo up && exec pytest -q ...'``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from sglang_protocol.client import EngineClient
from tests._fixtures_weight_sync import perturbed_model, start_engines, stop_engines, ws_toy_model  # noqa: F401
from weight_sync.interfaces import WeightSyncSettings
from weight_sync.sender import WeightSender


def _run(coro_fn, url: str, timeout: float = 60):
    async def main():
        async with EngineClient(url, timeout=timeout) as c:
            return await coro_fn(c)
    return asyncio.run(main())


def _version(url: str) -> str:
    return _run(lambda c: c.get_weight_version(), url)


def _request_held(url: str, sent: threading.Thread) -> bool:
    """Whether the paused engine holds the request ``sent`` makes: once it is queued there, the
    scheduler thread runs two commands (checksum reads) and the request is still unanswered."""
    async def check(c: EngineClient) -> bool:
        deadline = time.monotonic() + 30
        while (await c.request("GET", "/get_load"))[0]["num_waiting_reqs"] < 1:
            assert time.monotonic() < deadline, "the request never reached the engine"
            await asyncio.sleep(0.002)
        for _ in range(2):
            await c.request("POST", "/weights_checksum", {"names": ["model.norm.weight"]})
        return sent.is_alive()
    # progress is called on the sender's event loop: the check runs its own loop in a thread
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_run, check, url).result()


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    """The disk transport's directory, one the engines are started to allow (docs/security.md)."""
    return tmp_path_factory.mktemp("disk_pushes")


@pytest.fixture(scope="module")
def procs(ws_toy_model, disk_dir):  # noqa: F811
    """Two engines for the whole module, as a mutable list of (Popen, url): the failure tests at
    the end kill, restart and stop them (starting engines is the slow part of these tests)."""
    es = start_engines(ws_toy_model, 2, weight_update_dirs=str(disk_dir))
    yield es
    stop_engines(es)


@pytest.fixture
def engines(procs):
    return [u for _, u in procs]


def test_push_lands_everywhere_and_serves_the_new_weights(engines, ws_toy_model):  # noqa: F811
    tok = AutoTokenizer.from_pretrained(ws_toy_model)
    prompt = tok.apply_chat_template([{"role": "user", "content": "12+7="}], add_generation_prompt=True,
                                     tokenize=False)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    new = perturbed_model(ws_toy_model, 1.5)
    with torch.no_grad():
        ref = new.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    greedy = {"max_new_tokens": 8, "temperature": 0.0}
    # A request sent while the push is under way waits for it (engines are paused), then runs
    # entirely on the new weights: no response mixes two versions.
    during: dict = {}
    sent = threading.Thread(target=lambda: during.update(_run(lambda c: c.generate(input_ids=ids,
                                                                                    sampling_params=greedy),
                                                               engines[0])))
    held = []

    def progress(done: int, total: int) -> None:
        if done == 1:
            sent.start()
        if done == total - 1:
            held.append(_request_held(engines[0], sent))

    recorded = []
    s = WeightSyncSettings(bucket_bytes=64 * 1024, check_equal=True, timeout_s=30)
    with WeightSender(s, version_sink=recorded.append) as sender:
        sender.connect(engines)
        m = sender.push(new.named_parameters(), version=1, progress=progress)
        sent.join(30)
        assert held == [True]
        assert during["meta_info"]["weight_version"] == "1" and during["output_ids"] == ref[:len(during["output_ids"])]
        assert m["weight_sync/num_buckets"] > 1 and m["weight_sync/engines"] == 2
        assert m["weight_sync/attempts"] == 1 and m["weight_sync/check_s"] > 0
        assert m["weight_sync/time_s"] > 0 and m["weight_sync/gib_per_s"] > 0
        assert recorded == [1]
        assert [_version(u) for u in engines] == ["1", "1"]
        # Greedy generation on every engine now equals transformers on the pushed weights.
        for u in engines:
            out = _run(lambda c: c.generate(input_ids=ids, sampling_params=greedy), u)
            assert out["output_ids"] == ref[:len(out["output_ids"])] and out["output_ids"]
            assert out["meta_info"]["weight_version"] == "1"
        # A retried push of the same version is safe; an older one is refused.
        sender.push(new.named_parameters(), version=1)
        with pytest.raises(ValueError, match="version 0"):
            sender.push(new.named_parameters(), version=0)
        # Tensor-by-tensor format lands the same values.
        sender.settings.load_format = "tensor"
        newer = perturbed_model(ws_toy_model, 0.5)
        assert sender.push(newer.named_parameters(), version=2)["weight_sync/check_s"] > 0
    assert [_version(u) for u in engines] == ["2", "2"]


def test_mismatch_is_refused_before_anything_is_sent(engines, ws_toy_model):  # noqa: F811
    new = perturbed_model(ws_toy_model, 2.0)
    good = list(new.named_parameters())
    with WeightSender(WeightSyncSettings(check_equal=True, timeout_s=30)) as sender:
        sender.connect(engines)
        before = [_version(u) for u in engines]
        name0 = good[0][0]
        cases = [([(good[0][0], good[0][1][:-1])] + good[1:], rf"{name0}.*shape"),
                 ([(good[0][0], good[0][1].long())] + good[1:], rf"{name0}.*dtype int64"),  # floats are cast
                 (good + [("model.extra.weight", torch.zeros(2))], "model.extra.weight.*no parameter"),
                 (good[1:], rf"{name0}.*does not include"),
                 (good + [good[0]], rf"{name0}.*twice")]
        for named, pattern in cases:
            with pytest.raises(ValueError, match=pattern):
                sender.push(named, version=7)
        assert [_version(u) for u in engines] == before  # nothing was sent
        assert sender.push(good, version=7)["weight_sync/attempts"] == 1  # the group is still consistent
    assert [_version(u) for u in engines] == ["7", "7"]


def test_connect_errors_leave_the_sender_reusable(engines, ws_toy_model):  # noqa: F811
    from sglang_protocol.net import free_port

    with WeightSender(WeightSyncSettings(timeout_s=5)) as sender:
        with pytest.raises(ValueError, match="engine_urls"):
            sender.connect([])
        with pytest.raises(RuntimeError, match="cannot fetch its parameter list"):
            sender.connect([engines[0], f"http://127.0.0.1:{free_port()}"])  # nothing listens there
        with pytest.raises(RuntimeError, match="not connected"):
            sender.push([("x", torch.zeros(1))], version=1)
        sender.connect(engines)  # a retry after the failure works
        assert sender.push(perturbed_model(ws_toy_model, 1.0).named_parameters(), 3)["weight_sync/engines"] == 2


def test_disk_transport(engines, ws_toy_model, disk_dir):  # noqa: F811
    new = perturbed_model(ws_toy_model, 0.9)
    s = WeightSyncSettings(transport="disk", disk_dir=str(disk_dir / "ckpts"), hf_checkpoint=str(ws_toy_model),
                           check_equal=True, timeout_s=60)
    with WeightSender(s) as sender:
        sender.connect(engines)
        m = sender.push(new.named_parameters(), version=11)
        assert m["weight_sync/check_s"] > 0 and m["weight_sync/engines"] == 2
    assert [_version(u) for u in engines] == ["11", "11"]
    assert (disk_dir / "ckpts" / "weights_v11" / "config.json").exists()


def test_engine_killed_mid_push_then_resynced(procs, ws_toy_model, disk_dir):  # noqa: F811
    es = procs
    urls = [u for _, u in es]
    s = WeightSyncSettings(bucket_bytes=32 * 1024, check_equal=True, timeout_s=20)
    with WeightSender(s) as sender:
        sender.connect(urls)
        w1 = perturbed_model(ws_toy_model, 1.25)

        def kill_after_first(done: int, total: int) -> None:
            if done == 1 and es[1][0].poll() is None:
                es[1][0].kill()
                es[1][0].wait()

        t = time.monotonic()
        m = sender.push(w1.named_parameters(), version=1, progress=kill_after_first)
        assert time.monotonic() - t < s.timeout_s
        assert m["weight_sync/attempts"] == 2 and m["weight_sync/engines"] == 1  # redone on the survivor
        st = sender.engine_status()
        assert st[urls[0]]["alive"] and st[urls[0]]["version"] == 1
        assert not st[urls[1]]["alive"] and st[urls[1]]["version"] is None
        assert _version(urls[0]) == "1"
        # The dead engine comes back (same address) and is re-synced to the current version.
        port = int(urls[1].rsplit(":", 1)[1])
        es[1] = start_engines(ws_toy_model, 1, ports=[port], weight_update_dirs=str(disk_dir))[0]
        assert sender.resync(urls[1], w1.named_parameters())["weight_sync/resync_s"] > 0
        assert _version(urls[1]) == "1" and sender.engine_status()[urls[1]]["alive"]
        # Next push goes to both through a rebuilt group.
        w2 = perturbed_model(ws_toy_model, 0.75)
        m = sender.push(w2.named_parameters(), version=2)
        assert m["weight_sync/engines"] == 2 and m["weight_sync/attempts"] == 1
    assert [_version(u) for u in urls] == ["2", "2"]


def test_stalled_engine_does_not_hang_the_trainer(procs, ws_toy_model):  # noqa: F811
    es = procs  # the last test of the module: it leaves no engine running
    urls = [u for _, u in es]
    s = WeightSyncSettings(bucket_bytes=32 * 1024, timeout_s=5.0, retries=1)
    with WeightSender(s) as sender:
        sender.connect(urls)
        w = perturbed_model(ws_toy_model, 1.1)

        def stop_after_first(done: int, total: int) -> None:
            if done == 1:
                os.kill(es[1][0].pid, signal.SIGSTOP)  # alive but unresponsive

        t = time.monotonic()
        m = sender.push(w.named_parameters(), version=1, progress=stop_after_first)
        elapsed = time.monotonic() - t
        assert elapsed < 6 * s.timeout_s, elapsed
        assert m["weight_sync/attempts"] == 2 and m["weight_sync/engines"] == 1
        assert not sender.engine_status()[urls[1]]["alive"]
        assert _version(urls[0]) == "1"
        # It answers again: the next push takes it back by itself, both end at the same version.
        os.kill(es[1][0].pid, signal.SIGCONT)
        m = sender.push(w.named_parameters(), version=2)
        assert m["weight_sync/revived"] == 1 and m["weight_sync/engines"] == 2
        assert [_version(u) for u in urls] == ["2", "2"]
        os.kill(es[1][0].pid, signal.SIGKILL)
        es[1][0].wait()
        # With every engine gone, a push fails within the bound instead of hanging.
        es[0][0].kill()
        es[0][0].wait()
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="push v3"):
            sender.push(w.named_parameters(), version=3)
        assert time.monotonic() - t < 6 * s.timeout_s
