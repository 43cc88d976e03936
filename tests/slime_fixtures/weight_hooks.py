"""slime's ``--custom-update-weight-post-write-path`` in slime's style (written for the tests): a
"publish" step for a filesystem without read-after-write consistency. It records what it was given
and what the engines served at that moment (they must not have loaded the version yet), and marks
the directory published; ``args.fail_publish`` makes it raise, as a failed upload would."""

import json
import os
import urllib.request


def publish(args, version_dir, rollout_engines):
    if getattr(args, "fail_publish", False):
        raise OSError(f"upload of {version_dir} refused")
    served = []
    for url in rollout_engines:
        with urllib.request.urlopen(url + "/model_info", timeout=30) as resp:
            served.append(json.loads(resp.read())["weight_version"])
    event = {"version_dir": version_dir, "engines": list(rollout_engines), "served": served,
             "files": sorted(os.listdir(version_dir)), "tag": args.hook_tag}
    with open(os.path.join(version_dir, "PUBLISHED"), "w") as f:
        f.write("ok\n")
    with open(args.hook_log, "a") as f:
        f.write(json.dumps(event) + "\n")
