"""The buffer's command-line flags (slime's names where slime has one).

``--n-samples-per-prompt`` belongs to the rollout manager; it is read here to check group sizes.
"""

from __future__ import annotations

import argparse

from buffer.settings import STALE_POLICIES, BufferSettings, load_filter


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the buffer's flags; defaults come from ``BufferSettings``."""
    d = BufferSettings
    g = parser.add_argument_group("buffer")
    g.add_argument("--buffer-capacity", type=int, default=d.capacity,
                   help="groups the buffer holds; put waits while it is full (back-pressure)")
    g.add_argument("--buffer-put-timeout", type=float, default=d.put_timeout_s,
                   help="seconds a put waits for room before failing")
    g.add_argument("--buffer-get-timeout", type=float, default=d.get_timeout_s,
                   help="seconds a get waits for enough eligible groups before failing")
    g.add_argument("--max-weight-staleness", type=int, default=d.max_weight_staleness,
                   help="K: withhold groups whose oldest weight version is more than K behind the "
                        "current one (0 = strictly on-policy; unset = unbounded)")
    g.add_argument("--stale-policy", choices=STALE_POLICIES, default=d.stale_policy,
                   help="what happens to a group that broke the staleness bound: dropped, or returned "
                        "to the rollout side for regeneration")
    g.add_argument("--buffer-dir", default=d.persist_dir,
                   help="persist the buffer here (Arrow files): acknowledged groups survive crashes")
    g.add_argument("--buffer-filter-path", default=d.filter_path,
                   help="pop(args, rollout_id, buffer, num_samples) -> groups: picks the groups a get returns")
    g.add_argument("--buffer-fsync", action="store_true", default=d.fsync,
                   help="fsync every put and log record (survive a machine crash, not only a process crash)")


def settings_from_args(args: argparse.Namespace) -> BufferSettings:
    """Build and validate the buffer's settings; ``ValueError`` names the offending flag."""
    settings = BufferSettings(
        n_samples_per_prompt=args.n_samples_per_prompt,
        capacity=args.buffer_capacity,
        put_timeout_s=args.buffer_put_timeout,
        get_timeout_s=args.buffer_get_timeout,
        max_weight_staleness=args.max_weight_staleness,
        stale_policy=args.stale_policy,
        persist_dir=args.buffer_dir,
        filter_path=args.buffer_filter_path,
        fsync=args.buffer_fsync,
    )
    settings.validate()
    load_filter(settings)
    return settings
