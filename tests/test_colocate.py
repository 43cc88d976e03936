"""``--colocate`` (issue 13, "One GPU, out of the box"): trainer ranks and engines share the GPUs.

- start-up: what cannot work is refused with a message naming the flags (before any engine starts,
  never after a push paused them), the weight transport ``auto`` is resolved from where the trainer
  and the engines run, colocation's derived defaults (``--rollout-num-gpus``, local placement);
- the memory handoff (``EngineMemory``: pause + ``/release_memory_occupation`` before training,
  ``/resume_memory_occupation`` + continue after the push) against the embedded engine and against
  SGLang's own app and scheduler-side code (``tests/sglang_oracle``), and a push cast to the dtype
  SGLang serves in, received by SGLang's own weight updaters (the cast itself:
  tests/test_weight_sync_cast.py);
- colocated trainer ranks pinned to GPU i (their Ray options);
- the launcher end to end, colocated on the CPU (weights through shared memory, the ``tensor``
  transport) and, marked gpu, on one GPU.

Loopback sockets: run via scripts/run_tests.sh.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _fixtures_buffer import ray_local  # noqa: F401  (fixture)
from _fixtures_engine import engine_model, run, start_engine, stop_process  # noqa: F401
from scripts import arguments
from scripts.arguments import parse_args
from sglang_protocol.client import EngineClient, EngineError
from weight_sync.arguments import Placement, resolve_transport
from weight_sync.engines import EngineMemory
from weight_sync.interfaces import WeightSyncSettings
from weight_sync.sender import WeightSender

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def base(toy_model_dir):
    return ["--hf-checkpoint", str(toy_model_dir), "--prompt-data", str(toy_model_dir / "data/train.jsonl")]


@pytest.fixture()
def gpus(monkeypatch):
    """Pretend this machine shows ``n`` GPUs to the launcher (its start-up checks count them)."""
    def set_(n: int) -> None:
        monkeypatch.setattr(arguments, "_visible_gpus", lambda: n)
    set_(0)
    return set_


# --- start-up --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_gpus,extra,msg", [
    (0, ["--update-weight-transport", "tensor"], "--update-weight-transport tensor hands the engines CUDA IPC "
                                                 "handles (shared-memory files on the CPU), which open only in "
                                                 "processes on the trainer's GPU and host: it needs --colocate"),
    (0, ["--colocate", "--engine-urls", "http://127.0.0.1:1"], "servers given by --engine-urls run elsewhere"),
    (0, ["--colocate", "--max-weight-staleness", "2"], "--colocate needs sync mode"),
    (1, ["--colocate", "--train-device", "cuda", "--rollout-engine-placement", "ray"],
     "drop --rollout-engine-placement ray"),
    (2, ["--colocate", "--train-device", "cuda", "--rollout-num-gpus", "2"],
     "--colocate: --rollout-num-gpus 2 must equal the trainer's GPUs, --actor-num-nodes x "
     "--actor-num-gpus-per-node = 1"),
    (1, ["--colocate", "--train-device", "cuda:0"], "--colocate with --train-device cuda:0: colocation puts rank i "
                                                    "on engine i's GPU itself; use --train-device cuda"),
    (2, ["--colocate", "--train-device", "cuda", "--actor-num-nodes", "2"], "(--actor-num-nodes 1)"),
    (0, ["--colocate", "--engine-extra-args", "--device cuda"], "--colocate: the trainer (--train-device cpu) and "
                                                                "the engines (cuda"),
    (1, ["--colocate", "--train-device", "cuda", "--update-weight-transport", "distributed",
         "--update-weight-backend", "nccl"],
     "--update-weight-backend nccl: trainer rank 0 and an engine share a GPU (--colocate), and NCCL cannot join "
     "two ranks of one group on one GPU ('Duplicate GPU detected')"),
    (1, ["--train-device", "cuda", "--engine-extra-args", "--device cuda", "--update-weight-backend", "nccl"],
     "share a GPU (--train-device cuda and --engine-extra-args '--device cuda' on a machine with one GPU)"),
    (2, ["--train-device", "cuda:1", "--rollout-num-gpus", "2", "--rollout-engine-placement", "local",
         "--update-weight-backend", "nccl"],
     "share a GPU (--train-device cuda:1 and --rollout-num-gpus 2 placed locally)"),
    (2, ["--train-device", "cuda", "--update-weight-backend", "nccl"],
     "--update-weight-backend nccl: the engines run on the CPU (--rollout-num-gpus 0"),
    (0, ["--update-weight-backend", "nccl"], "--update-weight-backend nccl: the trainer runs on the CPU"),
    (0, ["--offload-rollout"], "--offload-rollout hands the engines' memory to the trainer ranks on their GPUs: it "
                               "needs --colocate"),
    (0, ["--update-weight-load-format", "mapped"], "--update-weight-load-format mapped hands the engines handles "
                                                   "they keep mapped, which needs --colocate"),
    (1, ["--train-device", "cuda", "--rollout-num-gpus", "1"],
     "the engines (--rollout-num-gpus 1) need 2 GPUs, and this machine has 1: add --colocate"),
])
def test_what_cannot_work_is_refused_at_start_up(base, gpus, n_gpus, extra, msg, capsys):
    gpus(n_gpus)
    with pytest.raises(SystemExit) as e:
        parse_args(base + extra)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("n_gpus,extra,want", [
    (0, [], ("distributed", "gloo")),  # the CPU quickstart
    (0, ["--colocate"], ("tensor", "auto")),  # CPU: shared-memory files
    (1, ["--colocate", "--train-device", "cuda"], ("tensor", "auto")),
    (2, ["--train-device", "cuda", "--rollout-num-gpus", "1"], ("distributed", "nccl")),  # GPUs of their own
    (1, ["--train-device", "cuda"], ("distributed", "gloo")),  # engines on the CPU
    (1, ["--train-device", "cuda", "--engine-extra-args", "--device cuda:0"], ("distributed", "gloo")),  # one GPU
    (1, ["--colocate", "--train-device", "cuda", "--update-weight-transport", "distributed"], ("distributed", "gloo")),
    (1, ["--colocate", "--train-device", "cuda", "--update-weight-transport", "disk", "--update-weight-disk-dir",
         "/tmp/w"], ("disk", "auto")),  # explicit values are kept
    (2, ["--train-device", "cuda", "--engine-urls", "http://127.0.0.1:1"], ("distributed", "nccl")),
    (0, ["--engine-urls", "http://127.0.0.1:1"], ("distributed", "gloo")),
])
def test_transport_auto_follows_where_things_run(base, gpus, n_gpus, extra, want):
    gpus(n_gpus)
    args = parse_args(base + extra)
    assert (args.update_weight_transport, args.update_weight_backend) == want


def test_colocation_derives_the_engines_gpus_and_placement(base, gpus):
    gpus(2)
    args = parse_args(base + ["--colocate", "--train-device", "cuda", "--actor-num-gpus-per-node", "2"])
    assert (args.rollout_num_gpus, args.rollout_engine_placement) == (2, "local")
    args = parse_args(base + ["--colocate"])  # CPU: the engines stay on the CPU
    assert (args.rollout_num_gpus, args.rollout_engine_placement) == (0, "local")
    args = parse_args(base + ["--colocate", "--train-device", "cuda", "--rollout-engine", "sglang",
                              "--sglang-mem-fraction-static", "0.4"])
    assert args.sglang_args == ["--mem-fraction-static", "0.4", "--enable-memory-saver"]  # else release frees nothing
    args = parse_args(base + ["--colocate", "--train-device", "cuda", "--rollout-engine", "sglang",
                              "--sglang-mem-fraction-static", "0.4", "--no-offload-rollout"])
    assert args.sglang_args == ["--mem-fraction-static", "0.4"]  # nothing released: SGLang's allocator as it is


def test_a_mapped_colocated_run_lays_the_torch_trainers_parameters_flat(base, gpus):
    """With --colocate (--update-weight-load-format auto: mapped) the torch trainer is told to keep its
    parameters in one buffer per dtype (one handle per push); otherwise not."""
    from scripts.arguments import parse

    gpus(0)
    assert parse(base + ["--colocate"])[1].train.flat_params  # auto: mapped when colocated
    assert not parse(base + ["--colocate", "--update-weight-load-format", "flattened_bucket"])[1].train.flat_params
    assert not parse(base)[1].train.flat_params


def test_flat_parameters_go_as_one_handle(toy_model_dir):
    """``flatten_parameters``: every parameter a view of one buffer per dtype, the model's output
    unchanged, an optimizer step updating them in place (the buffer stays put); ``held_weights.pack``
    sends that buffer once, and the receiver's ``unpack`` (after torch's pickling through shared
    memory, as on the CPU) gives back every parameter by name, bitwise."""
    from transformers import AutoModelForCausalLM

    from sglang_protocol import held_weights
    from sglang_protocol.tensor_update import deserialize, serialize
    from train_backend.torch_backend import flatten_parameters

    model = AutoModelForCausalLM.from_pretrained(str(toy_model_dir), dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8]])
    before = model(ids).logits.detach()
    flatten_parameters(model)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1 and all(p.storage_offset() * p.element_size() % 256 == 0 for p in model.parameters())
    assert torch.equal(model(ids).logits, before)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(ids).logits.sum().backward()
    opt.step()
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} == storages
    assert not torch.equal(model(ids).logits, before)
    named = list(model.named_parameters())
    pairs = held_weights.pack([(n, p.detach()) for n, p in named])
    assert len(pairs) == 1 and pairs[0][0].startswith(held_weights.HEADER)
    got = dict(held_weights.unpack(deserialize(serialize(pairs))))
    assert list(got) == [n for n, _ in named] and all(torch.equal(got[n], p) for n, p in named)
    with pytest.raises(ValueError, match="do not fit a storage"):
        held_weights.unpack([(held_weights.HEADER + '[["x","float32",[4],0,0]]', torch.zeros(8, dtype=torch.uint8))])
    # mixed dtypes: one storage each, every tensor back under its name and in the order packed
    mixed = torch.nn.Module()
    for i, dt in enumerate([torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]):
        mixed.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(3, i + 1).to(dt)))
    flatten_parameters(mixed)
    named = list(mixed.named_parameters())
    pairs = held_weights.pack([(n, p.detach()) for n, p in named])
    back = held_weights.unpack(deserialize(serialize(pairs)))
    assert len(pairs) == 2 and [n for n, _ in back] == [n for n, _ in named]
    assert all(torch.equal(a, p) and a.dtype == p.dtype for (_, a), (_, p) in zip(back, named))


def test_resolve_transport_table():
    cpu, gpu = Placement("cpu", "cpu"), Placement("cuda", "cuda")
    assert resolve_transport("auto", "auto", cpu) == ("distributed", "gloo")
    assert resolve_transport("auto", "auto", gpu) == ("distributed", "nccl")
    assert resolve_transport("auto", "auto", Placement("cuda", None)) == ("distributed", "nccl")  # SGLang servers
    assert resolve_transport("auto", "auto", Placement("cuda", "cuda", colocated=True)) == ("tensor", "auto")
    shared = Placement("cuda", "cuda", shared_gpu="one GPU")
    assert resolve_transport("auto", "auto", shared) == ("distributed", "gloo")
    assert resolve_transport("disk", "nccl", cpu) == ("disk", "nccl")  # not a collective: the backend is unused
    assert resolve_transport("distributed", "gloo", Placement("cuda", "cuda", colocated=True)) == ("distributed", "gloo")
    with pytest.raises(ValueError, match="needs --colocate"):
        resolve_transport("tensor", "auto", gpu)
    with pytest.raises(ValueError, match="nccl: the engines run on the CPU"):
        resolve_transport("distributed", "nccl", Placement("cuda", "cpu"))


# --- the memory handoff ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(engine_model):  # noqa: F811
    proc, url = start_engine(engine_model, random_seed=0)
    try:
        yield url
    finally:
        stop_process(proc)


async def _generate(url: str, timeout: float) -> dict:
    async with EngineClient(url, timeout=timeout) as c:
        return await c.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3, "temperature": 0})


def test_memory_handoff_with_the_embedded_engine(engine):
    """release: the engine pauses (it generates nothing while the trainer trains); resume: it
    generates again. The client's calls themselves answer SGLang's success."""
    mem = EngineMemory([engine], WeightSyncSettings(timeout_s=30))
    mem.release()

    async def held_then_served() -> None:
        req = asyncio.ensure_future(_generate(engine, 30))
        await asyncio.sleep(1.0)
        assert not req.done()  # paused: the request waits
        await asyncio.get_running_loop().run_in_executor(None, mem.resume)
        assert (await asyncio.wait_for(req, 30))["meta_info"]["completion_tokens"] == 3
    run(held_then_served())
    assert mem.resume() >= 0  # nothing released: a no-op

    async def direct() -> None:
        async with EngineClient(engine, timeout=30) as c:
            assert (await c.release_memory_occupation(["kv_cache"]))["success"]
            assert (await c.resume_memory_occupation(["kv_cache"]))["success"]
            with pytest.raises(EngineError, match="unknown tag 'gpu'"):
                await c.release_memory_occupation(["gpu"])
    run(direct())
    assert run(_generate(engine, 30))["meta_info"]["completion_tokens"] == 3


@pytest.fixture(scope="module")
def oracle(toy_model_dir, tmp_path_factory):
    """SGLang's app, request structs, weight updaters and scheduler-side memory code (TP=1: the
    fan-out to TP ranks is the conformance tier's, tests/test_sglang_conformance.py)."""
    from sglang_oracle import running_oracles

    with running_oracles(toy_model_dir, tmp_path_factory.mktemp("oracle_memory"), {"tp1": (1, ())}) as urls:
        yield urls["tp1"]


