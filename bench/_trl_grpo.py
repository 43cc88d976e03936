"""The TRL side of bench/e2e.py: a race task under TRL's ``GRPOTrainer`` (the toy arithmetic task by
default; ``--reward math`` and the flags below for SmolLM2's two-digit addition).

Run as its own process (``python bench/_trl_grpo.py --model-dir M --out-dir D ...``) so that its
torch/threads state and imports do not mix with the Reservoir runs; it writes ``D/trl.json``
(eval history with wall times, steps, steps/s) and ``D/trl_log.jsonl`` (TRL's per-step logs).

Settings matched to Reservoir's config of the task (bench/e2e.py's ``TASKS`` passes them) and its
TrainSettings defaults: ``--lr``, WSD (constant, then linear to 0 over the last ``--decay-steps`` of
``--max-steps``; the toy config's) or constant (``--decay-steps 0``), AdamW betas (0.9, 0.98), eps
1e-8, weight decay 0, grad clip 1.0; ``--prompts-per-step`` prompts x ``--generations`` per optimizer
step (one generation batch = one optimizer step, num_iterations 1); ``--max-new-tokens``, temperature
1.0, no top-k/top-p; beta 0 (no KL); loss ``dapo`` (token mean over the batch's active tokens =
Reservoir's ``token_mean``) with group-std advantage scaling (= grpo); clip epsilon 0.2. The prompt is
one user message under the tokenizer's chat template (as ``--apply-chat-template``). Eval: greedy,
``--max-new-tokens``, every prompt of the eval file, every ``--eval-interval`` steps and before
training, timed from the start of training (eval time included, as Reservoir's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's plugins (the math rule)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

_TRAILING_SPECIAL = re.compile(r"(?:<\|?[A-Za-z_/][\w/]*\|?>|</s>)\s*$")  # as plugins/rewards.py


def is_correct(response: str, label: str) -> bool:
    """The toy checker (plugins/rewards.py toy_arithmetic): the number, maybe then one special token."""
    return _TRAILING_SPECIAL.sub("", response, count=1).strip() == str(label).strip()


def is_correct_math(response: str, label: str) -> bool:
    """``--rm-type math``'s rule (plugins/rewards.py math_rm): the final answer (last ``\\boxed{}`` or
    last number) equals the label's."""
    from plugins.math_answers import answers_match, extract_answer, last_boxed

    return answers_match(extract_answer(response), last_boxed(str(label)) or str(label))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model-dir", required=True, type=Path)
    ap.add_argument("--out-dir", required=True, type=Path)
    ap.add_argument("--max-steps", type=int, default=800)
    ap.add_argument("--time-cap-s", type=float, default=600.0)
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--decay-steps", type=int, default=200,
                    help="the WSD schedule's linear decay at the end (0: a constant lr)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--generations", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=6, help="in rollouts and in the eval")
    ap.add_argument("--reward", choices=["toy", "math"], default="toy")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: TRL trains and generates (HF generate) on the GPU, fp32 as Reservoir's trainer")
    args = ap.parse_args(argv)
    correct = is_correct if args.reward == "toy" else is_correct_math

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    args.out_dir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    train = _rows(args.model_dir / "data" / "train.jsonl")
    evals = _rows(args.model_dir / "data" / "eval.jsonl")
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]}
                            for r in train])

    def task_reward(prompts, completions, label, **kwargs) -> list[float]:
        # conversational completions: [{"role": "assistant", "content": text}] (special tokens removed)
        return [1.0 if correct(c[0]["content"], l) else 0.0 for c, l in zip(completions, label)]

    eval_texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                          tokenize=False) for r in evals]

    @torch.no_grad()
    def evaluate(m) -> float:
        was_training = m.training
        m.eval()
        tok.padding_side = "left"
        enc = tok(eval_texts, return_tensors="pt", padding=True, add_special_tokens=False).to(m.device)
        out = m.generate(**enc, do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)  # [64, T + <=6]
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        if was_training:
            m.train()
        return sum(correct(t, r["label"]) for t, r in zip(texts, evals)) / len(evals)

    history: list[dict] = []
    state_box: dict = {}

    class EvalAndStop(TrainerCallback):
        """Greedy eval every ``--eval-interval`` steps; stop at the target or the time cap."""

        def on_train_begin(self, a, state, control, model=None, **kw):
            state_box["t0"] = time.time()
            acc = evaluate(model)
            history.append({"step": 0, "eval/accuracy": acc, "elapsed_s": time.time() - state_box["t0"]})
            print(f"[trl eval @ step 0] accuracy={acc:.4f}", flush=True)

        def on_step_end(self, a, state, control, model=None, **kw):
            elapsed = time.time() - state_box["t0"]
            state_box["last_step"], state_box["last_elapsed"] = state.global_step, elapsed
            if state.global_step % args.eval_interval == 0:
                acc = evaluate(model)
                elapsed = time.time() - state_box["t0"]
                history.append({"step": state.global_step, "eval/accuracy": acc, "elapsed_s": elapsed})
                print(f"[trl eval @ step {state.global_step}] accuracy={acc:.4f} t={elapsed:.0f}s", flush=True)
                if acc >= args.target:
                    control.should_training_stop = True
            if elapsed > args.time_cap_s:
                control.should_training_stop = True
                state_box["capped"] = True

        def on_log(self, a, state, control, logs=None, **kw):
            with open(args.out_dir / "trl_log.jsonl", "a") as f:
                f.write(json.dumps({"step": state.global_step, "time": time.time(), **(logs or {})}) + "\n")

    schedule = ({"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs": {
        "num_decay_steps": args.decay_steps, "decay_type": "linear", "min_lr_ratio": 0.0}} if args.decay_steps
                else {"lr_scheduler_type": "constant"})
    cfg = GRPOConfig(
        output_dir=str(args.out_dir / "trl_out"), use_cpu=args.device == "cpu", bf16=False, fp16=False,
        # the toy config's WSD: 3e-4 to step max_steps - decay_steps, then linear to 0 at max_steps
        learning_rate=args.lr, warmup_steps=0, **schedule,
        optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=args.prompts_per_step * args.generations, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=args.generations, num_iterations=1,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, loss_type="dapo", scale_rewards="group", epsilon=0.2,
        max_steps=args.max_steps, logging_steps=1, save_strategy="no", report_to="none",
        seed=args.seed, dataloader_num_workers=0, disable_tqdm=True, use_vllm=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[EvalAndStop()])
    t_start = time.time()
    trainer.train()
    t_end = time.time()
    steps = state_box.get("last_step", 0)
    reached = next((h for h in history if h["eval/accuracy"] >= args.target), None)
    result = {
        "history": history, "steps": steps, "train_wall_s": t_end - t_start,
        "time_to_target_s": reached["elapsed_s"] if reached else None,
        "steps_to_target": reached["step"] if reached else None,
        "steps_per_s": steps / state_box["last_elapsed"] if steps else None,
        "final_accuracy": history[-1]["eval/accuracy"] if history else None,
        "capped": bool(state_box.get("capped")), "train_start_unix": state_box.get("t0"), "torch_threads": torch.get_num_threads(),
    }
    (args.out_dir / "trl.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "history"}), flush=True)
    return result


if __name__ == "__main__":
    main()
