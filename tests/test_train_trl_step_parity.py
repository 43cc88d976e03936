"""Two whole GRPO steps against TRL's: the same prompts, completions and rewards, from the same
weights, leave the same weights.

``tests/test_train_trl_parity.py`` compares the loss and its gradient on one batch with TRL's own
``_compute_loss``; this runs TRL's whole trainer instead (``GRPOTrainer.train``: its advantages, its
loss, HF Trainer's gradient clipping, AdamW and lr schedule) for two optimizer steps. TRL's
completions come from its public ``rollout_func`` hook, which here returns fixed token lists (right
and wrong answers of several lengths, each followed by EOS), so nothing is sampled; TRL's reward
function scores them with the toy rule. Reservoir's torch backend then trains two steps on the same
groups (the prompts TRL drew, in its order) with the same rewards, and both models are compared.
The bench's race (bench/e2e.py) uses these settings: a gap in learning per step between the two
sides is not in the step if this holds.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("trl")

from tests._fixtures_weight_sync import ws_toy_model  # noqa: E402,F401  (fixture)

G = 4  # completions per prompt
PROMPTS_PER_STEP = 4
LR = 1e-2  # large, so that a difference in any part of the step shows in the weights


def _completions(tok, label: str) -> list[list[int]]:
    """Per prompt: right, wrong, right, a longer wrong answer; each ends with EOS (as TRL keeps it)."""
    eos = tok.eos_token_id
    right = tok.encode(label, add_special_tokens=False)
    wrong = tok.encode(str(int(label) + 1), add_special_tokens=False)
    return [right + [eos], wrong + [eos], right + [eos], (wrong * 3)[:4] + [eos]]


def test_two_grpo_steps_leave_the_weights_trl_leaves(ws_toy_model, tmp_path):  # noqa: F811
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from buffer.sample import Sample, Status
    from train_backend.settings import TrainSettings
    from train_backend.torch_backend import TorchBackend

    tok = AutoTokenizer.from_pretrained(ws_toy_model)
    rows = [json.loads(line) for line in (ws_toy_model / "data/train.jsonl").read_text().splitlines()]
    rows = rows[:2 * PROMPTS_PER_STEP]
    label_of = {r["prompt"]: str(r["label"]) for r in rows}
    drawn: list[list[tuple[list[int], list[int], str]]] = []  # per step: (prompt ids, completion ids, label)

    def rollout(prompts: list, trainer) -> dict:
        """TRL's rollout_func: prompts come repeated, each G times in a row."""
        step, prompt_ids, completion_ids = [], [], []
        for i in range(0, len(prompts), G):
            text = prompts[i][-1]["content"]
            ids = tok.encode(tok.apply_chat_template(prompts[i], add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False)
            for completion in _completions(tok, label_of[text]):
                prompt_ids.append(ids)
                completion_ids.append(completion)
                step.append((ids, completion, label_of[text]))
        drawn.append(step)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    def toy_reward(prompts, completions, label, **kwargs) -> list[float]:
        return [1.0 if c[0]["content"].strip() == str(lb) else 0.0 for c, lb in zip(completions, label)]

    trl_model = AutoModelForCausalLM.from_pretrained(ws_toy_model, dtype=torch.float32)
    cfg = GRPOConfig(
        output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, fp16=False, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.98,
        adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, per_device_train_batch_size=PROMPTS_PER_STEP * G,
        gradient_accumulation_steps=1, num_generations=G, num_iterations=1, max_completion_length=6, beta=0.0,
        loss_type="dapo", scale_rewards="group", epsilon=0.2, max_steps=2, logging_steps=1, save_strategy="no",
        report_to="none", seed=3, dataloader_num_workers=0, disable_tqdm=True)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": str(r["label"])}
                            for r in rows])
    trainer = GRPOTrainer(model=trl_model, reward_funcs=toy_reward, args=cfg, train_dataset=ds,
                          processing_class=tok, rollout_func=rollout)
    trainer.train()
    assert len(drawn) == 2 and all(len(s) == PROMPTS_PER_STEP * G for s in drawn)
    rewards = [[float(c[:-1] == tok.encode(lb, add_special_tokens=False)) for _, c, lb in s] for s in drawn]
    assert all(0 < sum(r) < len(r) for r in rewards)  # every group has right and wrong answers: advantages move

    ours = TorchBackend(TrainSettings(hf_checkpoint=str(ws_toy_model), lr=LR, adam_beta1=0.9, adam_beta2=0.98,
                                      adam_eps=1e-8, weight_decay=0.0, clip_grad=1.0, eps_clip=0.2,
                                      advantage_estimator="grpo", loss_agg="token_mean"))
    start = {n: p.detach().clone() for n, p in ours.model.named_parameters()}
    for step, (batch, rs) in enumerate(zip(drawn, rewards)):
        groups = []
        for g in range(PROMPTS_PER_STEP):
            group = []
            for k in range(G):
                ids, completion, label = batch[g * G + k]
                group.append(Sample(group_index=g, index=g * G + k, label=label, tokens=ids + completion,
                                    response_length=len(completion), loss_mask=[1] * len(completion),
                                    reward=rs[g * G + k], status=Status.COMPLETED, weight_versions=[step]))
            groups.append(group)
        ours.train_step(groups, step)

    trl_weights = dict(trainer.model.named_parameters())
    rel = {}  # per tensor: |our update - TRL's| / |TRL's update| (L2)
    for name, p in ours.model.named_parameters():
        theirs = trl_weights[name].detach() - start[name]
        rel[name] = float((p.detach() - start[name] - theirs).norm() / theirs.norm())
    print("relative update difference, max over tensors:", max(rel.values()))
    # Not bitwise: fp32 sums in another order give gradients equal to ~1e-7, and Adam's m / sqrt(v) carries
    # that into coordinates whose gradient is near its eps. A different step (token weighting, advantage
    # scaling, clipping, schedule) moves every coordinate: with --loss-agg seq_mean_token_mean instead of
    # TRL's dapo it is 0.96 (checked when this test was written)
    assert max(rel.values()) < 1e-3, rel