def test_memory_handoff_with_sglangs_own_code(oracle):
    """SGLang's route parses our bodies into its ReleaseMemoryOccupationReqInput /
    ResumeMemoryOccupationReqInput and its scheduler-side code pauses and resumes the
    kv_cache tag; the engine is paused first (SGLang releases only an idle engine) and continued
    after; resuming a tag never released is SGLang's error, which the handoff never sends."""
    from test_sglang_conformance import _get

    def memory() -> list[dict]:
        return _get(oracle, "/oracle/memory")["ranks"]

    control0 = len(_get(oracle, "/oracle/requests")["control"])
    mem = EngineMemory([oracle], WeightSyncSettings(timeout_s=30))
    mem.release()
    assert [r["offloaded"] for r in memory()] == [["kv_cache"]]
    mem.resume()
    assert [r["offloaded"] for r in memory()] == [[]]
    assert [r["events"] for r in memory()] == [[["pause", "kv_cache"], ["resume", "kv_cache"]]]
    control = _get(oracle, "/oracle/requests")["control"][control0:]
    assert control == ["pause_generation", "release_memory_occupation", "resume_memory_occupation",
                       "continue_generation"]

    async def call(what: str, tags: list[str]):
        async with EngineClient(oracle, timeout=30) as c:
            return await getattr(c, what)(tags)
    assert run(call("release_memory_occupation", ["kv_cache", "cuda_graph"])) is None  # SGLang answers null
    assert [r["offloaded"] for r in memory()] == [["cuda_graph", "kv_cache"]]
    assert run(call("resume_memory_occupation", ["kv_cache", "cuda_graph"])) is None
    with pytest.raises(EngineError) as e:
        run(call("resume_memory_occupation", ["kv_cache"]))  # never released
    assert e.value.status == 400
    assert [r["offloaded"] for r in memory()] == [[]]


