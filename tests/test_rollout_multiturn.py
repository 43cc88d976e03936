"""The worked tool-use example (examples/multiturn/calculator_tool.py): model tokens trainable, tool
tokens masked, log-probs aligned. Loaded by path from its directory, as a user's own plugin is."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from _fixtures_rollout import running_manager, toy_argv
from transformers import AutoTokenizer

from buffer.sample import Status, check_sample

EXAMPLE_DIR = Path(__file__).resolve().parents[1] / "examples" / "multiturn"
if str(EXAMPLE_DIR) not in sys.path:  # what PYTHONPATH=examples/multiturn does for a run
    sys.path.insert(0, str(EXAMPLE_DIR))
from calculator_tool import MAX_TOOL_CALLS, calculator  # noqa: E402


def test_calculator_is_safe():
    assert calculator("12+7") == "19" and calculator("(2+3)*-4") == "-20"
    assert calculator("__import__('os')") == "error" and calculator("2**99999") == "error"
    assert calculator("1+") == "error"


def test_tool_calls_are_masked_from_the_loss(toy_model_dir):
    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    call_ids = tok("<calc>12+7</calc>", add_special_tokens=False)["input_ids"]
    result_ids = tok("<result>19</result>", add_special_tokens=False)["input_ids"]

    async def go():
        argv = toy_argv(toy_model_dir, "--rollout-engine", "instant", "--rollout-num-engines", "1",
                        "--engine-extra-args", f"--output-ids {','.join(map(str, call_ids))}",
                        "--custom-generate-function-path", "calculator_tool.generate",
                        "--n-samples-per-prompt", "2", "--rollout-batch-size", "2", "--rollout-max-response-len", "400",
                        "--tito-check", "fail")
        async with running_manager(argv) as m:
            return await m.generate(0)
    groups, metrics = asyncio.run(go())
    n_call, n_res = len(call_ids), len(result_ids)
    for s in (s for g in groups for s in g):
        check_sample(s)
        assert s.status == Status.COMPLETED and metrics["rollout/failed_frac"] == 0
        # the engine always calls the tool: MAX_TOOL_CALLS answered calls, then one unanswered
        turns = MAX_TOOL_CALLS + 1
        assert s.response_length == turns * n_call + MAX_TOOL_CALLS * n_res
        assert s.loss_mask == ([1] * n_call + [0] * n_res) * MAX_TOOL_CALLS + [1] * n_call
        assert s.rollout_log_probs == ([-0.5] * n_call + [0.0] * n_res) * MAX_TOOL_CALLS + [-0.5] * n_call
        assert s.response_tokens[:n_call + n_res] == call_ids + result_ids  # engine tokens kept as they came
        assert s.response.startswith("<calc>12+7</calc><result>19</result><calc>")
    # --tito-check fail: every sample checked against its engine calls; no hard error (the tool's raw
    # tokens have no chat-template turn log, so only the hard checks ran)
    assert metrics["rollout/tito/checked"] == 4 and not any(k in metrics for k in (
        "rollout/tito/unrecorded", "rollout/tito/mask_inside_engine", "rollout/tito/mask_outside_engine",
        "rollout/tito/not_append_only", "rollout/tito/prompt_mismatch"))
