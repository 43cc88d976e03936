"""bench/rollout_sglang: the rollout manager against calling the same real SGLang server directly.

    python bench/rollout_sglang.py          # on the GPU machine (SGLang importable, one GPU)

``bench/rollout.py``'s part (b) with one real SGLang server instead of embedded engines: a
0.5B-shaped llama with random weights (``--load-format dummy``) and the toy task's character
tokenizer (its 95 ids), so the GPU has real work and greedy answers run long; the toy task's
prompts with its chat template. Each repeat runs, rotated, the manager (group requests, the
default, and per-sample requests: router, rewards, grouping) and the same requests straight to
the server (per sample, and one batch request per group), the same number in flight
(``--inflight``), greedy, so every path generates the same tokens. ``ratio`` = direct time /
manager time (medians, group requests), target 0.95. Then SGLang's own offline throughput
(``sglang.Engine``, every request at once, no HTTP) on the same prompts and sampling parameters:
``manager_over_offline_tokens_s``. Writes ``bench/results/rollout_sglang.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--batch", type=int, default=64, help="groups per step")
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--inflight", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "rollout_sglang.json"))
    ap.add_argument("--no-offline", dest="offline", action="store_false",
                    help="skip SGLang's own offline throughput (sglang.Engine) on the same prompts")
    a = ap.parse_args(argv)
    import torch
    from transformers import LlamaConfig

    from scripts import make_toy_model
    from _fixtures_sglang import sglang_version, start_sglang, stop_sglang
    from sglang_protocol.net import free_port

    rollout = _load("bench_rollout", ROOT / "bench" / "rollout.py")
    ws = _load("bench_weight_sync", ROOT / "bench" / "weight_sync.py")
    work = Path(tempfile.mkdtemp(prefix="bench-rollout-sglang-"))
    toy = make_toy_model.main(["--out", str(work / "toy"), "--warmup-steps", "0"])
    model = work / "model"  # the 0.5B shapes, the toy tokenizer and its prompts
    model.mkdir()
    LlamaConfig(**{**ws.SETS["0.5B"], "vocab_size": 95}, max_position_embeddings=4096, tie_word_embeddings=False,
                architectures=["LlamaForCausalLM"], torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(model)
    make_toy_model.build_tokenizer(model)
    shutil.copytree(toy / "data", model / "data")
    port = free_port()
    proc = start_sglang(model, port, "--load-format", "dummy", "--dtype", "bfloat16", "--mem-fraction-static", "0.5",
                        log=work / "sglang.log")
    try:
        r = asyncio.run(rollout.part_b(model, 1, a.batch, a.n, a.max_len, a.repeats,
                                       engine_urls=[f"http://127.0.0.1:{port}"], per_engine=a.inflight))
    finally:
        stop_sglang(proc)
    prompts, params = r.pop("last_prompts"), r.pop("sampling_params")
    offline = offline_throughput(model, [p for p in prompts for _ in range(a.n)], params, a.repeats) \
        if a.offline else None
    ratio = r["direct_s"] / r["manager_group_s"]
    tokens_s = {p: a.batch * a.n * r["response_len_mean"] / r[f"{p}_s"] for p in rollout.B_PATHS}
    result = {"name": "rollout_sglang", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{torch.cuda.get_device_name()}, torch {torch.__version__}",
              "engine": "sglang", "engine_version": sglang_version(),
              "command": "python bench/rollout_sglang.py " + " ".join(argv or sys.argv[1:]),
              "metrics": {**r, "tokens_per_s": tokens_s, "inflight": a.inflight,
                          "ratio_sample": r["direct_s"] / r["manager_sample_s"],
                          "ratio_vs_batch": r["direct_batch_s"] / r["manager_group_s"],
                          "ratio_paired": statistics.median(x / y for x, y in zip(r["direct_runs_s"],
                                                                                   r["manager_group_runs_s"])),
                          "offline": offline,
                          "manager_over_offline_tokens_s": (tokens_s["manager_group"] / offline["tokens_per_s"]
                                                            if offline else None)},
              "ratio": ratio, "target": 0.95}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    for p in rollout.B_PATHS:
        print(f"{p:<16} {r[f'{p}_s']:.3f} s  {tokens_s[p]:9.0f} tokens/s  runs {r[f'{p}_runs_s']}")
    print(f"ratio direct/manager {ratio:.3f} (target 0.95); response length {r['response_len_mean']:.1f}; "
          f"wrote {a.out}")
    return result


def offline_throughput(model: Path, prompts: list[list[int]], params: dict, repeats: int) -> dict:
    """SGLang's own best on the same work: ``sglang.Engine`` (no HTTP, no router, every request at
    once) on the last step's prompts, each ``n`` times, the manager's sampling parameters; generated
    tokens per second, the median of ``repeats`` after a warm-up call."""
    import time

    import sglang

    from _fixtures_sglang import BUNDLE_FLAGS

    flags = dict(zip(BUNDLE_FLAGS[::2], BUNDLE_FLAGS[1::2]))
    engine = sglang.Engine(model_path=str(model), load_format="dummy", dtype="bfloat16", mem_fraction_static=0.5,
                           **{k.lstrip("-").replace("-", "_"): v for k, v in flags.items()})
    try:
        engine.generate(input_ids=prompts[:8], sampling_params=params)
        runs, tokens = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            out = engine.generate(input_ids=prompts, sampling_params=params)
            runs.append(time.perf_counter() - t)
            tokens.append(sum(o["meta_info"]["completion_tokens"] for o in out))
    finally:
        engine.shutdown()
    s = statistics.median(runs)
    return {"s": s, "runs_s": runs, "tokens": statistics.median(tokens), "tokens_per_s": statistics.median(tokens) / s,
            "requests": len(prompts)}


if __name__ == "__main__":
    main()
