"""The built-in agent environment: a Python tool run in ``plugins.python_sandbox``.

For ``--agent-env`` (``rollout_manager/agent.py``)::

    --agent-env plugins.python_env.make_env                 # the run's --rm-type scores the episode
    --agent-env plugins.python_env.make_answer_env          # reward 1.0 when the final reply is the label
    --agent-env plugins.python_env.make_number_answer_env   # reward 1.0 when its final number is the label
    --agent-env plugins.python_env.make_number_answer_user_env  # the same, the tool's answer as a user turn
    --agent-env plugins.python_env.make_bare_answer_env     # make_answer_env without a system prompt
    --agent-env plugins.python_env.make_toy_tool_env        # the toy tool task's (the question as the variable q)

Each model turn that contains code (the last ```` ```python ```` fenced block, or ``<code>...</code>``)
runs it in a fresh sandboxed interpreter (``SandboxLimits()``: 10 s, 1 GiB, no network where the
machine allows it; never blocking the rollout's event loop). When the code's last statement is an
expression, its value is printed, as in a notebook cell (``<code>37*48</code>`` answers ``1776``).
The tool's answer (stdout; on failure the last line of stderr, or the limit that stopped it) comes
back as one ``tool`` message (or what ``result_message`` makes of it), at most ``max_output_chars``
characters. A turn without code is the final answer: the episode ends (``make_answer_env`` rewards
it against ``sample.label``).
"""

from __future__ import annotations

import ast
import re
from typing import Any, Callable

from plugins.math_answers import answers_match, extract_answer
from plugins.python_sandbox import PythonSandbox, SandboxLimits

__all__ = ["PYTHON_TOOL", "PythonToolEnv", "extract_code", "as_cell", "make_env", "make_answer_env",
           "make_number_answer_env", "make_number_answer_user_env", "make_bare_answer_env", "make_toy_tool_env"]

#: The tool's schema, given to the chat template (templates that render tools list it).
PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Run Python code; its printed output (or the value of its last expression) "
                                     "is returned.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
SYSTEM_PROMPT = ("You can run Python code: write it in a ```python code block and its output comes back to you. "
                 "When you know the answer, reply with the answer alone, without code.")
_FENCED = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)
_TAGGED = re.compile(r"<code>(.*?)</code>", re.S)


def extract_code(reply: str) -> str | None:
    """The code of a reply: its last fenced python block, else its last ``<code>`` block; None."""
    for pattern in (_FENCED, _TAGGED):
        found = pattern.findall(reply)
        if found:
            return found[-1]
    return None


def as_cell(code: str) -> str:
    """``code`` with its last statement printed when it is an expression (a notebook cell's rule);
    code that does not parse is left as it is (the sandbox reports its SyntaxError)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return code
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body[-1]
        tree.body[-1] = ast.Expr(ast.Call(ast.Name("print", ast.Load()), [last.value], []))
        ast.fix_missing_locations(tree)
        return ast.unparse(tree)
    return code


class PythonToolEnv:
    """An agent environment (``start`` / ``step``, see ``rollout_manager/agent.py``) with one tool:
    the sandboxed Python interpreter.

    ``system_prompt``: the first message (None: none; the sample's prompt follows as the user's
    message); ``answer_reward``: reward the final reply 1.0 when ``answer_matches(reply, label)``
    (default: equal after stripping), else 0.0, and each tool turn 0.0 (False: no reward from the
    environment, the run's reward scores it);
    ``limits`` / ``max_concurrency``: the sandbox's; ``preamble(sample)``: code run before the
    model's in the same interpreter, unseen by the model (the task's inputs as variables);
    ``result_message(text)``: the message that brings the tool's answer back (default a ``tool``
    turn; a model never trained on a tool role may read a ``user`` turn better)."""

    def __init__(self, system_prompt: str | None = SYSTEM_PROMPT, answer_reward: bool = False,
                 limits: SandboxLimits | None = None, max_concurrency: int = 4, max_output_chars: int = 512,
                 preamble: Callable[[Any], str] | None = None,
                 answer_matches: Callable[[str, str], bool] = lambda reply, label: reply.strip() == label.strip(),
                 result_message: Callable[[str], dict] = lambda text: {"role": "tool", "content": text}):
        self.system_prompt = system_prompt
        self.result_message = result_message
        self.answer_matches = answer_matches
        self.preamble = preamble
        self.answer_reward = answer_reward
        self.sandbox = PythonSandbox(limits, max_concurrency=max_concurrency)
        self.max_output_chars = max_output_chars

    async def start(self, sample: Any) -> tuple[list[dict], list[dict]]:
        """The system prompt (if any) and the sample's prompt; the Python tool's schema."""
        prompt = sample.prompt
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if self.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages, [PYTHON_TOOL]

    async def step(self, sample: Any, reply: str) -> tuple[list[dict], bool, float | None, dict]:
        """Run the reply's code (a tool message back), or end the episode on a reply without code."""
        code = extract_code(reply)
        if code is None:
            reward = None
            if self.answer_reward:
                reward = 1.0 if sample.label is not None and self.answer_matches(reply, str(sample.label)) else 0.0
            return [], True, reward, {"tool_calls": 0}
        cell = as_cell(code)
        if self.preamble is not None:
            cell = self.preamble(sample) + "\n" + cell
        result = await self.sandbox.run(cell)
        if result.ok:
            text = result.stdout
        elif result.killed_reason is not None:
            text = f"error: {result.killed_reason}"
        else:
            lines = result.stderr.strip().splitlines()
            text = lines[-1] if lines else f"error: exit code {result.exit_code}"
        text = text.strip()[:self.max_output_chars]
        info = {"tool_calls": 1, "tool_errors": 0 if result.ok else 1, "tool_time_s": [result.wall_s]}
        # with answer_reward the episode's reward is the environment's alone: a tool turn scores 0, so an
        # episode cut off after a tool call is not scored by the run's rule (which could read the tool's output)
        return [self.result_message(text)], False, 0.0 if self.answer_reward else None, info


