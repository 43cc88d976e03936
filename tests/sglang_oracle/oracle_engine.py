"""An SGLang server for tests, assembled from SGLang's own code (the conformance tier's oracle).

``python tests/sglang_oracle/oracle_engine.py --model-path M --port P [--tp-size N]``

What is SGLang's own code here, and what is not:
- HTTP: SGLang's FastAPI ``app`` (``sglang.srt.entrypoints.http_server``): its routes, its request
  parsing into SGLang's request structs (a body SGLang would reject is rejected here with SGLang's
  status code), its ``generate`` contract check, its API-key middleware (``--api-key``,
  ``--admin-api-key``), ``/model_info`` and ``/server_info`` from a ``ServerArgs`` parsed by SGLang.
- Weight updates: per TP rank, one process that runs SGLang's scheduler-level weight updater
  (``SchedulerWeightUpdaterManager``: the begin/end session, ``update_weights_from_distributed``)
  over SGLang's model-runner ``WeightUpdater`` (``init_custom_process_group`` with rank
  ``rank_offset + tp_rank``, the broadcast receive, ``FlattenedTensorBucket``), the TP ranks joined
  in a gloo default group as SGLang's TP workers are. ``/update_weights_from_tensor``: each rank
  opens its own payload with SGLang's ``BaseTpWorker.deserialize_own_rank`` (its allowlisted
  unpickler and its patch of torch's CUDA-tensor rebuild) and loads it with the model-runner
  ``WeightUpdater.update_weights_from_tensor`` (lists of tensors, or ``FlattenedTensorBucket``).
- Not SGLang: the tokenizer manager (SGLang's talks to a scheduler over ZMQ). This one runs the
  same validation steps on ``/generate`` as SGLang's (``normalize_batch_and_arguments``, then per
  request ``SamplingParams(**...)``, ``normalize``, ``verify(vocab_size)``, the context-length
  check) and answers with token ids that depend only on the prompt (no model runs), with
  SGLang's response fields. The model (``load_weights``) records what it received.
- Test-only routes, under ``/oracle/``: what each TP rank received, the requests seen. SGLang's
  app lifespan (tokenizer workers, OpenAI handlers, warm-up) is not run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import sys
import threading
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1])]  # tests/ (sglang_oracle) and the repo


# --- one TP rank ------------------------------------------------------------------------------
class _RecordingModel:
    """Stands in for SGLang's model: ``load_weights`` (what SGLang's loaders call) records the
    tensors it is given, as received."""

    def __init__(self) -> None:
        import torch

        self.received: dict[str, "torch.Tensor"] = {}
        self.storages: dict[str, list[int]] = {}  # per name, the storage each load got (its C pointer)
        self.loaded: dict[str, "torch.Tensor"] = {}  # the checkpoint, as loaded at start-up
        self._dummy = torch.nn.Linear(1, 1)

    def load_weights(self, named) -> None:
        for name, t in named:
            self.received[name] = t.detach().clone()
            self.storages.setdefault(name, []).append(t.untyped_storage()._cdata)

    def get_weights_by_name(self, name: str, truncate_size: int = 100, tp_size: int = 1):
        """As SGLang's llama model answers it: the parameter's leading rows as float32 lists (here
        as received: no stacked or sharded layout); None for a name it does not hold, as SGLang's
        model runner answers after catching the model's error."""
        import torch

        t = self.received.get(name, self.loaded.get(name))
        return None if t is None else t.to(torch.float32).numpy().tolist()[:truncate_size]

    def load_checkpoint(self, model_path: str) -> None:
        """What the server holds before any push: the checkpoint's tensors (SGLang loads them at
        start-up); kept apart from ``received``, which records pushes only."""
        from safetensors.torch import load_file

        for f in sorted(Path(model_path).glob("*.safetensors")):
            self.loaded.update(load_file(str(f)))

    def modules(self):  # SGLang's updater scans modules for derived-weight caches
        return iter([self._dummy])

    def named_modules(self):
        return iter([("", self._dummy)])

    def summary(self) -> dict:
        return {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                    "sha256": hashlib.sha256(t.contiguous().view(-1).view(__import__("torch").uint8)
                                             .numpy().tobytes()).hexdigest(),
                    "storages": self.storages.get(n, [])}
                for n, t in self.received.items()}


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this rank when the oracle process ends, however it ends: uvicorn
    re-raises the SIGTERM it caught once it has shut down, so the oracle dies by the signal without
    running its ``finally`` or multiprocessing's reaping of daemon children, and a rank blocked in
    ``conn.recv()`` would otherwise outlive it (orphaned, holding its memory)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent was already gone before prctl took effect
        os._exit(1)


