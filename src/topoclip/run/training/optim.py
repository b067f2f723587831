"""AdamW with parameter groups and the cosine schedule with linear warm-up."""
from __future__ import annotations

import math

import torch
from torch import nn

from topoclip.config import TrainConfig


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed matrices, and undecayed norms, biases, embeddings, τ and β (OpenCLIP's rule).

    "Embeddings" are the token table, class tokens and positional embeddings; every tensor of
    dimension < 2 (gains, biases, t, β, a hyperbolic model's log c and log α as MERU) also goes without decay.
    """
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        embedding = "embedding" in name or name.startswith("temperature.")
        (no_decay if parameter.ndim < 2 or embedding else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over `parameter_groups`; fused (one kernel) when train.fused_optimizer and the weights are on CUDA.

    Build it after moving the model to its device. On CPU it is always the foreach implementation
    (the CPU fused kernel is not in every build, and foreach is as fast there).
    """
    fused = config.fused_optimizer and all(p.is_cuda for p in model.parameters())
    return torch.optim.AdamW(parameter_groups(model, config.weight_decay), lr=config.lr,
                             betas=config.betas, eps=config.eps, **({"fused": True} if fused else {}))


def cosine_with_warmup(step: int, warmup_steps: int, total_steps: int) -> float:
    """lr multiplier: linear 1/warmup … 1 over `warmup_steps`, then cosine from 1 to 0 at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_with_warmup(step, config.warmup_steps, config.steps))
