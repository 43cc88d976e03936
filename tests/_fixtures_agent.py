"""Agent environments for the agent loop's tests (tests/test_agent_loop.py), loaded by path as
``--agent-env _fixtures_agent.<factory>``."""

from __future__ import annotations

import asyncio
from typing import Any

from rollout_manager.plugin_api import current_step

#: What the environments saw, for the tests to wait on and read (one process: the manager runs here).
SEEN: dict[str, Any] = {"steps": 0, "step_state": None, "replies": []}
TURN_REWARD = 0.25


class ScriptedEnv:
    """Answers every reply with one user message ``"ok<n>"``; done after ``turns`` model turns (never
    when ``turns`` is None), with ``TURN_REWARD`` per reply."""

    def __init__(self, turns: int | None):
        self.turns = turns

    async def start(self, sample):
        return None, None  # keep the sample's own prompt ids

    async def step(self, sample, reply):
        SEEN["steps"] += 1
        SEEN["step_state"] = current_step(None)
        SEEN["replies"].append(reply)
        n = sum(t["kind"] == "model" for t in sample.metadata["agent_turns"])
        done = self.turns is not None and n >= self.turns
        return ([] if done else [{"role": "user", "content": f"ok{n}"}]), done, TURN_REWARD


class MarkingEnv(ScriptedEnv):
    """``ScriptedEnv`` whose steps mark the answer right on the third model turn only (``info["correct"]``)."""

    async def step(self, sample, reply):
        messages, done, reward = await super().step(sample, reply)
        n = sum(t["kind"] == "model" for t in sample.metadata["agent_turns"])
        return messages, done, reward, {"correct": n >= 3}


def three_turns_marked(args):
    """Done after three model turns, the last one marked right."""
    return MarkingEnv(3)


def two_turns_marked(args):
    """Ended after two model turns (by --agent-max-turns 2), never marked right."""
    return MarkingEnv(None)


class ContinuingEnv(ScriptedEnv):
    """``ScriptedEnv`` (done after two model turns) whose ``continue_turn`` has a turn that ended without
    the template's close generate on once (while its reply holds the engine's answer once)."""

    def continue_turn(self, sample, reply):
        SEEN.setdefault("continue_asked", []).append(reply)
        return reply.count("2+2") == 1


def continuing(args):
    """Done after two model turns, each generated in two requests."""
    return ContinuingEnv(2)


def three_turns(args):
    """Done after three model turns."""
    return ScriptedEnv(3)


def endless(args):
    """Never done: the episode ends by a budget."""
    return ScriptedEnv(None)


def broken_factory(args):
    raise RuntimeError("no sandbox here\nsecond line")


class _NoStep:
    def start(self, sample):
        return None, None


def no_step(args):
    return _NoStep()


def reset_seen() -> None:
    SEEN.clear()
    SEEN.update(steps=0, step_state=None, replies=[])


async def wait_steps(n: int, timeout: float = 30.0) -> None:
    """Until the environments have stepped ``n`` times in all."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while SEEN["steps"] < n:
        if loop.time() > deadline:
            raise TimeoutError(f"environments stepped {SEEN['steps']}/{n} times")
        await asyncio.sleep(0.01)


class _QuickFirstGroup(ScriptedEnv):
    """Group 0: done after one turn, once group 1's samples have finished their first turn (so the
    step winds down while group 1 is in turn 2). Other groups: three turns."""

    def __init__(self):
        super().__init__(3)

    async def step(self, sample, reply):
        if sample.group_index == 0:
            while SEEN.setdefault("group1_steps", 0) < 2:
                await asyncio.sleep(0.01)
            SEEN["steps"] += 1
            return [], True, 1.0
        if sample.group_index == 1:
            SEEN["group1_steps"] = SEEN.get("group1_steps", 0) + 1
        return await super().step(sample, reply)


def quick_first_group(args):
    return _QuickFirstGroup()