@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_sglang_receives_tensors_cast_at_the_push(oracle, transport):
    """With the launcher's ``engine_dtype`` (SGLang lists no dtypes), SGLang's own receive path
    (flattened bucket metadata, ``load_weights``) gets every floating tensor in that dtype with the
    bytes of the trainer's cast; the non-floating one as it was. (``tensor``: the load format ``auto``
    falls back from ``mapped`` to flattened buckets, since this SGLang allows no custom loader.)"""
    from test_sglang_conformance import _assert_received, _get

    g = torch.Generator().manual_seed(5 if transport == "tensor" else 6)
    named = [(f"model.layers.{i}.w", torch.randn(6, 5, generator=g)) for i in range(3)]
    named.append(("model.step", torch.arange(4, dtype=torch.int64)))
    s = WeightSyncSettings(transport=transport, backend="gloo", bucket_bytes=128, timeout_s=60,
                           engine_dtype="bfloat16")
    with WeightSender(s) as sender:
        sender.connect([oracle])  # auto: SGLang's /get_server_info lists no held-weights loader here
        assert sender.settings.load_format == "flattened_bucket"
        m = sender.push(named, version=3)
    assert m["weight_sync/cast_tensors"] == 3
    [rank] = _get(oracle, "/oracle/received")["ranks"]
    _assert_received(rank, [(n, t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in named])


# --- placement ---------------------------------------------------------------------------------------
def test_colocated_ranks_are_pinned_to_their_gpu(ray_local):  # noqa: F811
    """Rank i of a colocated group sees GPU i only (as engine i does), on the launcher's node, and
    reserves nothing in Ray (a whole-GPU reservation would make Ray refuse the engines, or them it)."""
    from train_backend.actor_group import _colocated_options

    class Probe:
        def env(self) -> tuple[str | None, str]:
            import ray

            return os.environ.get("CUDA_VISIBLE_DEVICES"), ray.get_runtime_context().get_node_id()

    opts = _colocated_options(2, cuda=True)
    assert all(o["num_cpus"] == 0 and "num_gpus" not in o for o in opts)
    probes = [ray_local.remote(Probe).options(**o).remote() for o in opts]
    got = ray_local.get([p.env.remote() for p in probes], timeout=120)
    here = ray_local.get_runtime_context().get_node_id()
    assert got == [("0", here), ("1", here)]
    assert "runtime_env" not in _colocated_options(1, cuda=False)[0]  # CPU ranks: nothing to pin


# --- the launcher, end to end ------------------------------------------------------------------------
def _train(model: Path, out: Path, config: str, *extra: str, timeout: float = 400,
           env: dict[str, str] | None = None) -> tuple[list[dict], str]:
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / config),
           "--hf-checkpoint", str(model), "--prompt-data", str(model / "data/train.jsonl"),
           "--eval-prompt-data", str(model / "data/eval.jsonl"), "--output-dir", str(out), "--no-build-toy-model",
           "--no-plots", "--buffer-name", f"buf-{out.name}", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(line) for line in open(out / "metrics.jsonl")], proc.stdout + proc.stderr  # Ray actors log to stderr


