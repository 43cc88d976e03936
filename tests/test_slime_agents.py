"""slime's agent examples, unchanged, against Reservoir's contract (issue 26): search-r1's
``generate_with_search.py`` (with its ``qa_em_format.py`` reward and ``local_search_server.py``
client, verbatim in ``slime_fixtures/``) runs as ``--custom-generate-function-path`` and
``--custom-rm-path`` with ``--tito-check warn``. The retriever is a stub: a real HTTP server on
127.0.0.1 answering the retrieval API that slime's client calls (``POST /retrieve``
``{"queries", "topk", "return_scores"}`` -> ``{"result": [[{"id", "contents"}]]}``, the corpus rows
that slime's ``local_dense_retriever/retrieval_server.py`` returns and its client reads; the client's
comment says ``{"document": {"contents"}}``, which it would read as empty) with fixed passages. slime imports its example's siblings by bare name (``from qa_em_format
import ...``: slime runs with the example directory on ``PYTHONPATH``), so the test puts
``slime_fixtures/`` on ``sys.path`` the same way."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from _fixtures_rollout import running_manager, toy_argv

FIXTURES = Path(__file__).resolve().parent / "slime_fixtures"
ANSWER = "<search> Paris </search>"  # the instant engine's answer to every turn
PASSAGES = ["Paris\nParis is the capital of France.", "Seine\nThe Seine flows through Paris.",
            "Louvre\nThe Louvre is a museum in Paris."]


class _Retriever(BaseHTTPRequestHandler):
    """The retrieval server's API as slime's ``local_search`` calls it; records each request."""

    requests: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        docs = [{"id": str(i), "contents": PASSAGES[i]} for i in range(min(body["topk"], len(PASSAGES)))]
        out = json.dumps({"result": [docs for _ in body["queries"]]}).encode()
        self.send_response(200 if self.path == "/retrieve" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


@pytest.fixture
def retriever():
    """A retrieval stub on a free port of 127.0.0.1 (its own thread, not the rollout's loop)."""
    _Retriever.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Retriever)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def search_r1(retriever, monkeypatch):
    """slime's search-r1 module, pointed at the stub through its own config dict (what slime's
    README has a user edit), with ``slime_fixtures/`` on the path as slime's run script does."""
    import importlib

    import slime_compat

    monkeypatch.syspath_prepend(str(FIXTURES))
    slime_compat.install()
    mod = importlib.import_module("generate_with_search")
    monkeypatch.setitem(mod.SEARCH_R1_CONFIGS["local"], "search_url", retriever)
    return mod


