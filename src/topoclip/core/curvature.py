"""The hyperbolic topologies' learnable curvature −c and MERU's per-tower scalings.

c = exp(log_c) starts at `init` and is clamped after every optimiser step to [init/10, 10·init]
(MERU's interval: a curvature that runs off makes training unstable). Each tower's raw output is
scaled by α = exp(log α) before the exponential map; α starts at d^(−1/2), d = m·n the embedding's
whole dimension, so that a raw output of norm about √d starts at norm about 1 in the tangent space
(MERU's rule), and is clamped at 1 (log α ≤ 0: the scaling never enlarges an output). For the product of
m hyperboloids the same d keeps the start's sum of m distances at a single hyperboloid's scale: with
n^(−1/2) per factor the tiny preset's 4 hyperboloids started with similarities about √m = 2× more spread, and its
text tower collapsed to one point within 60 steps (loss stuck at ln B;
tests/training/test_train.py::test_each_topology_learns[lorentz-product]). As τ, these
are clamped by :meth:`Curvature.clamp_`, which the trainer calls; forward never mutates parameters.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from topoclip.core.geometry import fp32_or_wider

# MERU's bounds on c, as factors of its initial value.
CURVATURE_RANGE = 10.0


class Curvature(nn.Module):
    """log c (a parameter, or a buffer when not learnable) and log α of the image and text towers.

    Args:
        init: the initial c (> 0); MERU's is 1.
        dim: the embedding's dimension m·n; α starts at dim^(−1/2).
        learnable: False keeps c at init (MERU's learn_curv=False); the scalings are learned either way.
    """

    def __init__(self, init: float = 1.0, dim: int = 512, learnable: bool = True):
        super().__init__()
        if not init > 0:
            raise ValueError(f"curvature init must be > 0, got {init}")
        self.log_range = (math.log(init / CURVATURE_RANGE), math.log(init * CURVATURE_RANGE))
        log_c = torch.tensor(math.log(init))
        if learnable:
            self.log_c = nn.Parameter(log_c)
        else:
            self.register_buffer("log_c", log_c)
        self.log_image_scale = nn.Parameter(torch.tensor(-0.5 * math.log(dim)))
        self.log_text_scale = nn.Parameter(torch.tensor(-0.5 * math.log(dim)))

    @property
    def curvature(self) -> torch.Tensor:
        """c = exp(log c), a 0-d fp32 tensor (float64 in a float64 model)."""
        return fp32_or_wider(self.log_c).exp()

    def scale(self, tower: str) -> torch.Tensor:
        """α of "image" or "text", a 0-d fp32 tensor."""
        return fp32_or_wider(self.log_image_scale if tower == "image" else self.log_text_scale).exp()

    @torch.no_grad()
    def clamp_(self) -> None:
        """c into [init/10, 10·init] and α ≤ 1. Call after each optimiser step."""
        self.log_c.clamp_(*self.log_range)
        self.log_image_scale.clamp_(max=0.0)
        self.log_text_scale.clamp_(max=0.0)

    def extra_repr(self) -> str:
        learn = isinstance(self.log_c, nn.Parameter)
        return (f"c={self.curvature.item():.4g}, learnable={learn}, α_image={self.scale('image').item():.4g}, "
                f"α_text={self.scale('text').item():.4g}")