def test_colocated_run_on_the_cpu_survives_losing_its_only_engine(toy_model_dir, tmp_path):
    """--colocate on the CPU: the tensor transport (shared-memory files; ``mapped``: the trainer's
    parameters, in one buffer, held by the engine), the engine paused and released before each
    training step and resumed after each push, every push checked tensor by tensor against the
    trainer's, rollouts of step k on version k. Its one engine is SIGKILLed after step 1 trained
    (released, paused, holding version 1): the push of version 2 finds no live engine and waits
    while the fleet restarts it; the restarted engine gets version 2 before it serves again (it is
    back in the router only at the fleet's version), its memory, never released, is not resumed
    (SGLang fails on that; so does the embedded engine), and the run ends with every group trained
    once."""
    out = tmp_path / "lost"
    records, stdout = _train(toy_model_dir, out, "examples/toy/grpo_cpu.yaml", "--colocate", "--num-rollout", "4",
                             "--rollout-num-engines", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                             "--eval-interval", "4", "--skip-eval-before-train", "--health-check-interval", "0.5",
                             "--check-weight-update-equal",
                             "--save-debug-rollout-data", str(out / "dump_{rollout_id}.parquet"),
                             env={"RESERVOIR_CRASH_AT": "engine@after_train:1"})
    assert "weight sync: tensor" in stdout
    assert "SIGKILL engine at after_train of step 1" in stdout
    assert "push v2: no live engine; waiting" in stdout, stdout[-3000:]
    assert "was restarted while its memory was released" in stdout, stdout[-3000:]
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    assert steps[1]["weight_sync/revived"] == 1 and steps[1]["weight_sync/attempts"] == 2
    assert all(r["rollout/weight_version_min"] == r["rollout/weight_version_max"] == r["step"] for r in steps)
    assert all(r["weight_sync/check_s"] > 0 and r["weight_sync/version"] == r["step"] + 1 for r in steps)
    assert all(r["weight_sync/held_tensors"] > 0 and r["weight_sync/num_buckets"] == 0 for r in steps)  # auto: mapped
    assert all(r["weight_sync/bytes"] == steps[0]["weight_sync/bytes"] > 0 for r in steps)
    assert all(r["perf/release_memory_time"] > 0 for r in steps)
    assert all(r["perf/resume_memory_time"] > 0 for r in steps if r["step"] != 1)  # the restarted one: not resumed
    assert not any(k.startswith("memory/") for r in steps for k in r)  # GPU memory: on GPUs only
    assert [r["step"] for r in records if "eval/accuracy" in r] == [4]
    from buffer.arrow import read_parquet

    trained = [g[0].group_index for step in range(4) for g in read_parquet(out / f"dump_{step}.parquet")]
    assert sorted(trained) == list(range(16)), trained


