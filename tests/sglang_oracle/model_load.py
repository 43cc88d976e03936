"""SGLang's own model classes on the CPU, loading held pushes: the oracle of the held-weights replay
(``sglang_protocol/load_replay.py``, ``tests/test_sglang_load_replay.py``).

    python tests/sglang_oracle/model_load.py --arch llama --tp 2 --rank R --port P --out DIR

One TP rank (run ``--tp`` of them with the same ``--port``): SGLang 0.5.23's parallel groups
(gloo), its ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` in bf16 (its QKV/gate-up stacking, its
TP sharding, its padded vocabulary) built twice: the engine's model, loaded through
``held_weights.load_and_hold`` with the trainer's fp32 parameters packed as a held push, and a
reference, loaded by SGLang's ``load_weights`` alone with the same tensors. Three pushes of the
same storages, the trainer's values changed in place between them (an optimizer step); after
each, every parameter of the two models is compared. Writes ``rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def sglang_model(arch: str, model_dir: Path, rank: int, tp: int, port: int):
    """SGLang's model class for ``arch`` built on this rank after SGLang's own parallel set-up."""
    import torch

    from sglang_oracle import import_sglang

    sg = import_sglang()
    server_args = sg.server_args.prepare_server_args(["--model-path", str(model_dir), "--device", "cpu",
                                                      "--skip-tokenizer-init", "--tp-size", str(tp)])
    sg.server_args.set_global_server_args_for_scheduler(server_args)
    import sglang.srt.runtime_context as rc
    from sglang.srt.distributed import bootstrap

    rc.publish(server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=rank, gpu_id=0))
    bootstrap._init_parallel_groups(backend="gloo", dist_init_method=f"tcp://127.0.0.1:{port}",
                                    server_args=server_args, gpu_id=0)
    import sglang.srt.layers.rotary_embedding.base as rotary

    rotary._is_cpu = True  # its CUDA kernels are not here; the rotary table is not under test
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if arch == "llama":
        from sglang.srt.models.llama import LlamaForCausalLM as cls
    else:
        from sglang.srt.models.qwen2 import Qwen2ForCausalLM as cls
    torch.set_default_dtype(torch.bfloat16)  # the engine's dtype; the trainer's tensors are fp32
    try:
        return [cls(config), cls(config)]
    finally:
        torch.set_default_dtype(torch.float32)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=["llama", "qwen2"], required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import torch

    from sglang_protocol import held_weights

    model, ref = sglang_model(a.arch, Path(a.model_dir), a.rank, a.tp, a.port)
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    trainer = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a.model_dir), torch_dtype=torch.float32)
    state = trainer.state_dict()
    flat = torch.cat([t.reshape(-1) for t in state.values()])  # the trainer's one buffer per dtype
    named, at = [], 0
    for name, t in state.items():
        named.append((name, flat[at:at + t.numel()].view(t.shape)))
        at += t.numel()
    pushes = []
    for k in range(3):
        if k:
            with torch.no_grad():
                flat.add_(torch.randn_like(flat) * 0.01)  # the optimizer's step, in place
        held_weights.load_and_hold(model, held_weights.pack(named))
        ref.load_weights([(n, t.clone()) for n, t in named])
        mine, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
        pushes.append({"replays": held_weights.replays(model),
                       "differ": [n for n in theirs if not torch.equal(mine[n], theirs[n])],
                       "changed": sum(not torch.equal(mine[n], prev[n]) for n in mine) if k else None})
        prev = {n: p.detach().clone() for n, p in mine.items()}
    plan = held_weights.plan_of(model)
    out = {"pushes": pushes, "num_params": len(dict(model.named_parameters())),
           "num_copies": plan.num_copies if plan else 0, "steps": len(plan.steps) if plan else 0,
           "shapes": {n: list(p.shape) for n, p in model.named_parameters()}}
    Path(a.out, f"rank{a.rank}.json").write_text(json.dumps(out))
    held_weights.load_and_hold(model, [])
    return out


if __name__ == "__main__":
    main()
