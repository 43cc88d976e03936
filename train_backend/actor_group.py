"""The trainer ranks as a group of Ray actors: one :class:`TrainerRank` per rank, driven together
by a :class:`TrainerGroup` in the launcher's process.

    group = TrainerGroup(train_settings, megatron_settings, TrainerGroupSettings(actor_num_gpus_per_node=2))
    metrics = group.train_step(groups, step)             # rank 0 gets the groups, the others None
    group.connect_weight_sync(sync_settings, engine_urls, engine_gpus, buffer)  # rollout_manager.engines.engine_gpus
    group.push_weights(step + 1)                         # every rank gathers, rank 0 broadcasts
    group.close()

Every rank runs the same backend method at the same time (the methods are collectives under
FSDP2 and TP/PP/DP) and the driver returns rank 0's result. Placement: with ``--train-device
cuda`` one placement group holds one ``{"GPU": 1, "CPU": 1}`` bundle per rank (PACK), each rank
pinned to its bundle, so Ray picks the node and the GPU (``CUDA_VISIBLE_DEVICES``: device 0
inside the actor). On the CPU the ranks take no Ray resources (like the buffer and the rollout
manager): a 2-core machine still runs 2 CPU ranks beside 2 engines. With ``--actor-num-nodes N > 1``
CPU ranks go to N distinct nodes (a STRICT_SPREAD placement group of one CPU sliver per node;
ranks ``k*per_node ... (k+1)*per_node - 1`` on node k), as GPU ranks of N nodes would. A single rank with a pinned
``--train-device cuda:N`` reserves nothing either: the user chose the GPU.

Colocated (``--colocate``): rank i runs on GPU i of the launcher's node, the GPU that engine i's
(first) rank runs on (``rollout_manager.engines.engine_command`` places locally started engines on
GPUs ``0, 1, ...``), with ``CUDA_VISIBLE_DEVICES`` set to it and nothing reserved in Ray. Ray's own
placement cannot pair them: it picks the GPU of a fractional request itself (a trainer rank and an
engine could land on different GPUs of a node), and a whole-GPU reservation on either side makes it
refuse the other. slime likewise computes its colocated engines' GPUs itself.

On GPUs, rank 0 reports the peak GPU memory its process allocated in each phase of a step
(``memory/<phase>_peak_gib``, the peak reset between phases) and the memory the whole device
used when the phase ended (``memory/<phase>_device_used_gib``: on a shared GPU, the engines'
too): ``rollout`` (from the end of the last push to the start of training: what the trainer holds
while the engines generate), ``train`` and ``weight_sync`` (the gather and the push).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from flags import flag, flag_of
from metric_keys import WEIGHT_GATHER_TIME, WEIGHT_PUSH_RANK_TIME
from buffer.ray_errors import error_line
from buffer.retry import PendingGet
from ray_cluster.placement import reserve_placement_group
from train_backend.interfaces import TrainSettings, create_backend
from train_backend.lora import LoraSettings
from train_backend.megatron.arguments import MegatronSettings

if TYPE_CHECKING:
    import ray

    from buffer.sample import Sample
    from weight_sync.interfaces import VersionSink, WeightSyncSettings

# How long to wait for Ray to grant the ranks' GPUs before failing with the cluster's resources.
_PLACEMENT_TIMEOUT_S = 300.0
# Bound on the trainer's collectives (as in train_backend/megatron/parallel.py): a rank that died
# mid-step makes the others fail after this instead of hanging.
_COLLECTIVE_TIMEOUT_S = 600.0


@dataclass
class TrainerGroupSettings:
    """How many trainer ranks, and where. Field defaults are the flag defaults (slime's names:
    ``--actor-num-nodes``, ``--actor-num-gpus-per-node``). On the CPU the product is the number
    of CPU ranks (gloo)."""

    actor_num_nodes: int = flag(1, "nodes of trainer ranks")
    actor_num_gpus_per_node: int = flag(1, "trainer ranks per node (one GPU each; on the CPU: CPU ranks over gloo)")
    # the launcher's --colocate: rank i on GPU i of this node, beside engine i (module doc)
    colocate: bool = flag(False, declared_elsewhere=True)
    offload_train: bool | None = flag(None, "keep the optimizer state (and fp32 master weights) in pinned host memory "
                                      "while the engines generate (default: on with --colocate on GPUs)")
    offload_train_params: bool = flag(False, "with --offload-train, the model parameters wait in host memory too "
                                      "(weight pushes then go in flattened buckets: engines cannot keep mapped "
                                      "what the trainer frees)")

    def offloads(self, train: TrainSettings) -> bool:
        """Whether the ranks keep their optimizer state on the host while the engines generate."""
        if self.offload_train is None:
            return self.colocate and train.device.startswith("cuda")
        return self.offload_train

    @property
    def world_size(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    def validate(self, train: TrainSettings, megatron: "MegatronSettings | None" = None) -> None:
        """Raise ``ValueError`` naming the flags of the first bad combination."""
        nodes = flag_of(TrainerGroupSettings, "actor_num_nodes")
        per_node = flag_of(TrainerGroupSettings, "actor_num_gpus_per_node")
        colocate = flag_of(TrainerGroupSettings, "colocate")
        offload = flag_of(TrainerGroupSettings, "offload_train")
        device, backend = flag_of(TrainSettings, "device"), flag_of(TrainSettings, "backend")
        tp_flag = flag_of(MegatronSettings, "tensor_model_parallel_size")
        pp_flag = flag_of(MegatronSettings, "pipeline_model_parallel_size")
        if self.actor_num_nodes < 1:
            raise ValueError(f"{nodes}={self.actor_num_nodes} must be >= 1")
        if self.actor_num_gpus_per_node < 1:
            raise ValueError(f"{per_node}={self.actor_num_gpus_per_node} must be >= 1")
        world = self.world_size
        ranks = f"{world} trainer ranks ({nodes} {self.actor_num_nodes} x {per_node} {self.actor_num_gpus_per_node})"
        if world > 1 and ":" in train.device:
            raise ValueError(f"{device} {train.device} pins one device, but there are {ranks}: use "
                             f"{device} {train.device.split(':')[0]} (Ray gives each rank its own GPU)")
        tp = megatron.tensor_model_parallel_size if megatron else 1
        pp = megatron.pipeline_model_parallel_size if megatron else 1
        if train.backend == "megatron" and world % (tp * pp):
            raise ValueError(f"{ranks} is not a multiple of {tp_flag} {tp} x {pp_flag} {pp}")
        if train.backend == "torch" and tp * pp > 1:
            raise ValueError(f"{tp_flag} {tp} / {pp_flag} {pp} need {backend} megatron (the torch backend shards "
                             "over all ranks with FSDP2)")
        if self.colocate and self.actor_num_nodes > 1:
            raise ValueError(f"{colocate} with {nodes} {self.actor_num_nodes}: colocated engines run on the "
                             f"launcher's node, so the trainer ranks must too ({nodes} 1)")
        estimator = flag_of(TrainSettings, "advantage_estimator")
        if train.advantage_estimator == "ppo" and world > 1:
            raise ValueError(f"{estimator} ppo with {ranks}: the critic trains on one rank ({nodes} 1 {per_node} 1)")
        if train.lora is not None and train.lora.enabled and world > 1:
            raise ValueError(f"{flag_of(LoraSettings, 'rank')} {train.lora.rank} with {ranks}: LoRA trains on one "
                             f"rank ({nodes} 1 {per_node} 1; the adapter is not gathered from FSDP2 shards)")
        if train.advantage_estimator == "ppo" and self.offload_train:
            raise ValueError(f"{estimator} ppo with {offload}: the critic's optimizer state is not offloaded")
        if self.offload_train and not train.device.startswith("cuda"):
            raise ValueError(f"{offload} with {device} {train.device}: it moves optimizer state from the GPU to the "
                             "host; there is nothing to move on the CPU")
        if self.offload_train_params and not self.offloads(train):
            raise ValueError(f"{flag_of(TrainerGroupSettings, 'offload_train_params')} moves the parameters with the "
                             f"optimizer state: it needs {offload} (on by default with {colocate} on GPUs)")
        if self.colocate and ":" in train.device:
            raise ValueError(f"{colocate} with {device} {train.device}: colocation puts rank i on engine i's GPU "
                             f"itself; use {device} {train.device.split(':')[0]}")

    def uses_gpus(self, train: TrainSettings) -> bool:
        """Whether Ray reserves a GPU per rank (``cuda`` without an index, not colocated)."""
        return train.device == "cuda" and not self.colocate


class TrainerRank:
    """One trainer rank in its own process: joins the trainer's process group, builds the backend,
    and (rank 0 only) owns the :class:`~weight_sync.sender.WeightSender`."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.backend: Any = None
        self.sender: Any = None
        self.cuda = False  # reports per-phase GPU memory (module docstring)
        self.offload: Any = None  # --offload-train: train_backend.offload.TrainOffload
        self.train: TrainSettings | None = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port on it: the rendezvous rank 0 hosts for the others."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def placement(self) -> dict[str, Any]:
        """Where this rank runs: node IP and the GPUs Ray gave it (for the launcher's log)."""
        import ray

        return {"rank": self.rank, "node": ray.util.get_node_ip_address(), "gpus": ray.get_gpu_ids()}

    def setup(self, master: tuple[str, int], train: TrainSettings, megatron: "MegatronSettings | None",
              offload: bool = False, offload_params: bool = False) -> None:
        """Join the default process group (several ranks) and build the backend.

        The torch backend shards with FSDP2 when it finds an initialised group of > 1 ranks; the
        Megatron backend uses an initialised group as it is (and builds a one-rank group itself
        when there is none), so one rank needs no group and sockets. Env vars are the standard
        ones, so megatron-core and torch.distributed see the layout they expect."""
        import torch
        import torch.distributed as dist

        if train.device == "cpu":  # Ray sets OMP_NUM_THREADS=1; share the cores as the engines do
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
        if train.device == "cuda":  # Ray (or colocation) made this rank's GPU the only one visible
            os.environ["LOCAL_RANK"] = "0"
        self.cuda = train.device.startswith("cuda")
        self.train = train
        if self.world_size > 1:  # one rank: no rendezvous ($RANK unset tells Megatron so)
            os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                              WORLD_SIZE=str(self.world_size))
            cuda = train.device == "cuda"
            if cuda:
                torch.cuda.set_device(0)
            dist.init_process_group("nccl" if cuda else "gloo",
                                    timeout=datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_S))
        self.backend = create_backend(train, megatron)
        if offload:
            from train_backend.offload import TrainOffload

            self.offload = TrainOffload(self.backend.optimizer, list(self.backend.model.parameters()),
                                        params=offload_params)

    # --- the TrainBackend methods, on this rank ------------------------------------------------
    def train_step(self, groups: "list[list[Sample]] | PendingGet | None", step: int) -> dict[str, float]:
        """The backend's ``train_step``; on a GPU with ``--offload-train`` the optimizer state comes
        back first, and the memory of the phases around it is reported (module docstring).

        Rank 0 may get the buffer's :class:`~buffer.retry.PendingGet` instead of the groups: it
        fetches them itself, and reports the wait as ``perf/buffer_wait_time``. A failed fetch still
        goes into the batch's broadcast (as a :class:`~train_backend.step.MissingBatch`), so every
        rank fails with the buffer's error rather than the others waiting for the groups."""
        fetched: dict[str, float] = {}
        if isinstance(groups, PendingGet):
            from train_backend.step import MissingBatch  # here: the launcher imports this module, and no torch

            t0 = time.perf_counter()
            try:
                groups = groups.result()
            except Exception as e:  # the ranks > 0 learn it in receive_groups; each rank raises it there
                groups = MissingBatch(f"the buffer's get(step={step}) failed: {error_line(e)}")
            fetched = {"perf/buffer_wait_time": time.perf_counter() - t0}
        if not self.cuda:
            return {**self.backend.train_step(groups, step), **fetched}
        rollout = self._memory_phase("rollout")  # what this rank held while the engines generated
        onload = {}
        if self.offload is not None and self.offload.offloaded:
            t0 = time.perf_counter()
            moved = self.offload.onload()
            onload = {"perf/onload_train_time": time.perf_counter() - t0, "memory/offloaded_gib": moved / 1024 ** 3}
        metrics = self.backend.train_step(groups, step)
        return {**metrics, **rollout, **onload, **self._memory_phase("train"), **fetched}

    def compute_log_probs(self, samples: list["Sample"]) -> list[list[float]]:
        with self._state_on_device():
            return self.backend.compute_log_probs(samples)

    def save(self, path: str) -> None:
        with self._state_on_device():
            self.backend.save(path)

    def load(self, path: str) -> None:
        with self._state_on_device():
            self.backend.load(path)

    def export_hf(self, path: str) -> None:
        with self._state_on_device():
            self.backend.export_hf(path)

    @contextlib.contextmanager
    def _state_on_device(self) -> Iterator[None]:
        """An offloaded optimizer state (and parameters) back where the backend keeps them, for a
        checkpoint's save or load, an export or log-probs outside a step; offloaded again after."""
        offloaded = self.offload is not None and self.offload.offloaded
        if offloaded:
            self.offload.onload()
        try:
            yield
        finally:
            if offloaded:
                self.offload.offload()

    def _memory_phase(self, phase: str) -> dict[str, float]:
        """The GPU memory of the phase that ends now (module docstring); starts the next one."""
        import torch

        gib = 1024 ** 3
        free, total = torch.cuda.mem_get_info()
        out = {f"memory/{phase}_peak_gib": torch.cuda.max_memory_allocated() / gib,
               f"memory/{phase}_device_used_gib": (total - free) / gib}
        torch.cuda.reset_peak_memory_stats()
        return out

    def connect_weight_sync(self, settings: "WeightSyncSettings", engine_urls: list[str], engine_gpus: list[int],
                            version_sink: "VersionSink | None") -> None:
        """Rank 0: create the sender and join the engines' weight-update group (``engine_gpus[i]``:
        engine i's GPUs, i.e. its ranks in the group). Others: nothing."""
        if self.rank != 0:
            return
        import dataclasses
        from urllib.parse import urlparse

        import ray

        from weight_sync.sender import WeightSender

        loopback = ("127.0.0.1", "localhost")
        if settings.master_address in loopback and any(urlparse(u).hostname not in loopback for u in engine_urls):
            # engines on other hosts cannot reach a loopback rendezvous: host it on this rank's node
            settings = dataclasses.replace(settings, master_address=ray.util.get_node_ip_address())
        post_write = None
        if settings.transport == "disk":  # slime's --custom-update-weight-post-write-path, with its args
            from train_backend.hooks import plugin_args
            from weight_sync.arguments import load_post_write_hook

            post_write = load_post_write_hook(plugin_args(self.train))
        self.sender = WeightSender(settings, version_sink=version_sink, post_write=post_write)
        self.sender.connect(engine_urls, engine_gpus)
        adapter = self.backend.adapter() if hasattr(self.backend, "adapter") else None
        if adapter is not None:  # LoRA: the rollouts name the adapter from the first one on (version 0)
            self.sender.push_adapter(*adapter, 0, record=False)

    def set_weight_sync_engines(self, engine_urls: list[str], engine_gpus: list[int]) -> None:
        """Rank 0: the engines the next push goes to (an elastic fleet). Others: nothing."""
        if self.sender is not None:
            self.sender.set_engines(engine_urls, engine_gpus)

    def push_weights(self, version: int, progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
        """Gather the full weights (collective on every rank); rank 0 pushes them to the engines
        (``progress``: ``WeightSender.push``'s). Gathered completely before the push starts, so a
        failing push never leaves the other ranks waiting in the middle of the gather."""
        t0 = time.perf_counter()
        adapter = self.backend.adapter() if hasattr(self.backend, "adapter") else None  # LoRA: only it travels
        named = list(self.backend.named_hf_weights()) if adapter is None else []
        gathered = time.perf_counter()
        metrics: dict[str, float] = {}
        if self.rank == 0:
            if self.sender is None:
                raise RuntimeError("push_weights: connect_weight_sync was not called")
            if adapter is not None:
                metrics = self.sender.push_adapter(*adapter, version)
            else:
                metrics = self.sender.push(named, version, progress)
            metrics.update({WEIGHT_GATHER_TIME.key: gathered - t0, WEIGHT_PUSH_RANK_TIME.key: time.perf_counter() - t0})
        del named  # the gathered copies (FSDP2, TP/PP) count in this phase, not the next
        if self.cuda:
            metrics.update(self._memory_phase("weight_sync"))
        if self.offload is not None:  # the engines generate next: the optimizer state waits on the host
            t0 = time.perf_counter()
            self.offload.offload()
            metrics["perf/offload_train_time"] = time.perf_counter() - t0
        return metrics if self.rank == 0 else {}

    def close(self) -> None:
        """Leave the weight-update group on the engines (rank 0) and the process group."""
        import torch.distributed as dist

        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerGroup:
    """N :class:`TrainerRank` actors driven together; the TrainBackend methods the launcher uses.

    A rank's error surfaces in the driver as one exception: a bad setting (``ValueError``, it
    names the flag) as itself, anything else as ``RuntimeError("trainer rank i: ...")``. The
    first failing rank is reported at once; the others may be stuck in a collective, so the
    group is then only good for :meth:`close`, which kills them.
    """

    def __init__(self, train: TrainSettings, megatron: "MegatronSettings | None" = None,
                 group: TrainerGroupSettings | None = None) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            raise RuntimeError("TrainerGroup needs Ray initialised (ray.init) in this process")
        self.settings = group or TrainerGroupSettings()
        self.settings.validate(train, megatron)
        self.world_size = self.settings.world_size
        self._broken = False
        self.pg = None
        options: list[dict[str, Any]] = [{"num_cpus": 0}] * self.world_size
        if self.settings.colocate:
            options = _colocated_options(self.world_size, train.device == "cuda")
        elif self.settings.uses_gpus(train):
            bundle = {"GPU": 1, "CPU": 1}
            self.pg = reserve_placement_group(
                [bundle] * self.world_size, "PACK", _PLACEMENT_TIMEOUT_S,
                f"{self.world_size} trainer rank(s) of {bundle} (--actor-num-nodes {self.settings.actor_num_nodes} x "
                f"--actor-num-gpus-per-node {self.settings.actor_num_gpus_per_node})")
            options = [{"num_cpus": 1, "num_gpus": 1, "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=i)} for i in range(self.world_size)]
        elif self.settings.actor_num_nodes > 1:  # CPU ranks: --actor-num-nodes distinct nodes, one bundle each
            self.pg = _spread_cpu_ranks(self.settings)
            per_node = self.settings.actor_num_gpus_per_node
            options = [{"num_cpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=i // per_node)} for i in range(self.world_size)]
        actor = ray.remote(TrainerRank)
        self.ranks = [actor.options(**options[i]).remote(i, self.world_size) for i in range(self.world_size)]
        try:
            master = self._gather([self.ranks[0].address.remote()], "start")[0]
            offload = self.settings.offloads(train)
            self._gather([r.setup.remote(master, train, megatron, offload, self.settings.offload_train_params)
                          for r in self.ranks], "setup")
        except BaseException:
            self.close()
            raise

    def placement(self) -> list[dict[str, Any]]:
        """Per rank: its node IP and the GPU ids Ray assigned (empty on the CPU)."""
        return self._gather([r.placement.remote() for r in self.ranks], "placement")

    # --- the TrainBackend methods the launcher uses ---------------------------------------------
    def train_step(self, groups: "list[list[Sample]] | PendingGet", step: int) -> dict[str, float]:
        """Train every rank on one rollout batch: rank 0 gets the groups and hands each
        data-parallel rank its share; returns rank 0's metrics.

        The groups go with rank 0's call as an argument: Ray sends a small one inside the call
        (no object-store round trip, as ``ray.put`` would take; only rank 0 reads them) and puts a
        large one into its store itself. A :class:`~buffer.retry.PendingGet` goes the same way and
        rank 0 fetches the groups from the buffer's answer (:meth:`TrainerRank.train_step`)."""
        return self._gather([r.train_step.remote(groups if i == 0 else None, step) for i, r in enumerate(self.ranks)],
                            "train_step")[0]

    def compute_log_probs(self, samples: list["Sample"]) -> list[list[float]]:
        """Collective: every rank gets the same samples; rank 0's result (all of them)."""
        import ray

        ref = ray.put(samples)
        return self._gather([r.compute_log_probs.remote(ref) for r in self.ranks], "compute_log_probs")[0]

    def save(self, path: str) -> None:
        self._gather([r.save.remote(path) for r in self.ranks], "save")

    def load(self, path: str) -> None:
        self._gather([r.load.remote(path) for r in self.ranks], "load")

    def export_hf(self, path: str) -> None:
        self._gather([r.export_hf.remote(path) for r in self.ranks], "export_hf")

    # --- weight sync ------------------------------------------------------------------------------
    def connect_weight_sync(self, settings: "WeightSyncSettings", engine_urls: list[str], engine_gpus: list[int],
                            version_sink: "VersionSink | ray.actor.ActorHandle | None" = None) -> None:
        """Rank 0 creates the WeightSender and joins the engines' weight-update group.
        ``engine_gpus[i]``: engine i's GPUs (a TP-2 SGLang engine joins as 2 ranks), from
        ``rollout_manager.engines.engine_gpus``. ``version_sink``: a ``VersionSink``, or the buffer's
        actor handle (recorded through ``buffer.retry.BufferVersionSink``)."""
        import ray

        if isinstance(version_sink, ray.actor.ActorHandle):
            from buffer.retry import BufferVersionSink

            version_sink = BufferVersionSink(version_sink, ray_timeout_s=settings.timeout_s)
        self._gather([self.ranks[0].connect_weight_sync.remote(settings, engine_urls, engine_gpus, version_sink)],
                     "connect_weight_sync")

    def set_weight_sync_engines(self, engine_urls: list[str], engine_gpus: list[int]) -> None:
        """The engines of an elastic fleet, for the next push (``WeightSender.set_engines``, on rank 0)."""
        self._gather([self.ranks[0].set_weight_sync_engines.remote(engine_urls, engine_gpus)], "set_weight_sync_engines")

    def push_weights(self, version: int, progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
        """Every rank gathers the full weights; rank 0 pushes them; returns its push metrics.
        ``progress(done, total)`` runs in rank 0's process after each bucket."""
        calls = [r.push_weights.remote(version, progress if i == 0 else None) for i, r in enumerate(self.ranks)]
        return self._gather(calls, "push_weights")[0]

    def close(self) -> None:
        """Leave the weight-update group (unless a rank failed: the others may be stuck in a
        collective), then end the rank processes and free their GPUs. Idempotent."""
        import ray
        from ray.util.placement_group import remove_placement_group

        ranks, self.ranks = getattr(self, "ranks", []), []
        if ranks and not self._broken:
            try:
                ray.get([r.close.remote() for r in ranks], timeout=120)
            except Exception as e:  # tearing down: report, and end the processes anyway
                print(f"trainer group close failed: {type(e).__name__}: {e}")
        for r in ranks:
            ray.kill(r)
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    # --- helpers ------------------------------------------------------------------------------
    def _gather(self, refs: list[Any], what: str) -> list[Any]:
        """Results in rank order; the first rank to fail raises at once (see the class doc)."""
        import ray

        rank_of = {ref: i for i, ref in enumerate(refs)}
        out: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            # the last one: its result is all that is left to wait for (no ray.wait round first)
            done, pending = ray.wait(pending, num_returns=1) if len(pending) > 1 else (pending, [])
            try:
                out[rank_of[done[0]]] = ray.get(done[0])
            except Exception as e:
                self._broken = True
                raise _rank_error(rank_of[done[0]], what, e) from e
        return out


def _spread_cpu_ranks(settings: TrainerGroupSettings) -> Any:
    """A placement group of one bundle per node of CPU ranks (``--actor-num-nodes``), each on a
    node of its own (STRICT_SPREAD). A bundle is a sliver of a CPU, as a CPU engine's: CPU ranks
    take no Ray resources (module docstring), so this only decides where they run; a node started
    with ``--num-cpus 0`` takes none of them."""
    import ray

    nodes, flag = settings.actor_num_nodes, flag_of(TrainerGroupSettings, "actor_num_nodes")
    with_cpus = sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0)
    if with_cpus < nodes:  # nothing on a CPU cluster adds nodes while we wait: say so now
        raise RuntimeError(f"{flag} {nodes} puts the CPU trainer ranks on {nodes} distinct nodes; the Ray cluster "
                           f"has {with_cpus} node(s) with CPUs (ray start --address ... on more nodes, or {flag} 1)")
    return reserve_placement_group([{"CPU": 0.01}] * nodes, "STRICT_SPREAD", _PLACEMENT_TIMEOUT_S,
                                   f"the CPU trainer ranks on {flag} {nodes} distinct nodes")


def _colocated_options(world_size: int, cuda: bool) -> list[dict[str, Any]]:
    """Ray options of colocated ranks: on this (the launcher's) node, where the engines run, and on
    CUDA rank i on GPU i (module docstring); no Ray resources (CPU ranks take none either)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return [{"num_cpus": 0, "scheduling_strategy": here,
             **({"runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": str(i)}}} if cuda else {})}
            for i in range(world_size)]


def _rank_error(rank: int, what: str, e: Exception) -> Exception:
    """One clear driver-side error for a failure in rank ``rank``."""
    import ray

    from buffer.ray_errors import creation_setting_error

    if isinstance(e, ray.exceptions.RayActorError):  # the process died (or its __init__ failed)
        setting = creation_setting_error(e)
        return setting if setting is not None else RuntimeError(f"trainer rank {rank} died during {what}: {e}")
    cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
    if isinstance(cause, ValueError):  # a bad setting found by the backend: its message names the flag
        return ValueError(str(cause))
    return RuntimeError(f"trainer rank {rank}: {what} failed: {type(cause).__name__}: {cause}")