def test_colocated_run_without_offload_rollout_keeps_the_engines_memory(toy_model_dir, tmp_path):
    """--colocate --no-offload-rollout (slime's flag): the engines keep their KV cache through the
    training step (no pause, release, resume or continue around it: no ``perf/release_memory_time``
    or ``perf/resume_memory_time``), and the run is otherwise the colocated one: every push checked
    against the trainer's tensors, the rollouts of step k on version k."""
    out = tmp_path / "kept"
    records, stdout = _train(toy_model_dir, out, "examples/toy/grpo_cpu.yaml", "--colocate", "--no-offload-rollout",
                             "--num-rollout", "2", "--rollout-num-engines", "1", "--rollout-batch-size", "4",
                             "--n-samples-per-prompt", "2", "--eval-interval", "2", "--skip-eval-before-train",
                             "--check-weight-update-equal")
    assert "weight sync: tensor" in stdout
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [0, 1]
    assert not any(k in r for r in steps for k in ("perf/release_memory_time", "perf/resume_memory_time"))
    assert all(r["weight_sync/check_s"] > 0 and r["weight_sync/version"] == r["step"] + 1 for r in steps)
    assert all(r["rollout/weight_version_min"] == r["rollout/weight_version_max"] == r["step"] for r in steps)
    assert [r["step"] for r in records if "eval/accuracy" in r] == [2]


