"""The built-in agent environment: a Python tool run in ``plugins.python_sandbox``.

For ``--agent-env`` (``rollout_manager/agent.py``)::

    --agent-env plugins.python_env.make_env                 # the run's --rm-type scores the episode
    --agent-env plugins.python_env.make_answer_env          # reward 1.0 when the final reply is the label
    --agent-env plugins.python_env.make_number_answer_env   # reward 1.0 when its final number is the label
    --agent-env plugins.python_env.make_number_answer_user_env  # the same, the tool's answer as a user turn
    --agent-env plugins.python_env.make_shaped_user_env     # the same, partial credit for printing the label
    --agent-env plugins.python_env.make_bare_answer_env     # make_answer_env without a system prompt
    --agent-env plugins.python_env.make_toy_tool_env        # the toy tool task's (the question as the variable q)

Each model turn that contains code (the last ```` ```python ```` fenced block, or ``<code>...</code>``)
runs it in a fresh sandboxed interpreter (``SandboxLimits()``: 10 s, 1 GiB, no network where the
machine allows it; never blocking the rollout's event loop). When the code's last statement is an
expression, its value is printed unless None, as in a notebook cell (``<code>37*48</code>`` answers
``1776``, ``print(1776)`` too, without a ``None`` after it).
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

__all__ = ["PYTHON_TOOL", "CODE_BLOCK_STOP", "PythonToolEnv", "extract_code", "as_cell", "make_env", "make_answer_env",
           "make_number_answer_env", "make_number_answer_user_env", "make_shaped_user_env",
           "make_bare_answer_env", "make_toy_tool_env"]

#: The tool's schema, given to the chat template (templates that render tools list it).
PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Run Python code; its printed output (or the value of its last expression) "
                                     "is returned.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
SYSTEM_PROMPT = ("You can run Python code: write it in a ```python code block and its output comes back to you. "
                 "When you know the answer, reply with the answer alone, without code.")
#: A stop string (``--rollout-stop``) that ends a model turn right after its closed code block, so the
#: model cannot ramble on past it. The opening ``` ```python\n``` does not hold it; a bare opening fence
#: after text (``\n```\n``) does, and ``PythonToolEnv.continue_turn`` then has the agent loop generate on
#: in the same turn. SGLang and the embedded engine match it on the decoded text; the rollout keeps it
#: in the reply (``no_stop_trim``), so ``extract_code`` finds the block.
CODE_BLOCK_STOP = "\n```\n"
_FENCED = re.compile(r"```(?:python3?|py)?\s*\n(.*?)```", re.S)
_TAGGED = re.compile(r"<code>(.*?)</code>", re.S)


def extract_code(reply: str) -> str | None:
    """The code of a reply: its last fenced block (``python``, ``python3``, ``py`` or no language),
    else its last ``<code>`` block; None."""
    for pattern in (_FENCED, _TAGGED):
        found = pattern.findall(reply)
        if found:
            return found[-1]
    return None


def as_cell(code: str) -> str:
    """``code`` with the value of its last statement printed when it is an expression and the value
    is not None (a notebook cell's rule: ``print(x)`` last shows x, not x and then ``None``); code
    that does not parse is left as it is (the sandbox reports its SyntaxError)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return code
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        shown = ast.parse("_cell_value = None\nif _cell_value is not None:\n    print(_cell_value)").body
        shown[0].value = tree.body[-1].value
        tree.body[-1:] = shown
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
    turn; a model never trained on a tool role may read a ``user`` turn better);
    ``tool_answer_reward`` (with ``answer_reward``): partial credit, in [0, 1), for the first tool
    turn of an episode whose output ``answer_matches`` the label (later ones earn nothing, so
    repeated calls cannot farm it); a right final answer then earns ``1.0`` less what the episode
    earned before, so an episode's total (the sum of its turn rewards) is 1.0 when the final answer
    is right, ``tool_answer_reward`` when only the tool's output was, else 0.0.

    With ``answer_reward`` every step's ``info`` says ``"correct"`` (``False`` on tool turns, the
    match on the final answer): the agent loop keeps it as ``sample.metadata["correct"]``, so
    ``eval/accuracy`` counts right final answers, not the partial credit."""

    def __init__(self, system_prompt: str | None = SYSTEM_PROMPT, answer_reward: bool = False,
                 limits: SandboxLimits | None = None, max_concurrency: int = 4, max_output_chars: int = 512,
                 preamble: Callable[[Any], str] | None = None,
                 answer_matches: Callable[[str, str], bool] = lambda reply, label: reply.strip() == label.strip(),
                 result_message: Callable[[str], dict] = lambda text: {"role": "tool", "content": text},
                 tool_answer_reward: float = 0.0):
        if not 0.0 <= tool_answer_reward < 1.0:
            raise ValueError(f"PythonToolEnv: tool_answer_reward {tool_answer_reward!r} must be in [0, 1)")
        if tool_answer_reward and not answer_reward:
            raise ValueError("PythonToolEnv: tool_answer_reward needs answer_reward=True (the run's reward scores "
                             "the episode otherwise)")
        self.tool_answer_reward = tool_answer_reward
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
            if not self.answer_reward:
                return [], True, None, {"tool_calls": 0}
            right = self._matches(reply, sample)
            reward = 1.0 - _episode_state(sample).get("earned", 0.0) if right else 0.0
            return [], True, reward, {"tool_calls": 0, "correct": right}
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
        if not self.answer_reward:
            return [self.result_message(text)], False, None, info
        # with answer_reward the episode's reward is the environment's alone: a tool turn scores 0 (or its
        # partial credit), so an episode cut off after a tool call is not scored by the run's rule (which
        # could read the tool's output)
        reward, state = 0.0, _episode_state(sample)
        if self.tool_answer_reward and "earned" not in state and result.ok and self._matches(text, sample):
            reward = state["earned"] = self.tool_answer_reward
        info["correct"] = False  # not answered yet: accuracy counts final answers only
        return [self.result_message(text)], False, reward, info

    def continue_turn(self, sample: Any, reply: str) -> bool:
        """A turn that a stop string (``--rollout-stop``, e.g. :data:`CODE_BLOCK_STOP`) ended inside an
        open code fence goes on (the agent loop generates on in it): the stop fired at an opening
        fence (a bare ``\\n```\\n`` after text), not at a block's close."""
        return reply.count("```") % 2 == 1

    def _matches(self, text: str, sample: Any) -> bool:
        return sample.label is not None and self.answer_matches(text, str(sample.label))


def _episode_state(sample: Any) -> dict:
    """The environment's per-episode dict, ``sample.metadata["agent"]["env"]`` (the agent loop's
    contract, ``rollout_manager/agent.py``: kept with the sample, emptied when the episode restarts)."""
    return sample.metadata.setdefault("agent", {}).setdefault("env", {})


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


def _output_as_user(text: str) -> dict:
    return {"role": "user", "content": OUTPUT_AS_USER.format(text)}


def make_number_answer_user_env(args: Any) -> PythonToolEnv:
    """``--agent-env`` factory: ``make_number_answer_env`` whose tool answers come back as a user
    turn (:data:`OUTPUT_AS_USER`), for chat models without a tool role. The SmolLM2 tool task
    (``examples/gpu/agent_smollm2_python_tool.yaml``)."""
    return PythonToolEnv(answer_reward=True, answer_matches=_number_matches,
                         result_message=_output_as_user)


#: The SmolLM2 tool task's partial credit for a tool turn that prints the product (``make_shaped_user_env``).
TOOL_ANSWER_REWARD = 0.2


def make_shaped_user_env(args: Any) -> PythonToolEnv:
    """``--agent-env`` factory: ``make_number_answer_user_env`` with a shaped reward,
    :data:`TOOL_ANSWER_REWARD` for the episode's first tool output whose last number is the label,
    the rest of 1.0 for a right final answer (see ``PythonToolEnv``). The SmolLM2 tool task
    (``examples/gpu/agent_smollm2_python_tool.yaml``): with the final answer alone rewarded its start
    policy succeeded in ~2.5% of episodes (2 of 36 first replies printed the product, 16 of 36 final
    replies copied it), too rare for GRPO to see in most groups; the credit rewards the half of the
    task it hits first (computing the product with the tool) and still leaves 0.8 for copying it.
    Under GRPO's per-group normalization a group whose best episode only printed the product pushes
    towards it as hard as one with a right answer; ``eval/accuracy`` still counts right final
    answers only (the steps' ``info["correct"]``)."""
    return PythonToolEnv(answer_reward=True, answer_matches=_number_matches, tool_answer_reward=TOOL_ANSWER_REWARD,
                         result_message=_output_as_user)


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
