"""The on-policy distillation teacher (``--opd-teacher-url`` / ``--opd-teacher-load``).

slime's OPD with ``--opd-type sglang``: a teacher served by its own engine scores the tokens the
student sampled, and the trainer turns the difference of the two log-probs into a per-token
reverse-KL term of the advantages (``train_backend.losses.opd_advantages``). Here the teacher is
asked once per group, in SGLang's batch form: ``/generate`` with every sample's ``input_ids``
(prompt + response), ``max_new_tokens: 0``, ``return_logprob`` and ``logprob_start_len: 0``. The
answer's ``input_token_logprobs[1:]`` are the log-probs of tokens 1..L-1; the last
``response_length`` of them go to ``sample.teacher_log_probs``, as slime's
``slime/rollout/on_policy_distillation.py`` (``reward_func`` and ``post_process_rewards``) takes
them. SGLang (and the embedded engine) compute them from the raw logits: temperature 1.

``--opd-teacher-load`` starts the teacher as one more engine of ``--rollout-engine``'s kind, a
local process of the rollout manager outside the router, which no weight push reaches.
A teacher that cannot be reached at start-up is a one-line error naming its flag; a failed query
fails the samples of that group, counted under the reason ``opd teacher: <error>``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import subprocess
import time
from pathlib import Path

from buffer.sample import Sample, Status
from rollout_manager.engines import EnginePorts, engine_command
from rollout_manager.procenv import child_environ
from rollout_manager.settings import RolloutSettings
from sglang_protocol.client import EngineClient, EngineError, normalize_url
from sglang_protocol.net import pick_port

log = logging.getLogger(__name__)
_SCORED = (Status.COMPLETED, Status.TRUNCATED)


class Teacher:
    """An engine speaking SGLang's HTTP API that scores the student's samples."""

    def __init__(self, url: str, flag: str, client: EngineClient, process: subprocess.Popen | None = None):
        self.url, self.flag, self.client, self.process = url, flag, client, process

    @classmethod
    async def start(cls, settings: RolloutSettings, log_dir: str | Path) -> "Teacher | None":
        """Connect to ``--opd-teacher-url``, or start an engine of ``--opd-teacher-load`` and wait
        until it is healthy; None without either. ``ValueError`` names the flag when the teacher
        does not answer ``/health`` within ``--engine-startup-timeout``."""
        p, e = settings.plugins, settings.engines
        if not p.opd_teacher_url and not p.opd_teacher_load:
            return None
        process = None
        if p.opd_teacher_url:
            flag, url = "--opd-teacher-url", normalize_url(p.opd_teacher_url.removesuffix("/generate"))
        else:
            flag = "--opd-teacher-load"
            ports = EnginePorts(pick_port("127.0.0.1"))
            if e.rollout_engine == "sglang":
                ports = EnginePorts(ports.port, pick_port("127.0.0.1"), pick_port("127.0.0.1"), pick_port("127.0.0.1"))
            teacher = dataclasses.replace(settings, hf_checkpoint=p.opd_teacher_load)
            cmd, env = engine_command(teacher, e.rollout_num_engines, ports)
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            log_path = Path(log_dir) / "opd_teacher.log"
            with open(log_path, "ab") as out:
                process = subprocess.Popen(cmd, env=child_environ(env), stdout=out, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL)
            url = f"http://127.0.0.1:{ports.port}"
            log.info("opd teacher: started pid %d at %s (%s); log %s", process.pid, url, p.opd_teacher_load, log_path)
        client = EngineClient(url, timeout=settings.sampling.request_timeout, api_key=e.api_key)
        self = cls(url, flag, client, process)
        try:
            await self._wait_healthy(e.engine_startup_timeout, flag, p.opd_teacher_url or p.opd_teacher_load)
        except BaseException:
            await self.stop()
            raise
        return self

    async def _wait_healthy(self, timeout: float, flag: str, value: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ValueError(f"{flag} {value}: the teacher engine exited with code {self.process.returncode} "
                                 "at start-up (its log: opd_teacher.log in the logs directory)")
            if await self.client.health(timeout=2):
                return
            await asyncio.sleep(0.2)
        raise ValueError(f"{flag} {value}: the teacher engine at {self.url} did not answer /health within "
                         f"{timeout:.0f}s")

    async def score_group(self, group: list[Sample], temperature: float) -> None:
        """Set ``teacher_log_probs`` of the group's finished samples that have a response (one
        batched request); on a failure those samples are marked failed, with the reason."""
        from rollout_manager.rewards import mark_failed

        todo = [s for s in group if s.status in _SCORED and s.response_length > 0]
        if not todo:
            return
        body = {"input_ids": [list(s.tokens) for s in todo], "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0, "temperature": temperature, "skip_special_tokens": False}}
        try:
            out = await self.client.request("POST", "/generate", body)
            if not isinstance(out, list) or len(out) != len(todo):
                raise EngineError(self.url, None, f"expected {len(todo)} answers, got {type(out).__name__}")
            for s, answer in zip(todo, out):
                lps = [x[0] for x in answer["meta_info"]["input_token_logprobs"][1:]]
                if len(lps) != len(s.tokens) - 1:
                    raise EngineError(self.url, None, f"{len(lps)} input log-probs for {len(s.tokens)} tokens "
                                      "(does the engine honour logprob_start_len?)")
                s.teacher_log_probs = [float(x) for x in lps[len(lps) - s.response_length:]]
        except (EngineError, KeyError, TypeError, IndexError) as e:
            log.warning("%s %s failed on group %s: %s: %s", self.flag, self.url, todo[0].group_index,
                        type(e).__name__, e)
            for s in todo:
                s.teacher_log_probs = None
                mark_failed(s, f"opd teacher: {type(e).__name__}")

    async def stop(self) -> None:
        """Close the client; end the engine this started."""
        await self.client.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                await asyncio.to_thread(self.process.wait, 10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                await asyncio.to_thread(self.process.wait, 10)
