"""Issue 16 item 6: a run's Ray cluster is not an open door. Ray always starts a dashboard agent
whose ``POST /api/job_agent/jobs/`` runs a shell command; started the way every run starts Ray
(``scripts.components.start_ray``) on a fresh machine (no token yet, ``RAY_AUTH_MODE`` unset),
that agent must refuse a submission without the token, and the command must not run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent("""
    import json, sys, urllib.error, urllib.request
    sys.path.insert(0, sys.argv[1])
    import ray
    from scripts.components import start_ray

    start_ray(None)
    port = ray._private.worker._global_node.dashboard_agent_listen_port
    base = f"http://127.0.0.1:{port}"

    def call(method, path, body=None, token=None):
        req = urllib.request.Request(base + path, method=method, data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {token}"} if token else {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    job = {"entrypoint": f"touch {sys.argv[2]}", "submission_id": "probe"}
    from pathlib import Path
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    print(json.dumps({"without_token": call("POST", "/api/job_agent/jobs/", job),
                      "with_token": call("GET", "/api/job_agent/jobs/nope/logs", token=token)}))
    ray.shutdown()
""")


def test_job_agent_refuses_unauthenticated_job_submission(tmp_path):
    marker = tmp_path / "ran"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env["HOME"] = str(tmp_path / "home")  # a fresh machine: no token yet
    proc = subprocess.run([sys.executable, "-c", PROBE, str(ROOT), str(marker)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    status = json.loads(proc.stdout.strip().splitlines()[-1])
    assert status["without_token"] == 401, status  # refused: no token
    assert status["with_token"] != 401, status  # the agent is up and the token opens it (the test can fail)
    assert not marker.exists()
    assert (tmp_path / "home" / ".ray" / "auth_token").is_file()  # generated on first use
