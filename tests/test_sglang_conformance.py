"""Conformance with SGLang 0.5.23, with SGLang's own code as the oracle (not our embedded engine).

The oracle engine (``tests/sglang_oracle/oracle_engine.py``) is SGLang's HTTP app, request
structs and validation, and per TP rank SGLang's scheduler and model-runner weight updaters
(``init_custom_process_group``, the broadcast receive, ``FlattenedTensorBucket``, the
begin/end session). Reservoir's real ``WeightSender``, ``EngineClient``, rollout manager and
sglang-router talk to it. Needs loopback sockets: run via scripts/run_tests.sh (``unshare -n``).
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from _fixtures_engine import engine_model, engine_url  # noqa: F401
from sglang_oracle import import_sglang, running_oracles
from sglang_protocol import held_weights
from sglang_protocol.client import EngineClient, EngineError
from weight_sync.interfaces import WeightSyncSettings
from weight_sync.sender import WeightSender

ADMIN_KEY = "admin-secret"

try:
    import_sglang()
except ImportError as e:  # scripts/setup_env.sh installs it; a missing SGLang must not pass silently
    raise RuntimeError(f"SGLang's wheel is needed for the conformance tier (scripts/setup_env.sh): {e}") from e


@pytest.fixture(scope="module")
def oracles(toy_model_dir, tmp_path_factory):
    """Three SGLang oracle engines started in parallel: TP=2 (allowing the held-weights loader, as
    the engines a run starts do), TP=1 with an admin API key, and TP=1 as SGLang before 0.5.22 (no
    session routes)."""
    with running_oracles(toy_model_dir, tmp_path_factory.mktemp("oracle"),
                         {"tp2": (2, ("--custom-weight-loader", held_weights.LOADER)), "keyed": (1, ("--admin-api-key", ADMIN_KEY)),
                          "old": (1, ("--without-session-routes",))}) as urls:
        yield urls


def _get(url: str, path: str, key: str | None = None):
    async def go():
        async with EngineClient(url, timeout=60, admin_api_key=key) as c:
            return await c.request("GET", path)
    return asyncio.run(go())


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    """A push with two dtypes (bf16 and fp32), odd sizes and more tensors than one bucket holds."""
    g = torch.Generator().manual_seed(seed)
    out = [(f"model.layers.{i}.mlp.weight", torch.randn(7, 5, generator=g).bfloat16()) for i in range(4)]
    out += [("model.norm.weight", torch.randn(5, generator=g)),
            ("lm_head.weight", torch.randn(3, 5, generator=g).bfloat16())]
    return out


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _assert_received(rank: dict, named: list[tuple[str, torch.Tensor]]) -> None:
    got = rank["tensors"]
    for n, t in named:
        assert n in got, f"{n} never reached SGLang's load_weights"
        assert got[n]["dtype"] == str(t.dtype).removeprefix("torch.") and got[n]["shape"] == list(t.shape)
        assert got[n]["sha256"] == _sha(t), f"{n}: received bytes differ from the trainer's"


def _settings(**kw) -> WeightSyncSettings:
    return WeightSyncSettings(backend="gloo", timeout_s=60, bucket_bytes=160, **kw)


@pytest.mark.parametrize("load_format", ["flattened_bucket", "tensor"])
def test_push_into_sglang_tp2_arrives_bitwise_on_both_ranks(oracles, load_format):
    """SGLang's own join (rank = rank_offset + tp_rank) meets ours; each TP rank receives every
    tensor bitwise, through SGLang's receive (FlattenedTensorBucket for flattened buckets), inside
    a begin/end session; the version is recorded by the bucket that completes it."""
    url = oracles["tp2"]
    named = _weights(1 if load_format == "tensor" else 2)
    version = 3 if load_format == "tensor" else 4
    n0 = len(_get(url, "/oracle/requests")["control"])
    with WeightSender(_settings(load_format=load_format)) as sender:
        sender.connect([url], engine_gpus=[2])
        m = sender.push(named, version=version)
    assert m["weight_sync/num_buckets"] >= 3 and m["weight_sync/attempts"] == 1
    ranks = _get(url, "/oracle/received")["ranks"]
    assert len(ranks) == 2
    for r in ranks:
        _assert_received(r, named)
        assert r["versions"][-1] == str(version)
    info = _get(url, "/model_info")
    assert info["weight_version"] == str(version)
    push = _get(url, "/oracle/requests")["control"][n0:]
    assert push[:3] == ["init_weights_update_group", "pause_generation", "begin_weight_update"]
    push = push[1:]
    assert set(push[2:-3]) == {"update_weights_from_distributed"} and len(push[2:-3]) == m["weight_sync/num_buckets"]
    assert push[-3:-1] == ["end_weight_update", "continue_generation"]
    assert push[-1] == "destroy_weights_update_group"  # the sender left the group when closed


def test_a_tp1_and_a_tp2_engine_in_one_group(oracles):
    """Two engines of 1 and 2 GPUs: world size 4, rank offsets 1 and 2, both receive."""
    named = _weights(5)
    s = _settings(admin_api_key=ADMIN_KEY) if "admin_api_key" in WeightSyncSettings.__dataclass_fields__ \
        else None
    if s is None:
        pytest.skip("WeightSyncSettings has no admin_api_key yet")
    with WeightSender(s) as sender:
        sender.connect([oracles["keyed"], oracles["tp2"]], engine_gpus=[1, 2])
        sender.push(named, version=6)
    for url, n in ((oracles["keyed"], 1), (oracles["tp2"], 2)):
        ranks = _get(url, "/oracle/received", ADMIN_KEY)["ranks"]
        assert len(ranks) == n
        for r in ranks:
            _assert_received(r, named)


def test_older_sglang_without_session_routes(oracles):
    """SGLang before 0.5.22 has no begin/end routes: the 404 means no session is needed."""
    url = oracles["old"]
    named = _weights(7)

    async def probe():
        async with EngineClient(url, timeout=30) as c:
            return await c.begin_weight_update(), await c.end_weight_update()
    assert asyncio.run(probe()) == (False, False)
    with WeightSender(_settings()) as sender:
        sender.connect([url])
        sender.push(named, version=2)
    _assert_received(_get(url, "/oracle/received")["ranks"][0], named)


def test_a_failed_push_closes_the_session_and_the_retry_succeeds(oracles, monkeypatch):
    """SGLang refuses the first bucket (a negative dimension in its metadata, as
    FlattenedTensorBucket refuses it); the sender closes the session on the engine, rebuilds the
    group and redoes the push, whose begin_weight_update would fail if the session were open."""
    from weight_sync import plan

    url = oracles["tp2"]
    named = _weights(9)
    real = plan.Bucket.payload
    calls = {"n": 0}

    def payload(self):
        p = real(self)
        calls["n"] += 1
        if calls["n"] == 1:
            p["shapes"] = [[-1, *s[1:]] if i == 0 else s for i, s in enumerate(p["shapes"])]
        return p
    monkeypatch.setattr(plan.Bucket, "payload", payload)
    n0 = len(_get(url, "/oracle/requests")["control"])
    with WeightSender(_settings()) as sender:
        sender.connect([url], engine_gpus=[2])
        m = sender.push(named, version=11)
    assert m["weight_sync/attempts"] == 2
    for r in _get(url, "/oracle/received")["ranks"]:
        _assert_received(r, named)
    control = _get(url, "/oracle/requests")["control"][n0:]
    begins = [i for i, op in enumerate(control) if op == "begin_weight_update"]
    assert len(begins) == 2 and "end_weight_update" in control[begins[0]:begins[1]]


def test_control_calls_pass_sglang_parsing_and_admin_auth(oracles):
    """Every control call the client makes is accepted by SGLang's routes (its request structs
    built from our bodies), with the admin key that SGLang requires once one is set; without the
    key SGLang answers 401, so the key really is sent."""
    url = oracles["keyed"]

    async def go():
        async with EngineClient(url, timeout=60, admin_api_key=ADMIN_KEY) as c:
            for mode in ("abort", "retract", "in_place"):
                await c.pause_generation(mode)
                await c.continue_generation()
            await c.flush_cache()
            await c.abort_request(rid="some-rid")
            await c.abort_request(abort_all=True)
            out = await c.update_weights_from_disk("/tmp/ckpt", weight_version="12")
            version = await c.get_weight_version()
            info = await c.server_info()
        async with EngineClient(url, timeout=60) as anonymous:
            with pytest.raises(EngineError) as e:
                await anonymous.pause_generation("abort")
            health = await anonymous.health()
        return out, version, info, e.value.status, health
    out, version, info, status, health = asyncio.run(go())
    assert out["success"] and version == "12" and info["tp_size"] == 1
    assert status == 401 and health


def test_rollout_requests_pass_sglang_validation_through_the_router(oracles, toy_model_dir):
    """The rollout's /generate bodies, per sample and per group (SGLang's batch form), sent
    through the real sglang-router and directly, are accepted by SGLang's own parsing and
    checks (normalize_batch_and_arguments, SamplingParams.normalize/verify): no sample fails."""
    from _fixtures_rollout import running_manager, toy_argv

    url = oracles["keyed"]
    before = len(_get(url, "/oracle/requests", ADMIN_KEY)["generate"])

    async def go():
        out = {}
        for granularity, dispatch in (("group", "router"), ("sample", "router"), ("group", "direct")):
            argv = toy_argv(toy_model_dir, "--engine-urls", url, "--n-samples-per-prompt", "3",
                            "--rollout-batch-size", "2", "--rollout-max-response-len", "4",
                            "--rollout-top-p", "0.9", "--rollout-request-granularity", granularity,
                            "--rollout-dispatch", dispatch)
            async with running_manager(argv) as m:
                out[(granularity, dispatch)] = await m.generate(0)
        return out
    out = asyncio.run(go())
    for key, (groups, metrics) in out.items():
        samples = [s for g in groups for s in g]
        assert len(samples) == 6, key
        assert all(s.status.value in ("completed", "truncated") for s in samples), \
            (key, [(s.status, s.metadata) for s in samples])
        assert all(s.response_length == 4 and len(s.rollout_log_probs) == 4 for s in samples), key
    seen = _get(url, "/oracle/requests", ADMIN_KEY)["generate"][before:]
    assert len(seen) == 3 * 6  # every sample's request reached SGLang's parser, as the router forwards it
    assert all(r["sampling_params"]["top_p"] == 0.9 and r["return_logprob"] for r in seen)


# (method, path, body): valid and invalid calls; the embedded engine must answer each with the
# same class of status (2xx / 4xx) as SGLang's own app does.
_DIFFERENTIAL = [
    ("POST", "/pause_generation", {"mode": "abort"}), ("POST", "/pause_generation", {"mode": "bogus"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/update_weights_from_distributed",
     {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"}),
    ("POST", "/begin_weight_update", {}), ("POST", "/begin_weight_update", {}),
    ("POST", "/end_weight_update", {}), ("POST", "/end_weight_update", {}),
    ("POST", "/destroy_weights_update_group", {"group_name": "nope"}),
    ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1"}),
    ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}),
    ("POST", "/generate", {"input_ids": [[1, 2], [3]], "rid": "b", "sampling_params": {"max_new_tokens": 2},
                           "return_logprob": True}),
    ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": -1}}),
    ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "top_p": 0}}),
    ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "top_k": 0}}),
    ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "min_p": 2}}),
    ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}),
    ("POST", "/generate", {"sampling_params": {"max_new_tokens": 2}}),
    # slime's on-policy distillation teacher query (slime/rollout/on_policy_distillation.py)
    ("POST", "/generate", {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 0,
                           "sampling_params": {"max_new_tokens": 0, "temperature": 1.0, "skip_special_tokens": False}}),
    ("POST", "/abort_request", {"rid": "nobody"}),
    ("GET", "/model_info", None), ("GET", "/get_weight_version", None),
    ("POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 4}),
    ("POST", "/get_weights_by_name", {"name": "model.no_such.weight"}),
    ("POST", "/get_weights_by_name", {"truncate_size": 4}),
]


def test_embedded_engine_answers_like_sglang(oracles, engine_url):
    """The embedded engine is a stand-in for SGLang in CPU runs: the same calls, valid and invalid,
    get the same class of answer from it as from SGLang's own HTTP app."""
    async def statuses(url: str) -> list[int]:
        out = []
        async with EngineClient(url, timeout=60, admin_api_key=ADMIN_KEY) as c:
            for method, path, body in _DIFFERENTIAL:
                try:
                    await c.request(method, path, body, admin=True)
                    out.append(200)
                except EngineError as e:
                    out.append(e.status or 0)
        return out
    sglang, ours = asyncio.run(statuses(oracles["keyed"])), asyncio.run(statuses(engine_url))
    assert sum(s // 100 == 2 for s in sglang) >= 6 and sum(s // 100 == 4 for s in sglang) >= 8, sglang
    differ = [(call[:2], call[2], s, o) for call, s, o in zip(_DIFFERENTIAL, sglang, ours) if s // 100 != o // 100]
    assert not differ, f"(call, body, SGLang's status, ours): {differ}"

    async def read_back(url: str) -> list:  # the same shape of answer (the two serve different models)
        async with EngineClient(url, timeout=60, admin_api_key=ADMIN_KEY) as c:
            return await c.request("POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 4},
                                   admin=True)
    rows = [asyncio.run(read_back(u)) for u in (oracles["keyed"], engine_url)]
    assert [len(r) for r in rows] == [4, 4] and all(isinstance(x, float) for r in rows for x in r), rows


def test_prompt_log_probs_are_laid_out_as_sglangs_scheduler_lays_them_out(engine_url, engine_model):
    """``input_token_logprobs`` of a prompt-only request (slime's teacher query): SGLang's own
    ``SchedulerLogprobResultProcessor._process_input_token_logprobs`` turns the forward's log-probs
    (position ``logprob_start_len`` on, the last one the sampling position's) into the values and
    token ids of the answer; the embedded engine's answer has those values (1e-5: a forward here
    against the engine's) and exactly those ids, for each ``logprob_start_len``."""
    from types import SimpleNamespace

    from _fixtures_engine import hf_model
    from sglang.srt.managers.scheduler_components.logprob_result_processor import SchedulerLogprobResultProcessor

    ids = [1, 6, 9, 30, 12, 44, 7]
    model = hf_model(engine_model)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)  # [L, V]
    forward = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist() + [0.0]  # + the sampling position
    processor = SchedulerLogprobResultProcessor(model_config=SimpleNamespace(vocab_size=model.config.vocab_size))

    async def ask(start: int) -> dict:
        async with EngineClient(engine_url, timeout=60) as c:
            return await c.request("POST", "/generate", {
                "input_ids": ids, "return_logprob": True, "logprob_start_len": start,
                "sampling_params": {"max_new_tokens": 0}})

    for start in (0, 3, len(ids) - 1):
        req = SimpleNamespace(logprob=SimpleNamespace(), origin_input_ids=ids, logprob_start_len=start,
                              is_prefill_only=False)
        processor._process_input_token_logprobs(req, forward[start:])
        ours = asyncio.run(ask(start))["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in ours] == req.logprob.input_token_logprobs_idx
        want = req.logprob.input_token_logprobs_val
        assert len(ours) == len(want) and ours[0][0] is None and want[0] is None
        assert max((abs(a - b) for (a, _, _), b in zip(ours[1:], want[1:])), default=0.0) <= 1e-5


@pytest.mark.parametrize("pause_mode", ["abort", "retract", "in_place"])
def test_flush_only_on_the_last_bucket_and_only_after_an_abort(oracles, pause_mode):
    """A flush needs an idle engine: ``in_place`` keeps the requests running and ``retract`` puts them
    back in the waiting queue (SGLang 0.5.15 then fails an assertion in its scheduler and the server
    ends: seen on the GPU tier). So only an ``abort`` pause flushes, on the version's last bucket."""
    url = oracles["tp2"]
    n0 = len(_get(url, "/oracle/requests")["distributed_updates"])
    with WeightSender(_settings(pause_mode=pause_mode)) as sender:
        sender.connect([url], engine_gpus=[2])
        m = sender.push(_weights(13), version=14)
    updates = _get(url, "/oracle/requests")["distributed_updates"][n0:]
    assert len(updates) == m["weight_sync/num_buckets"] >= 3
    assert [u["flush_cache"] for u in updates] == [False] * (len(updates) - 1) + [pause_mode == "abort"]
    assert [u["weight_version"] for u in updates] == [None] * (len(updates) - 1) + ["14"]


def test_a_restarted_trainer_joins_while_the_old_group_is_still_open(oracles):
    """Engines given by --engine-urls outlive a trainer: a new trainer's group must not take the
    name of one the engine still holds (SGLang refuses a second group of the same name)."""
    url = oracles["tp2"]
    old = WeightSender(_settings())
    try:
        old.connect([url], engine_gpus=[2])  # never closed before the "restart": its group stays open
        with WeightSender(_settings()) as new:
            new.connect([url], engine_gpus=[2])
            new.push(_weights(15), version=16)
    finally:
        old.close()
    for r in _get(url, "/oracle/received")["ranks"]:
        _assert_received(r, _weights(15))


def test_a_trainer_that_died_inside_a_push_leaves_nothing_the_next_one_trips_on(oracles, caplog):
    """Issue 16: a trainer killed inside a push leaves engines given by --engine-urls paused with a
    weight-update session open, and SGLang refuses the next ``begin_weight_update`` while it is.
    The next trainer's first push, refused at its begin for that reason, closes the stale session
    and begins again, so it succeeds at the first attempt (no retries allowed here) and generation
    continues."""
    url = oracles["tp2"]

    async def die_inside_a_push():  # what the dead trainer's sender got done: pause, then begin
        async with EngineClient(url, timeout=30) as c:
            await c.pause_generation("abort")
            assert await c.begin_weight_update()
    asyncio.run(die_inside_a_push())
    n0 = len(_get(url, "/oracle/requests")["control"])
    with caplog.at_level("WARNING", logger="weight_sync.sender"):
        with WeightSender(_settings(retries=0)) as sender:
            sender.connect([url], engine_gpus=[2])
            m = sender.push(_weights(21), version=22)
    assert m["weight_sync/attempts"] == 1
    assert any("had a weight-update session open" in r.getMessage() for r in caplog.records)
    control = _get(url, "/oracle/requests")["control"][n0:]
    begins = [i for i, op in enumerate(control) if op == "begin_weight_update"]
    assert len(begins) == 2 and control[begins[0] + 1:begins[1]] == ["end_weight_update"]
    assert "continue_generation" in control[begins[1]:]
    for r in _get(url, "/oracle/received")["ranks"]:
        _assert_received(r, _weights(21))


def test_connect_learns_gpu_counts_and_the_check_reads_back_through_sglang(oracles):
    """``connect`` without GPU counts reads each engine's ``/server_info`` (SGLang's ``ServerArgs``:
    TP=2 joins as two ranks); ``--check-weight-update-equal`` against a server without
    ``/weights_checksum`` reads every pushed tensor back through SGLang's ``/get_weights_by_name``
    route, scheduler handler, TP worker and weight exporter, compares it with the trainer's (bf16
    and fp32 tensors, as pushed) and names a tensor that differs."""
    from weight_sync.engines import check_equal

    named = _weights(9)
    with WeightSender(_settings(admin_api_key=ADMIN_KEY, check_equal=True)) as sender:
        sender.connect([oracles["keyed"], oracles["tp2"]])
        assert [e.gpus for e in sender.engines] == [1, 2]
        assert [e.check for e in sender.engines] == ["readback", "readback"]
        m = sender.push(named, version=12)
        assert m["weight_sync/check_s"] > 0 and m["weight_sync/attempts"] == 1
        changed = [(n, t.clone()) for n, t in named]
        changed[4][1][2] += 1.0  # model.norm.weight, fp32
        with pytest.raises(RuntimeError, match="weight 'model.norm.weight' differs on engine .*1 of 5 elements"):
            sender._loop.run(check_equal(sender.engines, changed, 60.0), timeout=120)


def test_the_check_is_refused_where_sglang_cannot_read_weights_back(oracles, monkeypatch):
    """A model SGLang cannot read back (its ``/get_weights_by_name`` fails, as for Qwen2 in 0.5.15)
    is refused at connect, naming the flag, before any engine is paused."""
    import weight_sync.engines as engines

    monkeypatch.setattr(engines, "_PROBE", "model.no_such.weight")
    with WeightSender(_settings(check_equal=True)) as sender:
        with pytest.raises(ValueError, match="--check-weight-update-equal: engine .* cannot read its weights back"):
            sender.connect([oracles["old"]])


def _received(url: str) -> list[dict]:
    return _get(url, "/oracle/received")["ranks"]


def test_delta_pushes_hand_sglangs_load_weights_the_full_tensors(oracles, toy_model_dir):
    """``--update-weight-mode delta``: the sender arms each rank through SGLang's custom-loader path
    (``/update_weights_from_tensor`` to the held-weights loader: ``delta_weights.install``), then
    sends deltas over SGLang's broadcast receive; after every step of a short real training run,
    SGLang's ``load_weights`` must have been handed the full bf16 tensors a full push hands it, on
    both ranks (and the read-back check agrees)."""
    import hashlib

    from tests._fixtures_weight_sync import train_steps

    s = WeightSyncSettings(backend="gloo", timeout_s=60, bucket_bytes=64 * 1024, update_mode="delta", full_every=0,
                           engine_dtype="bfloat16", check_equal=True)
    kinds = []
    with WeightSender(s) as sender:
        sender.connect([oracles["tp2"]])
        for step, model in enumerate(train_steps(toy_model_dir, 4, lr=1e-4), start=1):
            m = sender.push(model.named_parameters(), version=step)
            kinds.append(int(m["weight_sync/delta"]))
            want = {n: hashlib.sha256(p.detach().to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy().tobytes())
                    .hexdigest() for n, p in model.named_parameters()}
            for rank in _received(oracles["tp2"]):
                got = {n: r["sha256"] for n, r in rank["tensors"].items() if n in want}
                assert got == want, f"step {step}: SGLang's load_weights got other values than a full push's"
    assert kinds == [0, 1, 1, 1]