def _data(tmp_path: Path) -> Path:
    # search-r1's records: a question and {"ground_truth": {"target": [answers]}} (qa_em_format's label)
    path = tmp_path / "nq.jsonl"
    # short questions: the toy model's context is 256 character tokens, and search-r1's
    # invalid-action observation alone is about 200 (a longer prompt gets the engine's 400)
    rows = [{"prompt": [{"role": "user", "content": f"Q{i}: capital of France?"}],
             "label": {"ground_truth": {"target": ["Paris"]}}} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_slimes_search_client_reads_the_stub(search_r1):
    """slime's own search path (parse the action, call the retriever, format the passages)."""
    obs, done = asyncio.run(search_r1.execute_predictions("<search> capital of France </search>"))
    assert not done and obs.startswith("\n\n<information>Doc 1(Title: Paris) Paris is the capital")
    assert _Retriever.requests == [{"queries": ["capital of France"], "topk": 3, "return_scores": False}]


def test_search_r1_runs_unchanged_with_tito_check_warn(toy_model_dir, tmp_path, search_r1):
    """Two rollouts of 2 groups x 2 samples. The instant engine answers every turn with a search
    (the toy model's text never holds one), so each sample takes slime's 2 turns: answer, search
    via the stub, retrieved passages appended untrained, answer, search again (max_turns). Every
    group is produced once, and --tito-check checks every sample against its engine calls."""
    argv = toy_argv(toy_model_dir, "--prompt-data", str(_data(tmp_path)), "--rollout-engine", "instant",
                    "--rollout-num-engines", "1", "--engine-extra-args", f"--output-text '{ANSWER}'",
                    "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "32",
                    "--custom-generate-function-path", "generate_with_search.generate",
                    "--custom-rm-path", "generate_with_search.reward_func", "--tito-check", "warn")

    async def go():
        async with running_manager(argv) as m:
            return [await m.generate(r) for r in range(2)]
    steps = asyncio.run(go())
    seen = []
    for groups, metrics in steps:
        assert len(groups) == 2 and all(len(g) == 2 for g in groups)
        seen += [g[0].group_index for g in groups]
        for s in (s for g in groups for s in g):
            assert s.status == "completed" and s.reward == 0  # a search each turn, never an answer
            assert s.response.count(ANSWER) == 2 and s.response.count("<information>Doc 1(Title: Paris)") == 2
            assert len(s.loss_mask) == s.response_length == len(s.rollout_log_probs)
            n = len(ANSWER)  # the toy tokenizer is one token a character
            # answer (trained), passages (not), answer, passages: slime appends the last turn's
            # search results too, after which max_turns ends the loop
            runs = [(k, len(list(g))) for k, g in itertools.groupby(s.loss_mask)]
            assert [k for k, _ in runs] == [1, 0, 1, 0] and runs[0][1] == runs[2][1] == n, runs
        # every sample checked against its two engine calls (the text prompts tokenized as the
        # engine does): nothing found
        assert {k: v for k, v in metrics.items() if "tito" in k} == {"rollout/tito/checked": 4}
    assert sorted(seen) == [0, 1, 2, 3]  # every group produced once
    assert len(_Retriever.requests) == 16 and {r["queries"][0] for r in _Retriever.requests} == {"Paris"}


# --- retool: generate_with_retool.py + tool_sandbox.py ------------------------------------------
CODE = "<code>print(6*7)</code>"  # the instant engine's answer to every turn: run code


@pytest.fixture
def retool(monkeypatch):
    """slime's retool module (``slime_fixtures/`` on the path, as slime's run script puts the
    example's), with 2 tool calls a sample instead of 16 (its config dict), and its sandbox's
    ``subprocess.Popen`` watched: each run records the manager loop's heartbeat count before and
    after its blocking ``communicate``."""
    import importlib
    import subprocess

    import slime_compat

    monkeypatch.syspath_prepend(str(FIXTURES))
    slime_compat.install()
    mod = importlib.import_module("generate_with_retool")
    sandbox = importlib.import_module("tool_sandbox")
    monkeypatch.setitem(sandbox.TOOL_CONFIGS, "max_tool_calls", 2)
    runs: list[tuple[int, int]] = []
    beats, blocked = [0], []

    class Watched(subprocess.Popen):
        def communicate(self, *a, **k):
            before, t0 = beats[0], time.monotonic()
            out = super().communicate(*a, **k)
            runs.append((before, beats[0]))
            blocked.append(time.monotonic() - t0)
            return out
    monkeypatch.setattr(sandbox.subprocess, "Popen", Watched)
    return mod, runs, beats, blocked


def test_retool_runs_unchanged_and_its_sandbox_blocks_the_managers_loop(toy_model_dir, retool):
    """slime's retool with --tito-check warn: every sample runs its code twice in slime's sandbox
    (a python3 subprocess) and is checked against its engine calls. The sandbox waits for the
    subprocess with a blocking ``Popen.communicate`` inside ``async def``: while it runs, the
    rollout manager's event loop (engine calls, other samples, heartbeats) stands still."""
    mod, runs, beats, blocked = retool
    argv = toy_argv(toy_model_dir, "--rollout-engine", "instant", "--rollout-num-engines", "1",
                    "--engine-extra-args", f"--output-text '{CODE}'", "--rollout-batch-size", "2",
                    "--n-samples-per-prompt", "2", "--rollout-max-response-len", "32",
                    "--rollout-max-context-len", "4096", "--reward-key", "score",
                    "--custom-generate-function-path", "generate_with_retool.generate",
                    "--custom-rm-path", "generate_with_retool.reward_func", "--tito-check", "warn")

    async def heartbeat():
        while True:
            beats[0] += 1
            await asyncio.sleep(0.001)

    async def go():
        async with running_manager(argv) as m:
            ticker = asyncio.create_task(heartbeat())
            try:
                return [await m.generate(r) for r in range(2)]
            finally:
                ticker.cancel()
    steps = asyncio.run(go())
    seen = []
    for groups, metrics in steps:
        assert len(groups) == 2 and all(len(g) == 2 for g in groups)
        seen += [g[0].group_index for g in groups]
        for s in (s for g in groups for s in g):
            assert s.status == "completed" and s.tool_call_count == 2
            assert s.response.count("<interpreter>\nOutput:\n42\n</interpreter>") == 2, s.response
            assert s.reward["score"] == -1.0  # no boxed answer (math_dapo), tool bonus (2-2)/2*0.1 = 0
            assert len(s.loss_mask) == s.response_length == len(s.rollout_log_probs)
        print({k: v for k, v in metrics.items() if "tito" in k})
        assert metrics["rollout/tito/checked"] == 4
    assert sorted(seen) == [0, 1, 2, 3]
    assert len(runs) == 16  # 2 rollouts x 4 samples x 2 tool calls
    # no heartbeat while any sandbox run waited: the loop was blocked for each run's whole length
    assert beats[0] > len(runs) and all(after == before for before, after in runs), (beats, runs)
    print(f"sandbox runs {len(runs)}, loop blocked {sum(blocked):.3f}s in all, longest {max(blocked):.3f}s")
