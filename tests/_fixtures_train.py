"""Helpers for the train-backend tests: rollout groups on the toy task, built like the rollout
side builds them (chat-templated prompt ids + response ids, loss mask, engine log-probs)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from buffer.sample import Sample, Status
from train_backend import TrainSettings


def make_groups(model_dir: Path, num_groups: int = 4, group_size: int = 8, seed: int = 0,
                logp_noise: float = 0.0) -> list[list[Sample]]:
    """``num_groups`` groups of ``group_size`` samples: toy prompts, random short digit answers
    ending in ``<eos>``, reward 1 when the answer is right. ``rollout_log_probs`` are the toy
    model's own log-probs plus ``logp_noise`` Gaussian noise (what an engine would report)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        a, b = rng.randrange(10), rng.randrange(10)
        text = tok.apply_chat_template([{"role": "user", "content": f"{a}+{b}="}], add_generation_prompt=True,
                                       tokenize=False)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        group = []
        for i in range(group_size):
            answer = str(a + b) if rng.random() < 0.4 else str(rng.randrange(19))
            resp = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            group.append(Sample(group_index=g, index=g * group_size + i, prompt=f"{a}+{b}=", label=str(a + b),
                                tokens=prompt + resp, response=answer, response_length=len(resp),
                                loss_mask=[1] * len(resp), reward=float(answer == str(a + b)),
                                status=Status.COMPLETED, weight_versions=[0]))
        groups.append(group)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    for s in (s for grp in groups for s in grp):
        s.rollout_log_probs = [x + logp_noise * float(torch.randn((), generator=gen))
                               for x in hf_log_probs(model, s)]
    return groups


@torch.no_grad()
def hf_log_probs(model, sample: Sample, temperature: float = 1.0) -> list[float]:
    """Reference: a plain HF forward of one unpacked sequence, log-softmax(logits / T)."""
    ids = torch.tensor([sample.tokens])  # [1, L]
    logits = model(input_ids=ids).logits[0].float() / temperature  # [L, V]
    p = sample.prompt_length
    logp = torch.log_softmax(logits[p - 1:-1], dim=-1)  # [R, V]
    return logp.gather(-1, ids[0, p:, None]).squeeze(-1).tolist()


def settings(model_dir: Path, **kw) -> TrainSettings:
    kw.setdefault("lr", 1e-3)
    return TrainSettings(hf_checkpoint=str(model_dir), **kw)


def weights(backend) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in backend.named_hf_weights()}
