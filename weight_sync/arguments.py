"""Command-line flags of weight_sync (slime's names where slime has one).

Defaults come from ``WeightSyncSettings``' field defaults, so each lives in one place.
``--hf-checkpoint`` belongs to the rollout manager; it is read here (the disk transport copies its
config and tokenizer next to the pushed weights).
"""

from __future__ import annotations

import argparse

from weight_sync.interfaces import BACKENDS, LOAD_FORMATS, PAUSE_MODES, TRANSPORTS, WeightSyncSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add weight_sync's flags to ``parser`` (in their own group)."""
    d = WeightSyncSettings
    g = parser.add_argument_group("weight sync")
    g.add_argument("--update-weight-transport", choices=TRANSPORTS, default=d.transport,
                   help="distributed: broadcast over a process group (nccl/gloo); disk: write an HF checkpoint "
                        "and POST /update_weights_from_disk")
    g.add_argument("--update-weight-backend", choices=BACKENDS, default=d.backend,
                   help="collective backend of the weight-update group (auto: nccl with CUDA, else gloo)")
    g.add_argument("--update-weight-buffer-size", type=int, default=d.bucket_bytes,
                   help="bytes per broadcast bucket")
    g.add_argument("--update-weight-load-format", choices=LOAD_FORMATS, default=d.load_format,
                   help="flattened_bucket: one flat tensor per bucket; tensor: one collective per tensor")
    g.add_argument("--update-weight-pause-mode", choices=PAUSE_MODES, default=d.pause_mode,
                   help="/pause_generation mode while weights change")
    g.add_argument("--update-weight-master-address", default=d.master_address,
                   help="address of trainer rank 0 that engines reach for the rendezvous")
    g.add_argument("--update-weight-master-port", type=int, default=d.master_port,
                   help="rendezvous port (0: pick a free one)")
    g.add_argument("--update-weight-group-name", default=d.group_name)
    g.add_argument("--update-weight-timeout", type=float, default=d.timeout_s,
                   help="seconds: bound on each HTTP call and collective of a push")
    g.add_argument("--update-weight-retries", type=int, default=d.retries,
                   help="times a failed push is redone on the engines still alive")
    g.add_argument("--check-weight-update-equal", action="store_true", default=d.check_equal,
                   help="after each push, check every engine's per-tensor checksums against the trainer's")
    g.add_argument("--update-weight-disk-dir", default=d.disk_dir,
                   help="directory for the disk transport's checkpoints (readable by the engines)")
    g.add_argument("--update-weight-disk-keep", type=int, default=d.disk_keep,
                   help="pushed checkpoints kept in --update-weight-disk-dir")


_FLAG_OF = {"transport": "--update-weight-transport", "backend": "--update-weight-backend",
            "bucket_bytes": "--update-weight-buffer-size", "load_format": "--update-weight-load-format",
            "pause_mode": "--update-weight-pause-mode", "master_port": "--update-weight-master-port",
            "group_name": "--update-weight-group-name", "timeout_s": "--update-weight-timeout",
            "retries": "--update-weight-retries", "disk_dir": "--update-weight-disk-dir",
            "disk_keep": "--update-weight-disk-keep", "hf_checkpoint": "--hf-checkpoint"}


def settings_from_args(args: argparse.Namespace) -> WeightSyncSettings:
    """Build and validate WeightSyncSettings; ValueError names the offending flag."""
    s = WeightSyncSettings(
        transport=args.update_weight_transport, backend=args.update_weight_backend,
        bucket_bytes=args.update_weight_buffer_size, load_format=args.update_weight_load_format,
        pause_mode=args.update_weight_pause_mode, master_address=args.update_weight_master_address,
        master_port=args.update_weight_master_port, group_name=args.update_weight_group_name,
        timeout_s=args.update_weight_timeout, check_equal=args.check_weight_update_equal,
        retries=args.update_weight_retries, disk_dir=args.update_weight_disk_dir,
        disk_keep=args.update_weight_disk_keep, hf_checkpoint=args.hf_checkpoint)
    try:
        s.validate()
    except ValueError as e:
        field = str(e).split(" ", 1)[0].rstrip(":")
        flag = _FLAG_OF.get(field)
        if flag is None:
            raise
        raise ValueError(f"{flag}: {e}") from None
    return s
