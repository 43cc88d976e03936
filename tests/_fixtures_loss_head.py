"""Rank-side checks of :mod:`train_backend.megatron.loss_head` (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch


def _reference(full: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, vocab: int, temp: float,
               a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain fp64 log_softmax over the real vocabulary: logp, entropy and d(a.logp + b.H)/d full."""
    x = full.detach().double().requires_grad_(True)  # [M, Vp]
    z = x[rows, :vocab] / temp  # [N, V]
    lsm = torch.log_softmax(z, -1)  # [N, V]
    logp = lsm.gather(-1, targets[:, None])[:, 0]  # [N]
    ent = -(lsm.exp() * lsm).sum(-1)  # [N]
    (a.double() @ logp + b.double() @ ent).backward()
    return logp.detach(), ent.detach(), x.grad


def check_loss_head(layouts: list[int], cases: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """For each TP size and case: the fused head vs an fp64 reference and vs the plain megatron
    path (forward.flat_log_probs / flat_entropy): max abs differences of log-probs, entropies and
    logit gradients (this rank's vocabulary slice)."""
    from megatron.core import parallel_state

    from train_backend.megatron import cpu_compat, forward, loss_head, parallel

    device = torch.device("cpu")
    out: dict[str, dict[str, float]] = {}
    with cpu_compat.maybe_cpu_mode(device):
        parallel.init_distributed(device)
        for tp in layouts:
            parallel.init_parallel_state(tp, 1, seed=1, device=device)
            rank = parallel_state.get_tensor_model_parallel_rank()
            for ci, case in enumerate(cases):
                g = torch.Generator().manual_seed(100 + ci)  # same data on every rank
                m, vp, vocab, n = case["rows"], case["padded_vocab"], case["vocab"], case["n"]
                temp, dtype = case["temperature"], case["dtype"]
                full = (torch.randn(m, vp, generator=g) * case["scale"]).to(dtype)  # [M, Vp]
                rows = torch.randperm(m, generator=g)[:n]  # [N]
                targets = torch.randint(0, vocab, (n,), generator=g)  # [N]
                a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)  # [N]
                part = vp // tp
                local = full[:, rank * part:(rank + 1) * part].clone()  # [M, Vp/tp]
                ref_lp, ref_ent, ref_grad = _reference(full.float(), rows, targets, vocab, temp, a, b)
                ref_grad = ref_grad[:, rank * part:(rank + 1) * part]

                res: dict[str, float] = {}
                for impl in case["impls"]:
                    x = local.clone().requires_grad_(True)
                    lp, ent = loss_head.log_probs_and_entropy(
                        x, rows, targets, vocab, temp, with_entropy=True, entropy_grad=True, impl=impl,
                        chunk_elements=case["chunk_rows"] * part)
                    (a @ lp + b @ ent).backward()
                    res[f"{impl}_logp"] = (lp.double() - ref_lp).abs().max().item()
                    res[f"{impl}_ent"] = (ent.double() - ref_ent).abs().max().item()
                    res[f"{impl}_grad"] = (x.grad.double() - ref_grad).abs().max().item()
                    res[f"{impl}_grad_dtype_ok"] = float(x.grad.dtype == dtype)
                    # entropy as a metric only: detached, and the gradient is that of logp alone
                    y = local.clone().requires_grad_(True)
                    lp2, ent2 = loss_head.log_probs_and_entropy(
                        y, rows, targets, vocab, temp, with_entropy=True, entropy_grad=False, impl=impl,
                        chunk_elements=case["chunk_rows"] * part)
                    res[f"{impl}_metric_ent_detached"] = float(not ent2.requires_grad)
                    (a @ lp2).backward()
                    _, _, ref_grad_lp = _reference(full.float(), rows, targets, vocab, temp, a, torch.zeros_like(b))
                    ref_grad_lp = ref_grad_lp[:, rank * part:(rank + 1) * part]
                    res[f"{impl}_grad_logp_only"] = (y.grad.double() - ref_grad_lp).abs().max().item()
                    lp3, ent3 = loss_head.log_probs_and_entropy(local, rows, targets, vocab, temp,
                                                                with_entropy=False, impl=impl)
                    res[f"{impl}_no_entropy_logp"] = (lp3.double() - ref_lp).abs().max().item()
                    res[f"{impl}_no_entropy_is_none"] = float(ent3 is None)

                # the plain megatron path, for the record (same inputs)
                z = local.clone().requires_grad_(True)
                sel = z[rows]  # [N, Vp/tp]
                lp_old = forward.flat_log_probs(sel, targets, vocab, temp)  # [N]
                ent_old = forward.flat_entropy(sel, vocab, temp)  # [N]
                (a @ lp_old + b @ ent_old).backward()
                res["unfused_logp"] = (lp_old.double() - ref_lp).abs().max().item()
                res["unfused_ent"] = (ent_old.double() - ref_ent).abs().max().item()
                res["unfused_grad"] = (z.grad.double() - ref_grad).abs().max().item()
                out[f"tp{tp}_case{ci}"] = res
            parallel.destroy_parallel_state()
    return out
