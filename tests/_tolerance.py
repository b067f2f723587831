"""Tolerances derived from fp32's unit roundoff, for comparisons that cannot be exact.

Two fp32 computations of the same quantity in different orders (another BLAS blocking, thread
count, SIMD width, a batch split over ranks or micro-batches) may differ in their last bits, and a
bound picked on one CPU fails on the next (issue #16: 1.05e-5 against a picked 1e-5 on an AVX-512
Xeon). So a value computed in fp32 is compared with the same computation in float64 (the model
and the loss run in float64 end to end: `geometry.fp32_or_wider`), whose own rounding (2⁻⁵³) is
negligible, within a bound that holds for every summation order:

- Summing n terms in floating point in any order (recursive, pairwise, blocked, per-thread or
  per-rank partial sums: each is a tree of additions no deeper than n) has error at most
  γ_n · Σ|x_i|, γ_n = n·u / (1 − n·u), u = 2⁻²⁴ for fp32 (Higham, *Accuracy and Stability of
  Numerical Algorithms*, 2nd ed., §3.1 and §4.2). An inner product of length n is the same bound.
- A chain of such reductions (a network's layers, forward then backward) adds the lengths of its
  reductions to first order, so n counts the roundings along the longest path.

For a tensor that is the output of many such chains (a gradient, an embedding) we use the
normwise form of that bound: every element within γ_n · max|reference|. It does not fail on the
small elements of a large sum, which is exactly where an elementwise relative bound does.
"""
from __future__ import annotations

import torch

from topoclip.config import load_config

UNIT_ROUNDOFF_FP32 = 2.0**-24


def gamma(n: int, u: float = UNIT_ROUNDOFF_FP32) -> float:
    """γ_n = n·u / (1 − n·u): the worst-case relative error of n accumulated roundings."""
    assert n * u < 1, "the bound needs n·u < 1"
    return n * u / (1 - n * u)


def network_roundings(layers: int, width: int, context: int, batch: int) -> int:
    """n for a transformer tower's forward and backward: per layer, the longest reduction of
    attention (context), of the MLP (4·width) and of a weight gradient (batch·context), plus the
    embedding, the projection and the loss (three more of the same size)."""
    longest = max(context, 4 * width, batch * context)
    return (layers + 3) * longest


def fp32_pair(roundings: int, scale: float = 1.0) -> dict:
    """assert_close tolerances for two fp32 computations of one value of magnitude ≤ `scale` (no float64
    reference at hand): each is within γ_n·scale of the exact value, so they are within 2·γ_n·scale."""
    return dict(atol=2 * gamma(roundings) * scale, rtol=0)


def model_roundings(model_config, batch: int) -> int:
    """network_roundings of a topoclip model's towers (a ModelConfig), the larger of the two."""
    vision, text = model_config.vision, model_config.text
    return network_roundings(max(vision.layers, text.layers), max(vision.width, text.width), text.context_length, batch)


TINY = load_config("tiny").model


def assert_fp32_close(actual: torch.Tensor, reference: torch.Tensor, roundings: int, msg: str = "") -> None:
    """Every element of `actual` (fp32) within γ_roundings · max|reference| of `reference` (float64)."""
    assert reference.dtype == torch.float64, "the reference must be computed in float64"
    reference = reference.detach()
    actual = actual.detach().to(torch.float64)
    bound = gamma(roundings) * reference.abs().max().item()
    error = (actual - reference).abs().max().item()
    assert error <= bound, f"{msg}: max |fp32 − float64| = {error:.3g} > γ_{roundings}·max|ref| = {bound:.3g}"
