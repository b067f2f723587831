"""Losses: hand-computed InfoNCE, equality with F.cross_entropy, the sigmoid loss, blocks, bf16."""
import math

import pytest
import torch
import torch.nn.functional as F

from topoclip.core.geometry import TOPOLOGIES, similarity, to_space
from topoclip.core.losses import LOSSES, TEMPERATURE_LOSSES, infonce_loss, sigmoid_loss


def test_infonce_matches_a_hand_computed_3x3():
    values = [[0.9, 0.1, 0.0], [0.2, 0.8, 0.1], [0.0, 0.3, 0.7]]
    s = torch.tensor(values, dtype=torch.float64)  # the loss keeps float64: compared at float64's precision
    tau = torch.tensor(2.0, dtype=torch.float64)
    # Row i: −log( e^{2 s_ii} / Σ_j e^{2 s_ij} ); columns likewise on sᵀ. Plain floats throughout
    # (pytest.approx cannot take a 0-d tensor as `expected`).
    rows = [-(2 * values[i][i] - math.log(sum(math.exp(2 * values[i][j]) for j in range(3)))) for i in range(3)]
    cols = [-(2 * values[i][i] - math.log(sum(math.exp(2 * values[j][i]) for j in range(3)))) for i in range(3)]
    expected = (sum(rows) / 3 + sum(cols) / 3) / 2
    assert isinstance(expected, float)
    assert infonce_loss(s, s.T, tau).item() == pytest.approx(expected, rel=1e-12)  # ~20 float64 roundings


def test_infonce_equals_cross_entropy():
    s = torch.randn(8, 8, dtype=torch.float64)  # float64: default assert_close bounds (1e-7) hold with room
    tau = torch.tensor(14.3, dtype=torch.float64)
    labels = torch.arange(8)
    expected = (F.cross_entropy(tau * s, labels) + F.cross_entropy(tau * s.T, labels)) / 2
    torch.testing.assert_close(infonce_loss(s, s.T, tau), expected)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_local_blocks_sum_to_the_full_loss(name):
    # Two "ranks" of 3 rows each, scored against the full 6 columns, average to the full loss.
    s = torch.randn(6, 6, dtype=torch.float64)  # float64: default assert_close bounds (1e-7) hold with room
    tau, bias = torch.tensor(5.0, dtype=torch.float64), torch.tensor(-2.0, dtype=torch.float64)
    loss = LOSSES[name]
    full = loss(s, s.T, tau, bias)
    parts = [loss(s[3 * r : 3 * r + 3], s.T[3 * r : 3 * r + 3], tau, bias, local_index=r) for r in range(2)]
    torch.testing.assert_close(sum(parts) / 2, full)


def test_sigmoid_matches_its_formula():
    s = torch.tensor([[0.5, -0.2], [0.1, 0.4]], dtype=torch.float64)  # float64: default bounds hold with room
    tau, beta = torch.tensor(10.0, dtype=torch.float64), torch.tensor(-1.0, dtype=torch.float64)
    z = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64)
    expected = -torch.log(torch.sigmoid(z * (tau * s + beta))).sum() / 2
    torch.testing.assert_close(sigmoid_loss(s, s.T, tau, beta), expected)


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_finite_at_tau_100_under_bf16_autocast(topology, name):
    raw_u = torch.randn(16, 4, 8, requires_grad=True)
    raw_v = torch.randn(16, 4, 8, requires_grad=True)
    tau = torch.tensor(math.log(100.0), requires_grad=True)
    keywords = {"curvature": 1.0} if TOPOLOGIES[topology].curved else {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        u = to_space(topology, raw_u.bfloat16(), **keywords)
        v = to_space(topology, (raw_u + 0.01 * raw_v).bfloat16(), **keywords)  # near-matching pairs
        s = similarity(topology, u, v, **keywords)
        loss = LOSSES[name](s, s.T, tau.exp(), torch.tensor(-10.0))
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    uses_tau = name in TEMPERATURE_LOSSES  # the others ignore τ: no gradient reaches it
    assert (tau.grad is not None) == uses_tau
    for grad in (raw_u.grad, raw_v.grad) + ((tau.grad,) if uses_tau else ()):
        assert torch.isfinite(grad).all()
