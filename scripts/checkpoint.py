"""The driver's checkpoint: what it writes at a save step and reads back at ``--load``.

A checkpoint ``<--save>/step_<step>/`` holds the trainer ranks' state (``trainer/``, written by
the backend) and the driver's own state (``driver_state.json``): the step, the driver's RNGs, the
weight version the engines serve after it, the rollout manager's data position and the last
rollout whose put that position covers. ``<--save>/latest.json`` names the last complete one (both
files are written atomically, so a crash leaves the old checkpoint or the new one).

The buffer's consumption up to a step becomes final (``commit``) only once that step's checkpoint
exists; at resume the buffer goes back to the checkpoint's weight version and forgets the
rollouts it does not cover, which are generated again from the recorded data position.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from scripts.arguments import checkpoint_dir

from buffer.retry import call_buffer

STATE_FILE = "driver_state.json"
LATEST_FILE = "latest.json"
_ROLLOUT_PUT = re.compile(r"rollout-(\d+)")  # the put id of rollout k (rollout_manager's push)


def _rollout_of(put_id: str) -> int | None:
    """``k`` for the put id of rollout ``k``, else None (a put of someone else's)."""
    m = _ROLLOUT_PUT.fullmatch(put_id)
    return int(m.group(1)) if m else None


def commit_without_checkpoint(buffer: Any, step: int) -> dict[str, Any]:
    """A run without ``--save`` can never go back to an earlier step, so its consumption is final
    as each step ends (else every batch would stay leased in the buffer, and with --buffer-dir in
    its segments, for the whole run). Returns the buffer's metrics after the commit (the step's
    log wants them: one buffer call, not commit + metrics, nor known_put_ids + commit)."""
    return call_buffer(buffer, "commit", step, cover_known=True, return_metrics=True)


def save(save_dir: str, step: int, *, trainer: Any, buffer: Any, rollout: Any, producer: Any,
         first_rollout: int, save_hf: str | None) -> None:
    """Write step ``step``'s checkpoint under ``save_dir`` (and the HF export ``save_hf``, a
    ``{rollout_id}`` pattern, if set); then the buffer's consumption up to ``step`` is final.
    ``trainer``, ``buffer``, ``rollout``: the run's parts (None where the run has none);
    ``producer``: async mode's ``AsyncProducer`` (None in sync mode)."""
    path = Path(save_dir) / f"step_{step:06d}"
    if trainer is not None:
        trainer.save(str(path / "trainer"))
        if save_hf:
            trainer.export_hf(save_hf.format(rollout_id=step))
    # the driver's own RNGs; each trainer rank's are in its backend checkpoint (rng_<rank>.pt)
    state = {"step": step, "rng": _rng_state(), "weight_version": step + 1}
    puts = call_buffer(buffer, "known_put_ids") if buffer is not None else []
    if rollout is not None:
        state.update(_rollout_position(rollout, producer, step, puts, first_rollout))
    _write_json(path / STATE_FILE, state)
    _write_json(Path(save_dir) / LATEST_FILE, {"step": step, "path": str(path)})
    if buffer is not None:  # consumption up to `step` is final only now
        covered = [p for p in puts if (k := _rollout_of(p)) is not None and k <= state.get("rollouts_put", -1)]
        call_buffer(buffer, "commit", step, covered_put_ids=covered)


def _rollout_position(rollout: Any, producer: Any, step: int, put_ids: list[str],
                      first_rollout: int) -> dict[str, Any]:
    """The data position the checkpoint records, and the last rollout whose put it covers.

    Sync mode: rollout ``step`` was put, nothing runs. Async mode: the producer runs on; the
    buffer names the last rollout it stored (``put_ids``: the ids it knows), and the position
    is the one noted right after that put. Every group trained so far was put before, so it is
    covered; rollouts after it are forgotten by the buffer at resume and generated again from
    this position.
    """
    import ray

    if producer is None:
        return {"rollout": ray.get(rollout.state_dict.remote()), "rollouts_put": step}
    last = max((k for p in put_ids if (k := _rollout_of(p)) is not None), default=first_rollout - 1)
    return {"rollout": producer.position_after(last), "rollouts_put": last}


def resume(load_dir: str, *, trainer: Any, rollout: Any, buffer: Any, logger: Any) -> tuple[int, int]:
    """Load the checkpoint that ``load_dir`` (``--load``) names into the run's parts and the
    driver's RNGs; drop the metrics logged after it. Returns the step to start from and the first
    rollout to generate (the first the checkpoint does not cover)."""
    import ray

    path = checkpoint_dir(load_dir)
    state = json.loads((path / STATE_FILE).read_text())
    if trainer is not None:
        trainer.load(str(path / "trainer"))
    step = state["step"]
    covered = state.get("rollouts_put", step)  # checkpoints before "rollouts_put": sync mode's rule
    if rollout is not None and "rollout" in state:
        ray.get(rollout.load_state_dict.remote(state["rollout"]))
    if buffer is not None:
        # The buffer may be ahead of the checkpoint: later versions recorded, later rollouts
        # stored. Back to the checkpoint's version, and forget the rollouts it does not cover.
        forget = [p for p in call_buffer(buffer, "known_put_ids") if (k := _rollout_of(p)) is not None and k > covered]
        returned = call_buffer(buffer, "rewind", step, weight_version=state.get("weight_version", step + 1),
                               forget_put_ids=forget)
        print(f"resumed from {path}: step {step}, {returned} consumed-but-untrained groups back in the buffer, "
              f"{len(forget)} later rollout(s) to generate again", flush=True)
    _set_rng_state(state["rng"])
    dropped = logger.truncate_after(step)
    if dropped:
        print(f"metrics.jsonl: {dropped} record(s) after step {step} dropped (the resumed run logs them again)")
    return step + 1, covered + 1


def latest(save_dir: str | None) -> dict[str, Any] | None:
    """``{"step", "path"}`` of the last checkpoint under ``save_dir`` (``--save``), else None."""
    file = Path(save_dir or "", LATEST_FILE)
    return json.loads(file.read_text()) if save_dir and file.is_file() else None


def resume_hint(save_dir: str | None) -> str:
    """What to run after a failure: the last checkpoint and ``--load`` (exactly once from it)."""
    last = latest(save_dir)
    if last is None:
        return "no checkpoint was written (--save, --save-interval): a new run starts from the beginning"
    return f"the last checkpoint is step {last['step']}'s: add --load {save_dir} to resume from it"


def _rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": repr(random.getstate()), "numpy": [name, keys.tolist(), pos, has_gauss, cached]}
    if "torch" in sys.modules:  # the launcher imports no torch (components.Run._seed); if something did, its RNG too
        state["torch"] = sys.modules["torch"].get_rng_state().tolist()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(ast.literal_eval(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch" in state and "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _write_json(path: Path, obj: Any) -> None:
    """Atomic write: a crash leaves the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)
