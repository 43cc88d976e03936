"""The toy tool task (scripts/make_toy_model.py --tool-task) trained in process: the rollout manager
(embedded engines serving the toy model, the agent loop with the Python tool) and the torch trainer,
weights pushed to the engines from disk after each step. What tests/test_agent_toy_task.py runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

from _fixtures_rollout import make_args
from rollout_manager.manager import RolloutManager
from sglang_protocol.client import EngineClient
from train_backend import TrainSettings, create_backend


def tool_use(groups) -> float:
    """Share of samples whose episode called the tool at least once."""
    samples = [s for g in groups for s in g]
    return sum(s.metadata["agent"]["tool_calls"] > 0 for s in samples) / len(samples)


def train_tool_task(model: Path, work: Path, steps: int, prompts: int = 8, n: int = 8, lr: float = 3e-3,
                    seed: int = 1234) -> list[dict]:
    """``steps`` GRPO steps on the tool task; per step: reward mean, tool use, the agent metrics."""
    argv = ["--hf-checkpoint", str(model), "--prompt-data", str(model / "data" / "train.jsonl"),
            "--agent-env", "plugins.python_env.make_toy_tool_env",
            "--agent-max-turns", "2", "--rollout-max-response-len", "40", "--rollout-num-engines", "1",
            "--rollout-batch-size", str(prompts), "--n-samples-per-prompt", str(n), "--rollout-shuffle",
            "--rollout-seed", str(seed), "--seed", str(seed), "--rm-type", "exact_match"]
    args, settings = make_args(argv)
    settings.engines.weight_update_dirs = [str(work)]
    backend = create_backend(TrainSettings(hf_checkpoint=str(model), lr=lr, seed=seed))
    log: list[dict] = []

    async def go():
        manager = RolloutManager(settings, args, log_dir=str(work / "logs"))
        await manager.start()
        try:
            for step in range(steps):
                groups, metrics = await manager.generate(step)
                log.append({"reward": metrics["rollout/reward_mean"], "tool_use": tool_use(groups),
                            **{k: v for k, v in metrics.items() if k.startswith("rollout/agent/")}})
                await asyncio.to_thread(backend.train_step, groups, step)
                path = work / f"v{step + 1}"
                await asyncio.to_thread(backend.export_hf, str(path))
                for url in manager.engine_urls:
                    async with EngineClient(url, timeout=120) as c:
                        await c.update_weights_from_disk(str(path), weight_version=str(step + 1))
        finally:
            await manager.shutdown()
    asyncio.run(go())
    return log