def make_env(args: Any) -> PythonToolEnv:
    """``--agent-env`` factory: the Python tool, no reward of its own (the run's reward scores it)."""
    return PythonToolEnv()


def make_answer_env(args: Any) -> PythonToolEnv:
    """``--agent-env`` factory: the Python tool; the final reply is rewarded against the label."""
    return PythonToolEnv(answer_reward=True)


def _number_matches(reply: str, label: str) -> bool:
    return answers_match(extract_answer(reply), label)


def make_number_answer_env(args: Any) -> PythonToolEnv:
    """``--agent-env`` factory: the Python tool; the final reply is rewarded when its final answer
    (its last ``\\boxed{}`` or last number, ``--rm-type math``'s rule) equals the label, so
    ``"The answer is 28454."`` counts."""
    return PythonToolEnv(answer_reward=True, answer_matches=_number_matches)


#: How the SmolLM2 tool task brings the tool's output back: as a user turn that asks for the number.
#: SmolLM2-135M-Instruct was not trained on a ``tool`` role: given a right tool answer as a ``tool``
#: turn, 3 of 36 sampled final replies held it; as this user turn, 16 of 36 (CPU probe, 2026-12-05).
OUTPUT_AS_USER = "The code printed: {}\nReply with the number alone."


def make_number_answer_user_env(args: Any) -> PythonToolEnv:
    """``--agent-env`` factory: ``make_number_answer_env`` whose tool answers come back as a user
    turn (:data:`OUTPUT_AS_USER`), for chat models without a tool role. The SmolLM2 tool task
    (``examples/gpu/agent_smollm2_python_tool.yaml``)."""
    return PythonToolEnv(answer_reward=True, answer_matches=_number_matches,
                         result_message=lambda text: {"role": "user", "content": OUTPUT_AS_USER.format(text)})


def make_bare_answer_env(args: Any) -> PythonToolEnv:
    """``--agent-env`` factory: ``make_answer_env`` without a system prompt, for a model trained to
    call the tool (the toy tool task of ``scripts/make_toy_model.py --tool-task``)."""
    return PythonToolEnv(system_prompt=None, answer_reward=True)


def make_toy_tool_env(args: Any) -> PythonToolEnv:
    """``--agent-env`` factory of the toy tool task (``scripts/make_toy_model.py --tool-task``):
    ``make_bare_answer_env`` whose code finds the question (``"37*48"`` of the prompt ``"37*48="``)
    in the variable ``q``."""
    return PythonToolEnv(system_prompt=None, answer_reward=True,
                         preamble=lambda sample: f"q = {str(sample.prompt).rstrip('=')!r}")