@pytest.mark.gpu
@pytest.mark.parametrize("offload_params", [False, True])
def test_colocated_launcher_run_on_one_gpu(tmp_path, offload_params):
    """Issue 13 on one GPU: the toy model's trainer (fp32) and its engine (bf16) share GPU 0; pushes
    go as CUDA IPC handles cast to bf16, land exactly (checked per tensor), and each phase's memory
    is reported. With ``--offload-train-params`` the parameters leave the GPU with the optimizer
    state after every push and come back for the next step (the pushes then check their bytes)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from scripts import make_toy_model

    model = make_toy_model.main(["--out", str(tmp_path / "model"), "--warmup-steps", "20"])
    config = tmp_path / "colocate_1gpu.yaml"  # the example's, without TensorBoard (not needed here)
    config.write_text((ROOT / "examples/gpu/grpo_colocate_1gpu.yaml").read_text()
                      .replace("use-tensorboard: true", "use-tensorboard: false"))
    t0 = time.monotonic()
    extra = ["--offload-train-params"] if offload_params else ["--update-weight-load-format", "flattened_bucket"]
    records, stdout = _train(model, tmp_path / "gpu", str(config), "--num-rollout", "4", "--eval-interval", "4",
                             "--check-weight-update-equal", *extra)
    print(stdout[-2000:], f"wall {time.monotonic() - t0:.1f}s")
    assert "weight sync: tensor" in stdout
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    assert all(r["weight_sync/check_s"] > 0 and r["weight_sync/cast_tensors"] > 0 for r in steps)
    for phase in ("rollout", "train", "weight_sync"):
        assert all(r[f"memory/{phase}_peak_gib"] > 0 for r in steps), phase
    for r in steps:
        print({k: round(v, 4) for k, v in r.items() if k.startswith(("memory/", "perf/", "weight_sync/time"))})
    if offload_params:  # fp32 parameters (4 bytes each) and Adam's two moments (8) came back from the host
        from safetensors import safe_open

        with safe_open(str(model / "model.safetensors"), "pt") as f:
            numel = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        assert all(r["memory/offloaded_gib"] * 1024 ** 3 >= 12 * numel * 0.99 for r in steps[1:])