def tp_rank_main(rank: int, tp_size: int, store_port: int, server_argv: list[str], conn, parent_pid: int) -> None:
    """One TP rank: SGLang's scheduler and model-runner weight updaters; requests come over ``conn``."""
    _die_with_parent(parent_pid)
    from sglang_oracle import import_sglang

    sg = import_sglang()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=rank, world_size=tp_size)
    server_args = sg.server_args.prepare_server_args(server_argv)
    sg.server_args.set_global_server_args_for_scheduler(server_args)
    import sglang.srt.runtime_context as rc
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tp_worker import BaseTpWorker
    from sglang.srt.model_executor.model_runner_components.weight_exporter import WeightExporter
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    rc.get_parallel().override_permanently(tp_group=types.SimpleNamespace(cpu_group=dist.group.WORLD),
                                           tp_rank=rank, tp_size=tp_size)
    model = _RecordingModel()
    model.load_checkpoint(server_args.model_path)
    updater = WeightUpdater(tp_rank=rank, device="cpu", gpu_id=0, model_config=None,
                            custom_weight_loaders=server_args.custom_weight_loader or [],
                            get_model=lambda: model, update_model_fields=lambda *a, **k: None,
                            recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
    exporter = WeightExporter(tp_rank=rank, tp_size=tp_size, gpu_id=0, get_model_path=lambda: server_args.model_path,
                              get_model=lambda: model)  # /get_weights_by_name reads through it
    runner = types.SimpleNamespace(weight_updater=updater, weight_exporter=exporter)
    tp_worker = types.SimpleNamespace(model_runner=runner, weight_update_runners=lambda: [("target", runner)])
    # SGLang's TP worker methods, run on this stand-in worker (they only delegate to the runner)
    tp_worker.init_weights_update_group = lambda req: BaseTpWorker.init_weights_update_group(tp_worker, req)
    tp_worker.destroy_weights_update_group = lambda req: BaseTpWorker.destroy_weights_update_group(tp_worker, req)
    # /update_weights_from_tensor: each rank opens its own entry of serialized_named_tensors
    tp_worker.deserialize_own_rank = lambda payloads: BaseTpWorker.deserialize_own_rank(tp_worker, payloads)
    tp_worker.get_weights_by_name = lambda req: BaseTpWorker.get_weights_by_name(tp_worker, req)
    versions: list = []
    scheduler = types.SimpleNamespace(record_weight_version_change=lambda new_version: versions.append(new_version))
    manager = SchedulerWeightUpdaterManager(tp_worker=tp_worker, draft_worker=None, memory_saver_adapter=None,
                                            flush_cache=lambda empty_cache=False: True,
                                            is_fully_idle=lambda **k: True, scheduler=scheduler)
    # /release_memory_occupation, /resume_memory_occupation: SGLang's scheduler-side code, over a
    # memory saver that records the tags it is told to pause and resume (SGLang's moves CUDA
    # memory), and the scheduler fields that code reads (no disaggregation)
    from sglang.srt.disaggregation.utils import DisaggregationMode

    memory: list = []
    manager.memory_saver_adapter = types.SimpleNamespace(pause=lambda tag: memory.append(("pause", tag)),
                                                         resume=lambda tag: memory.append(("resume", tag)))
    scheduler.disaggregation_mode, scheduler._engine_paused = DisaggregationMode.NULL, False
    conn.send("ready")
    while True:
        op, req = conn.recv()
        if op == "stop":
            return
        if op == "received":
            conn.send({"tensors": model.summary(), "versions": versions})
            continue
        if op == "memory":
            conn.send({"events": list(memory), "offloaded": sorted(manager.offload_tags)})
            continue
        if op == "get_weights_by_name":  # SGLang's scheduler-side handler; its output carries the rows
            conn.send(manager.get_weights_by_name(req).parameter)
            continue
        if op in ("release_memory_occupation", "resume_memory_occupation"):  # their outputs carry no status
            try:
                getattr(manager, op)(req)
                conn.send((True, ""))
            except Exception as e:  # e.g. resuming a tag never released (SGLang's scheduler fails there too)
                conn.send((False, f"{type(e).__name__}: {e}"))
            continue
        try:
            out = getattr(manager, op)(req)
            conn.send((bool(out.success), str(out.message)))
        except Exception as e:  # sent back; SGLang's scheduler would log it and fail the call
            conn.send((False, f"{type(e).__name__}: {e}"))


class TPRanks:
    """The TP rank processes of one oracle engine; ``call`` sends a request to all of them."""

    def __init__(self, tp_size: int, server_argv: list[str]):
        from sglang_protocol.client import EngineClient  # noqa: F401  (the repo is importable)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            store_port = s.getsockname()[1]
        # fork, not spawn: the ranks inherit the SGLang modules this process imported (spawn imported
        # them again in each rank, most of an oracle's start-up); no thread runs here yet (the
        # HTTP server starts after the ranks)
        ctx = mp.get_context("fork")
        self.conns, self.procs = [], []
        for r in range(tp_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=tp_rank_main, args=(r, tp_size, store_port, server_argv, child, os.getpid()),
                            daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if c.recv() != "ready":
                raise RuntimeError("a TP rank failed to start")
        self._locks = [threading.Lock() for _ in self.conns]

    def _one(self, i: int, op: str, req):
        with self._locks[i]:
            self.conns[i].send((op, req))
            return self.conns[i].recv()

    async def call(self, op: str, req) -> list:
        return await asyncio.gather(*(asyncio.to_thread(self._one, i, op, req) for i in range(len(self.conns))))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask every rank to return, and reap it; a rank that does not return in ``timeout_s``
        (e.g. blocked in a collective whose peer is gone) is killed."""
        for c in self.conns:
            try:
                c.send(("stop", None))
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()


# --- the tokenizer manager stand-in -----------------------------------------------------------
class OracleTokenizerManager:
    """What SGLang's HTTP routes call on ``_global_state.tokenizer_manager``."""

    def __init__(self, server_args, ranks: TPRanks, vocab_size: int, context_len: int, hf_config):
        from sglang.srt.managers.tokenizer_manager import ServerStatus

        self.server_args, self.ranks = server_args, ranks
        self.vocab_size, self.context_len = vocab_size, context_len
        self.model_path = server_args.model_path
        self.served_model_name = server_args.served_model_name or server_args.model_path
        self.model_config = types.SimpleNamespace(hf_config=hf_config, vocab_size=vocab_size,
                                                  is_image_understandable_model=False,
                                                  is_audio_understandable_model=False)
        self.is_generation = True
        self.gracefully_exit = False
        self.server_status = ServerStatus.Up
        self.startup_time = time.time()
        self.weight_version = "default"
        self.is_pause = False
        self.requests: list[dict] = []  # what /generate was sent (after SGLang's parsing), for tests
        self.control: list[tuple[str, dict]] = []  # control calls, in order
        self.distributed_updates: list[dict] = []  # fields of each /update_weights_from_distributed
        self.tensor_updates: list[dict] = []  # /update_weights_from_tensor calls, as SGLang parsed them

    # state
    def is_ready(self) -> bool:
        return True

    def config_value(self, key: str):
        return {"weight_version": self.weight_version, "load_format": "auto"}.get(key)

    async def get_internal_state(self) -> list[dict]:
        return [{"weight_version": self.weight_version}]

    # generation
    async def generate_request(self, obj, request=None):
        from sglang.srt.sampling.sampling_params import SamplingParams

        obj.normalize_batch_and_arguments()  # SGLang's own normalisation of a single or batch request
        items = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
        outs = []
        for it in items:
            sp = SamplingParams(**dict(it.sampling_params))
            sp.normalize(None)
            sp.verify(self.vocab_size)
            ids = list(it.input_ids) if it.input_ids is not None else []
            if it.input_ids is None:
                raise ValueError("the oracle engine needs input_ids (no tokenizer runs here)")
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"input_ids: a token id is outside [0, {self.vocab_size})")
            if len(ids) + (sp.max_new_tokens or 0) > self.context_len:
                raise ValueError(f"Requested token count exceeds the model's maximum context length "
                                 f"of {self.context_len} tokens.")
            self.requests.append({"rid": it.rid, "input_ids": ids, "sampling_params": dict(it.sampling_params),
                                  "return_logprob": it.return_logprob})
            n = sp.max_new_tokens if sp.max_new_tokens is not None else 16
            out_ids = [(sum(ids) + 7 * k) % self.vocab_size for k in range(n)]
            meta = {"id": it.rid, "finish_reason": {"type": "length", "length": n},
                    "prompt_tokens": len(ids), "completion_tokens": n, "cached_tokens": 0,
                    "weight_version": self.weight_version}
            if it.return_logprob:
                meta["output_token_logprobs"] = [[-0.5, t, None] for t in out_ids]
            outs.append({"text": "", "output_ids": out_ids, "meta_info": meta})
        yield outs[0] if obj.is_single else outs

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.control.append(("abort_request", {"rid": rid, "abort_all": abort_all}))

    def create_abort_task(self, obj):
        return None

    async def pause_generation(self, obj) -> None:
        self.control.append(("pause_generation", {"mode": obj.mode}))
        self.is_pause = True

    async def continue_generation(self, obj) -> None:
        self.control.append(("continue_generation", {}))
        self.is_pause = False

    async def flush_cache(self, timeout_s: float = 0.0):
        self.control.append(("flush_cache", {}))
        return types.SimpleNamespace(success=True, message="")

    # weights: every TP rank runs SGLang's own updater
    async def _fan_out(self, op: str, obj) -> tuple[bool, str]:
        self.control.append((op, {}))
        outs = await self.ranks.call(op, obj)
        bad = [m for ok, m in outs if not ok]
        return (False, bad[0]) if bad else (True, outs[0][1])

    async def init_weights_update_group(self, obj, request=None):
        return await self._fan_out("init_weights_update_group", obj)

    async def destroy_weights_update_group(self, obj, request=None):
        return await self._fan_out("destroy_weights_update_group", obj)

    async def begin_weight_update(self, obj, request=None):
        return await self._fan_out("begin_weight_update", obj)

    async def end_weight_update(self, obj, request=None):
        return await self._fan_out("end_weight_update", obj)

    async def update_weights_from_disk(self, obj, request=None):
        """The body was parsed into SGLang's ``UpdateWeightFromDiskReqInput`` by the route; no
        checkpoint is loaded here (SGLang's disk loader needs a real model)."""
        self.control.append(("update_weights_from_disk", {"model_path": obj.model_path}))
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return True, "Succeeded to update model weights.", 0

    async def update_weights_from_distributed(self, obj, request=None):
        self.distributed_updates.append({"group_name": obj.group_name, "flush_cache": obj.flush_cache,
                                         "weight_version": obj.weight_version, "load_format": obj.load_format})
        ok, msg = await self._fan_out("update_weights_from_distributed", obj)
        if ok and obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return ok, msg


    async def update_weights_from_tensor(self, obj, request=None):
        """As SGLang's tokenizer manager: the payloads normalised to raw bytes by SGLang's own
        function, then every TP rank runs SGLang's scheduler updater on the request (it opens its
        own entry with ``deserialize_own_rank``, then the model-runner ``WeightUpdater`` loads it)."""
        from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

        obj.serialized_named_tensors = normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors)
        self.tensor_updates.append({"load_format": obj.load_format, "flush_cache": obj.flush_cache,
                                    "weight_version": obj.weight_version,
                                    "payloads": len(obj.serialized_named_tensors)})
        ok, msg = await self._fan_out("update_weights_from_tensor", obj)
        if ok and obj.weight_version is not None:
            self.weight_version = obj.weight_version
            msg += f" Weight version updated to {obj.weight_version}."
        return ok, msg

    async def get_weights_by_name(self, obj, request=None):
        """As SGLang's tokenizer manager: every rank is asked, rank 0's answer is returned (dp 1)."""
        return (await self.ranks.call("get_weights_by_name", obj))[0]

    async def release_memory_occupation(self, obj, request=None):
        """Every TP rank runs SGLang's scheduler-side release; SGLang's route answers null, or an
        error response when this raises."""
        ok, msg = await self._fan_out("release_memory_occupation", obj)
        if not ok:
            raise RuntimeError(msg)

    async def resume_memory_occupation(self, obj, request=None):
        ok, msg = await self._fan_out("resume_memory_occupation", obj)
        if not ok:
            raise RuntimeError(msg)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="An SGLang server for tests, from SGLang's own code")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--admin-api-key", default=None)
    ap.add_argument("--custom-weight-loader", nargs="*", default=None, help="SGLang's flag, passed to its ServerArgs")
    ap.add_argument("--without-session-routes", action="store_true",
                    help="serve as SGLang before 0.5.22 did: no /begin_weight_update or /end_weight_update "
                         "(404), and loads need no session (each TP rank holds one open from the start)")
    a = ap.parse_args(argv)
    from sglang_oracle import import_sglang

    sg = import_sglang()
    server_argv = ["--model-path", a.model_path, "--host", a.host, "--port", str(a.port),
                   "--tp-size", str(a.tp_size), "--device", "cpu"]
    if a.custom_weight_loader:
        server_argv += ["--custom-weight-loader", *a.custom_weight_loader]
    server_args = sg.server_args.prepare_server_args(server_argv)
    sg.server_args.set_global_server_args_for_tokenizer(server_args)
    import sglang.srt.entrypoints.http_server as hs
    import uvicorn
    from sglang.srt.utils.auth import add_api_key_middleware

    cfg = json.loads((Path(a.model_path) / "config.json").read_text())
    ranks = TPRanks(a.tp_size, server_argv)
    tm = OracleTokenizerManager(server_args, ranks, int(cfg["vocab_size"]),
                                int(cfg.get("max_position_embeddings", 2048)), types.SimpleNamespace(**cfg))
    hs.set_global_state(hs._GlobalState(tokenizer_manager=tm, template_manager=None, scheduler_info={}))
    if a.without_session_routes:
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        hs.app.router.routes[:] = [r for r in hs.app.router.routes
                                   if getattr(r, "path", None) not in ("/begin_weight_update", "/end_weight_update")]
        asyncio.run(ranks.call("begin_weight_update", BeginWeightUpdateReqInput()))
    # SGLang's lifespan starts its tokenizer workers, OpenAI handlers and warm-up request: none of
    # them exists here (the native routes under test read only _global_state). Its shutdown reaps
    # the ranks: on SIGTERM uvicorn runs it and then re-raises the signal, so the code after
    # uvicorn.run does not run then
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(ranks.stop)
    hs.app.router.lifespan_context = lifespan
    if a.api_key or a.admin_api_key:
        add_api_key_middleware(hs.app, api_key=a.api_key, admin_api_key=a.admin_api_key)

    @hs.app.get("/oracle/received")
    async def received():
        return {"ranks": [r for r in await ranks.call("received", None)]}

    @hs.app.get("/oracle/tensor_updates")
    async def tensor_updates():
        return {"calls": tm.tensor_updates}

    @hs.app.get("/oracle/memory")
    async def memory_seen():
        return {"ranks": await ranks.call("memory", None)}

    @hs.app.get("/oracle/requests")
    async def requests_seen():
        return {"generate": tm.requests, "control": [op for op, _ in tm.control],
                "distributed_updates": tm.distributed_updates}

    try:
        uvicorn.run(hs.app, host=a.host, port=a.port, log_level="warning", timeout_keep_alive=5)
    finally:
        ranks.stop()


if __name__ == "__main__":
    os.environ.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")  # /health answers 200 at once
    main()
