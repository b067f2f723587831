"""The learnable temperature τ = exp(t) and the optional SigLIP bias β.

Logits are L_ij = τ · s_ij (+ β). t is the parameter ("Temp. Init/Final" in the paper's Table 6
are t values: 2.659 = ln(1/0.07)). τ is clamped from above after every optimiser step by
:meth:`Temperature.clamp_` (the trainer calls it; forward never mutates parameters).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from topoclip.core.geometry import fp32_or_wider


class Temperature(nn.Module):
    """Holds t (τ = exp t) and, for the sigmoid loss, a scalar bias β.

    Args:
        init: initial t (not τ). CLIP: ln(1/0.07) = 2.659; SigLIP: ln(10).
        max_scale: upper clamp on τ applied by `clamp_` (100 for CLIP; the paper uses 3.95 or
            6.25 for Multi(32,16)).
        learnable: False is the paper's "gradient=False": τ stays at exp(init) (t is a buffer).
        bias_init: initial β, or None for no bias (InfoNCE). SigLIP: −10.
    """

    def __init__(self, init: float = math.log(1 / 0.07), max_scale: float = 100.0,
                 learnable: bool = True, bias_init: Optional[float] = None):
        super().__init__()
        if max_scale <= 0:
            raise ValueError(f"temperature max_scale must be > 0, got {max_scale}")
        self.max_log_scale = math.log(max_scale)
        # τ never exceeds max_scale, from the start: the paper's Multi(32,16) starts at t = 2.659
        # (τ = 14.3) with max 3.95, so it effectively starts at τ = 3.95.
        t = torch.tensor(min(float(init), self.max_log_scale))
        if learnable:
            self.t = nn.Parameter(t)
        else:
            self.register_buffer("t", t)
        self.bias = nn.Parameter(torch.tensor(float(bias_init))) if bias_init is not None else None

    @property
    def scale(self) -> torch.Tensor:
        """τ = exp(t), a 0-d fp32 tensor (float64 in a float64 model)."""
        return fp32_or_wider(self.t).exp()

    @torch.no_grad()
    def clamp_(self) -> None:
        """Clamp τ to at most max_scale. Call after each optimiser step."""
        self.t.clamp_(max=self.max_log_scale)

    def extra_repr(self) -> str:
        learn = isinstance(self.t, nn.Parameter)
        return f"t={self.t.item():.4f}, max_scale={math.exp(self.max_log_scale):.4g}, learnable={learn}, bias={self.bias is not None}"
