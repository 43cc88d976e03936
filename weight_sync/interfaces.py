"""Settings and small contracts of weight_sync (the trainer side of a weight push).

The sender speaks SGLang's weight-update HTTP API (docs/architecture.md; sglang_protocol/), so the same code drives real
SGLang servers and the embedded engine. Every default of weight_sync lives in
``WeightSyncSettings`` below; ``weight_sync/arguments.py`` maps slime-style flags onto it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Protocol, runtime_checkable

from flags import SettingError, flag

if TYPE_CHECKING:  # torch is imported where it is used: the launcher parses its flags without it
    import torch

TRANSPORTS = ("auto", "distributed", "disk", "tensor")
BACKENDS = ("auto", "gloo", "nccl")
LOAD_FORMATS = ("auto", "flattened_bucket", "tensor", "mapped")
PAUSE_MODES = ("abort", "retract", "in_place")
UPDATE_MODES = ("full", "delta")  # slime's --update-weight-mode
DELTA_ENCODINGS = ("xor", "overwrite")  # slime's --update-weight-delta-encoding (sglang_protocol/delta_weights.py)

#: What a push consumes: ``(hf_name, full tensor)`` pairs, e.g. ``backend.named_hf_weights()``.
NamedTensors = Iterable[tuple[str, "torch.Tensor"]]
#: The same, as a list (a push holds them all: validation needs them before anything is sent).
Named = list[tuple[str, "torch.Tensor"]]


@runtime_checkable
class VersionSink(Protocol):
    """Where a push records the weight version it installed, so that staleness is measured.

    Any callable ``f(version)`` is one (a test passes ``list.append``); the launcher passes the
    buffer's, ``buffer.retry.BufferVersionSink``, which calls the buffer actor's
    ``set_weight_version`` across its restart. Called once per successful push, on trainer rank 0,
    after every engine has the new weights."""

    def __call__(self, version: int) -> Any: ...


@dataclass
class WeightSyncSettings:
    """How weights travel from trainer rank 0 to the engines.

    transport: ``distributed`` (a process group: nccl on CUDA, gloo on CPU) or ``disk`` (write an
        HF checkpoint under ``disk_dir`` and POST ``/update_weights_from_disk``; for engines that
        share no collective fabric with the trainer, only a filesystem), or ``tensor`` (colocated:
        ``/update_weights_from_tensor`` with CUDA IPC handles to the trainer's buckets), or
        ``auto``: the launcher picks from where the trainer and the engines run
        (``weight_sync.arguments.resolve_transport``: ``tensor`` with ``--colocate``, else
        ``distributed``); a sender given ``auto`` without that knowledge uses ``distributed``.
    backend: ``auto`` picks ``nccl`` when CUDA is available, else ``gloo`` (the launcher resolves
        it at start-up from the trainer's and the engines' devices instead).
    bucket_bytes: the most bytes packed into one broadcast (a tensor larger than this travels
        alone). One HTTP round trip per bucket, so larger buckets cost fewer round trips and more
        memory (a bucket is a copy on the trainer and on every engine).
    load_format: ``auto`` (``mapped`` with the ``tensor`` transport, else ``flattened_bucket``),
        ``flattened_bucket`` (one flat tensor per bucket, one collective) or ``tensor``
        (one collective per tensor, no packing copy), or, with the ``tensor`` transport only,
        ``mapped``: the trainer's parameters (``torch.nn.Parameter`` objects, storage that stays put
        between pushes) go as handles to themselves in one request, and each engine holds them
        mapped between pushes (``sglang_protocol/held_weights.py``; engines must allow its loader
        with ``--custom-weight-loader``, which the engines a run starts do); other tensors travel
        in flattened buckets.
    pause_mode: SGLang's ``/pause_generation`` mode during a push: ``abort`` returns in-flight
        requests (partial rollouts resume them), ``in_place``/``retract`` keep them.
    master_address / master_port: the rendezvous that trainer rank 0 hosts (port 0: a free port).
    group_name: base name of the weight-update group (a generation suffix is added on reconnect).
    timeout_s: bound on every HTTP call and every collective of a push: a dead or stuck engine
        never holds the trainer longer than this.
    check_equal: after a push, compare every engine's weights with the trainer's: per-tensor
        checksums of every byte where the engine serves ``/weights_checksum`` (the embedded engine),
        else a read-back with SGLang's ``/get_weights_by_name`` (each tensor's leading rows, all of
        a tensor of up to 2^18 elements; llama-family models); ``connect`` refuses an engine with
        neither (``weight_sync/engines.py``).
    retries: how many times a failed push is redone (on the engines still alive) before raising.
    disk_dir: where the disk transport writes checkpoints (must be readable by the engines).
    disk_keep: how many pushed checkpoints to keep in ``disk_dir``.
    hf_checkpoint: the model's HF directory; the disk transport copies its config and tokenizer
        files next to the pushed weights so the written directory is a loadable checkpoint.
    api_key / admin_api_key: the engines' ``--api-key`` / ``--admin-api-key`` (SGLang requires the
        admin key on its weight-update endpoints once one is set); from ``--sglang-api-key`` /
        ``--sglang-admin-api-key``.
    engine_dtype: the dtype engines that do not list their parameters (SGLang has no
        ``/weights_info``) serve floating-point weights in, e.g. ``"bfloat16"``; the launcher
        derives it from ``--sglang-dtype`` and the model's config. A push casts each floating
        tensor to its engines' dtype while packing a bucket (a trainer keeping fp32 master weights
        sends half the bytes to a bf16 engine, and never holds a second full copy of the model);
        engines that list their parameters (``/weights_info``) are cast to the dtypes they report.
        None: such engines get the trainer's dtype and cast at load, as SGLang's loaders do.
    update_mode: ``full`` sends every value at every push; ``delta`` (the ``distributed`` and
        ``disk`` transports; ``tensor`` falls back to full, saying why) sends per bucket only the
        elements whose bits changed since the last push, in the engines' dtype
        (``weight_sync/delta.py``, ``sglang_protocol/delta_weights.py``). The sender keeps the last
        pushed copy (one copy of the model in the engines' dtype, on the device the buckets are
        packed on); an SGLang engine keeps one in host memory (``delta_weights.install``). A push
        is full when there is no such copy, every ``full_every`` pushes, after a failed push, and
        when an engine is not at the version the copy is of (restarted, resynced, new).
    full_every: with ``delta``, every this many pushes one is full (0: only when needed, see above).
    delta_encoding: ``xor`` (changed positions as gaps and XOR of the bits, byte planes, zlib; the
        smallest) or ``overwrite`` (positions and new values, uncompressed; applying it twice is harmless).
    engine_wait_s: how long a push that finds no live engine waits for a dead one to answer again
        before it fails (0: fail at once). The launcher sets it to ``--engine-startup-timeout``
        when its fleet restarts the engines it started (``--restart-dead-engines``), so losing the
        only engine costs that engine's restart, not the run.
    """

    transport: str = flag("auto", "auto: tensor with --colocate, else distributed; distributed: broadcast over a "
                          "process group (nccl/gloo); tensor: CUDA IPC handles to the trainer's buckets "
                          "(/update_weights_from_tensor; needs --colocate); disk: write an HF checkpoint and POST "
                          "/update_weights_from_disk", name="--update-weight-transport", choices=TRANSPORTS,
                          group="weight sync")
    backend: str = flag("auto", "collective backend of the weight-update group (auto: nccl when the trainer and the "
                        "engines are on GPUs of their own, else gloo)", name="--update-weight-backend",
                        choices=BACKENDS)
    bucket_bytes: int = flag(512 * 1024 ** 2, "bytes per broadcast bucket", name="--update-weight-buffer-size")
    load_format: str = flag("auto", "auto: mapped with the tensor transport, else flattened_bucket; "
                            "flattened_bucket: one flat tensor per bucket; tensor: one collective "
                            "(or handle) per tensor; mapped (transport tensor): the trainer's parameters as handles "
                            "the engines keep mapped between pushes, one request per push",
                            name="--update-weight-load-format", choices=LOAD_FORMATS)
    pause_mode: str = flag("abort", "/pause_generation mode while weights change", name="--update-weight-pause-mode",
                           choices=PAUSE_MODES)
    master_address: str = flag("127.0.0.1", "address of trainer rank 0 that engines reach for the rendezvous",
                               name="--update-weight-master-address")
    master_port: int = flag(0, "rendezvous port (0: pick a free one)", name="--update-weight-master-port")
    group_name: str = flag("reservoir_weight_sync", "name of the weight-update process group on the engines "
                           "(SGLang's group_name)", name="--update-weight-group-name")
    timeout_s: float = flag(120.0, "seconds: bound on each HTTP call and collective of a push",
                            name="--update-weight-timeout")
    check_equal: bool = flag(False, "after each push, compare every engine's weights with the trainer's "
                             "(the embedded engine: checksums of every tensor; SGLang: /get_weights_by_name "
                             "read-back of each tensor's leading rows, llama-family models; slow on large models: "
                             "SGLang turns each whole tensor into a Python list, ~6 min for a 7B)",
                             name="--check-weight-update-equal")
    retries: int = flag(1, "times a failed push is redone on the engines still alive", name="--update-weight-retries")
    disk_dir: str | None = flag(None, "directory for the disk transport's checkpoints (readable by the engines)",
                                name="--update-weight-disk-dir")
    disk_keep: int = flag(2, "pushed checkpoints kept in --update-weight-disk-dir", name="--update-weight-disk-keep")
    hf_checkpoint: str | None = flag(None, declared_elsewhere=True)
    update_mode: str = flag("full", "full: every push sends every value; delta (transports distributed and disk): "
                            "only the elements changed since the last push, in the engines' dtype (the trainer keeps "
                            "the last pushed copy; SGLang engines keep one in host memory)",
                            name="--update-weight-mode", choices=UPDATE_MODES)
    full_every: int = flag(10, "with --update-weight-mode delta: every N-th push is full (0: only the first push, "
                           "after a failure and after an engine restart)", name="--update-weight-full-every")
    delta_encoding: str = flag("xor", "with --update-weight-mode delta: xor (positions and XOR of the bits, "
                               "compressed; smallest) or overwrite (positions and new values)",
                               name="--update-weight-delta-encoding", choices=DELTA_ENCODINGS)
    api_key: str | None = None
    admin_api_key: str | None = None
    engine_dtype: str | None = None
    engine_wait_s: float = 0.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`flags.SettingError` naming the field of the first bad setting."""
        if self.transport not in TRANSPORTS:
            raise SettingError("transport", f"{self.transport!r}: expected one of {TRANSPORTS}")
        if self.backend not in BACKENDS:
            raise SettingError("backend", f"{self.backend!r}: expected one of {BACKENDS}")
        if self.load_format not in LOAD_FORMATS:
            raise SettingError("load_format", f"{self.load_format!r}: expected one of {LOAD_FORMATS}")
        if self.load_format == "mapped" and self.transport not in ("tensor", "auto"):
            raise SettingError("load_format", f"'mapped' needs the tensor transport (--colocate), not "
                                              f"{self.transport!r}")
        if self.pause_mode not in PAUSE_MODES:
            raise SettingError("pause_mode", f"{self.pause_mode!r}: expected one of {PAUSE_MODES}")
        if self.bucket_bytes <= 0:
            raise SettingError("bucket_bytes", f"{self.bucket_bytes}: must be > 0")
        if not 0 <= self.master_port <= 65535:
            raise SettingError("master_port", f"{self.master_port}: must be in [0, 65535]")
        if self.timeout_s <= 0:
            raise SettingError("timeout_s", f"{self.timeout_s}: must be > 0")
        if self.retries < 0:
            raise SettingError("retries", f"{self.retries}: must be >= 0")
        if self.disk_keep < 1:
            raise SettingError("disk_keep", f"{self.disk_keep}: must be >= 1")
        if self.transport == "disk" and not self.disk_dir:
            raise SettingError("disk_dir", "required when transport is 'disk'")
        if self.transport == "disk" and not self.hf_checkpoint:
            # the written checkpoint copies its config/tokenizer: engines that load with
            # from_pretrained (the embedded engine) need them next to the weights
            raise SettingError("hf_checkpoint", "required when transport is 'disk'")
        if not self.group_name:
            raise SettingError("group_name", "must not be empty")
        if self.update_mode not in UPDATE_MODES:
            raise SettingError("update_mode", f"{self.update_mode!r}: expected one of {UPDATE_MODES}")
        if self.delta_encoding not in DELTA_ENCODINGS:
            raise SettingError("delta_encoding", f"{self.delta_encoding!r}: expected one of {DELTA_ENCODINGS}")
        if self.full_every < 0:
            raise SettingError("full_every", f"{self.full_every}: must be >= 0")
        if self.engine_wait_s < 0:
            raise SettingError("engine_wait_s", f"{self.engine_wait_s}: must be >= 0")
        if self.engine_dtype is not None and not is_float_dtype(self.engine_dtype):
            raise SettingError("engine_dtype", f"{self.engine_dtype!r}: expected a floating-point dtype name")

    def resolved_load_format(self) -> str:
        """``load_format`` with ``auto`` resolved for this transport (:func:`resolve_load_format`)."""
        return resolve_load_format(self.load_format, self.resolved_transport())

    def resolved_transport(self) -> str:
        """``distributed``, ``disk`` or ``tensor`` (``auto`` without the launcher's resolution:
        ``distributed``, which works wherever the trainer and the engines run)."""
        return "distributed" if self.transport == "auto" else self.transport

    def resolved_backend(self) -> str:
        """``gloo`` or ``nccl`` (``auto``: nccl where CUDA is available)."""
        if self.backend != "auto":
            return self.backend
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor, as an engine reports it or the trainer pushes it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the ``torch.`` prefix, e.g. "bfloat16" (SGLang's form)

    @property
    def nbytes(self) -> int:
        import torch

        n = 1
        for s in self.shape:
            n *= s
        return n * getattr(torch, self.dtype).itemsize

    @staticmethod
    def of(name: str, t: "torch.Tensor") -> "TensorSpec":
        from sglang_protocol.buckets import dtype_name

        return TensorSpec(name, tuple(t.shape), dtype_name(t.dtype))


def resolve_load_format(load_format: str, transport: str, params_move: bool = False) -> str:
    """``auto`` -> ``mapped`` with the tensor transport (engines can hold the trainer's tensors),
    unless the trainer's parameters move between pushes (``--offload-train-params``), else
    ``flattened_bucket``; an explicit format is kept."""
    if load_format != "auto":
        return load_format
    return "mapped" if transport == "tensor" and not params_move else "flattened_bucket"


def is_float_dtype(name: str) -> bool:
    """Whether ``name`` (``"bfloat16"``, ``"torch.float32"``) names a floating-point torch dtype."""
    import torch

    dt = getattr(torch, str(name).removeprefix("torch."), None)
    return isinstance(dt, torch.dtype) and dt.is_floating_point
