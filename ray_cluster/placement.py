"""Placement groups reserved with a bound on the wait."""

from __future__ import annotations

from typing import Any


def reserve_placement_group(bundles: list[dict[str, float]], strategy: str, timeout: float, what: str) -> Any:
    """A Ray placement group of ``bundles`` (``strategy``: PACK, STRICT_SPREAD, ...), once Ray has
    reserved every bundle. Ray waits for resources forever; after ``timeout`` seconds the group is
    removed and a ``RuntimeError`` says ``could not place <what>`` with the cluster's resources, so
    a cluster short of GPUs or nodes fails the run with a reason instead of hanging it."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([dict(b) for b in bundles], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(f"could not place {what} within {timeout:.0f}s; "
                           f"cluster resources: {ray.cluster_resources()}") from None
    return pg
