"""Every topology: ranges, closed forms, chunking, fp32 under autocast, finite gradients at u = v."""
import dataclasses
import math

import pytest
import torch

from topoclip.core import geometry
from topoclip.core.geometry import TOPOLOGIES, similarity, to_space

from _tolerance import fp32_pair, gamma

ALL = sorted(TOPOLOGIES)


def curved(topology, c=0.7):
    """The keywords a topology's functions take: the hyperbolic ones a curvature c (0.7: not MERU's 1, so a formula
    that drops c is caught), the others none."""
    return {"curvature": c} if TOPOLOGIES[topology].curved else {}


def random_points(topology, batch=6, m=4, n=8, dtype=torch.float64):
    return to_space(topology, torch.randn(batch, m, n, dtype=dtype), **curved(topology))


@pytest.mark.parametrize("topology", ALL)
def test_projection_lands_on_the_space(topology):
    x = torch.randn(5, 4, 8) * 3
    y = to_space(topology, x, **curved(topology))
    assert y.shape == x.shape and y.dtype == torch.float32
    if topology == "sphere":  # normalise, then norm: 32 fp32 terms each
        torch.testing.assert_close(y.flatten(1).norm(dim=-1), torch.ones(5), **fp32_pair(32 + 32))
    elif topology.startswith("ps-"):
        torch.testing.assert_close(y.norm(dim=-1), torch.ones(5, 4), **fp32_pair(8 + 8))
    elif TOPOLOGIES[topology].curved:  # the exponential map keeps the direction and reaches distance ‖x‖ (or its clamp)
        rows = (lambda t: t) if TOPOLOGIES[topology].product else (lambda t: t.flatten(1))
        c = curved(topology)["curvature"]
        tangent, point = rows(x).double(), rows(y).double()
        reached = torch.asinh(c**0.5 * point.norm(dim=-1)) / c**0.5  # distance to the origin, float64 from fp32 y
        expected = tangent.norm(dim=-1).clamp(max=geometry.SINH_INPUT_MAX / c**0.5)
        # y = x · sinh(r)/r in fp32: a few roundings (norm of ≤ 32 terms, sinh, a division, a product) per coordinate,
        # each relative; asinh's relative condition number r/(sqrt(1 + r²) asinh r) ≤ 1 passes them on to the distance.
        torch.testing.assert_close(reached, expected, atol=0, rtol=gamma(32 + 8))
        cosine = (tangent * point).sum(-1) / (tangent.norm(dim=-1) * point.norm(dim=-1))
        torch.testing.assert_close(cosine, torch.ones_like(cosine), atol=gamma(2 * 32 + 8), rtol=0)
    else:
        torch.testing.assert_close(y, x, atol=0, rtol=0)  # the identity


@pytest.mark.parametrize("topology", ALL)
@pytest.mark.parametrize("m", [1, 4, 16])
def test_similarity_range(topology, m):
    keywords = curved(topology)
    u = to_space(topology, torch.randn(64, m, 8), **keywords)
    s = similarity(topology, u, torch.cat([u[:8], -u[8:16], to_space(topology, torch.randn(48, m, 8), **keywords)]),
                   **keywords)
    low, high = TOPOLOGIES[topology].similarity_range(m)
    assert s.shape == (64, 64)
    # fp32: normalising and scoring 8·m coordinates is ~8·m + 8 roundings on values ≤ m (ps-inner's
    # range; the sphere's is 1, the geodesic's √m·π on cosines ≤ 1): γ_(8m+8) · m bounds every order.
    rounding = gamma(8 * m + 8) * m
    assert (s >= low - rounding).all() and (s <= high + rounding).all()
    if topology != "euclidean":  # the diagonal of matching pairs reaches the top of the range
        # (the geodesic only to within the arccos clamp, √m · arccos(1 − ε), with 1 − ε itself rounded
        # to fp32: at most one spacing below 1, 2⁻²⁴, further from 1; the hyperboloids to within
        # arcosh(1 + δ_min)/√c per factor, δ_min = LORENTZ_DELTA_MIN)
        floor = (math.acosh(1 + geometry.LORENTZ_DELTA_MIN) / keywords["curvature"] ** 0.5 if keywords else
                 math.acos(1 - geometry.ARCCOS_CLAMP_EPSILON - 2.0**-24))
        slack = (m if TOPOLOGIES[topology].product and keywords else math.sqrt(m)) * floor + rounding
        torch.testing.assert_close(s.diagonal()[:8], torch.full((8,), high), atol=slack, rtol=0)
    if topology in ("sphere", "ps-inner"):  # antipodes reach the bottom
        torch.testing.assert_close(s[8:16, 8:16].diagonal(), torch.full((8,), low), atol=rounding, rtol=0)


def test_ps_inner_is_the_flattened_matmul():
    u, v = random_points("ps-inner", 7), random_points("ps-inner", 5)
    expected = u.flatten(1) @ v.flatten(1).T
    # float64 in, float64 out: a sum of 32 products of unit-norm rows, |error| ≤ γ_32 (float64) ≈ 4e-15.
    float64_bound = dict(atol=32 * 2.0**-53 * 4, rtol=0)  # Σ|u_i v_i| ≤ m = 4 (Cauchy-Schwarz per sphere)
    torch.testing.assert_close(similarity("ps-inner", u, v), expected, **float64_bound)
    # = Σ_k u_kᵀ v_k per pair, i.e. tr(uᵀv)
    torch.testing.assert_close(similarity("ps-inner", u[:1], v[:1])[0, 0], (u[0] * v[0]).sum(), **float64_bound)


def test_geodesic_equals_its_arccos_formula():
    u, v = random_points("ps-geodesic", 6), random_points("ps-geodesic", 5)
    s = similarity("ps-geodesic", u, v)
    for i in range(6):
        for j in range(5):
            angles = [math.acos(float(u[i, k] @ v[j, k])) for k in range(u.shape[1])]
            # float64 throughout; the arccos clamp (1 − ε) moves an angle by at most arccos(1 − ε) ≈ 1.4e-3
            # only for |cos| > 1 − ε, which random points on S^7 never reach; else float64 rounding only.
            assert s[i, j].item() == pytest.approx(-math.sqrt(sum(a * a for a in angles)), abs=1e-12)


def test_euclidean_equals_the_norm_of_the_difference():
    u, v = torch.randn(6, 3, 5, dtype=torch.float64), torch.randn(4, 3, 5, dtype=torch.float64)
    expected = -(u[:, None] - v[None]).flatten(2).norm(dim=-1)
    # The similarity goes through ‖u‖² + ‖v‖² − 2uᵀv (15 terms each): float64 γ_45 of Σ of squares ≤ 100,
    # then a square root, which halves the relative error.
    torch.testing.assert_close(similarity("euclidean", u, v), expected, atol=math.sqrt(45 * 2.0**-53 * 100), rtol=0)


def close_pairs(norm, distance, batch=8, dim=64, seed=0):
    """fp32 (batch, 1, dim) u of norm `norm` in random directions, and v_i = u_i + a step of `distance`."""
    generator = torch.Generator().manual_seed(seed)
    u = torch.randn(batch, dim, generator=generator, dtype=torch.float64)
    step = torch.randn(batch, dim, generator=generator, dtype=torch.float64)
    u = u / u.norm(dim=-1, keepdim=True) * norm
    v = u + step / step.norm(dim=-1, keepdim=True) * distance
    return u.float()[:, None], v.float()[:, None]


def relative_error_against_float64(u, v):
    """Largest |s − s_64| / |s_64| of the fp32 euclidean score, s_64 from the same fp32 inputs in float64."""
    exact = -(u.double().flatten(1)[:, None] - v.double().flatten(1)[None]).norm(dim=-1)
    return ((similarity("euclidean", u, v).double() - exact).abs() / exact.abs()).max().item()


@pytest.mark.parametrize("norm, distance", [(10.0, 1e-3), (100.0, 1e-2), (1.0, 1.0)])
def test_euclidean_is_accurate_relative_to_the_distance(norm, distance):
    """Pairs far closer than their norms, scored against float64 (relative error < 1e-4).

    Failed on main (‖u‖² + ‖v‖² − 2uᵀv in fp32): ‖u‖ = 10, d = 1e-3 read the 1e-6 floor (99.9 % off)
    and ‖u‖ = 100, d = 1e-2 was hundreds of percent off.
    """
    u, v = close_pairs(norm, distance)
    assert relative_error_against_float64(u, v) < 1e-4


def test_euclidean_is_accurate_in_a_cluster_far_from_the_origin():
    """Every pair is close relative to the norm (a shared offset of 100, spread 1e-2): centring fixes all.

    Failed on main: relative errors of order 1 on every pair.
    """
    generator = torch.Generator().manual_seed(1)
    offset = torch.randn(64, generator=generator, dtype=torch.float64)
    offset = offset / offset.norm() * 100
    u = offset + 1e-3 * torch.randn(12, 64, generator=generator, dtype=torch.float64)
    v = offset + 1e-3 * torch.randn(9, 64, generator=generator, dtype=torch.float64)
    assert relative_error_against_float64(u.float()[:, None], v.float()[:, None]) < 1e-4


def test_euclidean_gradients_match_float64_for_close_pairs():
    u, v = close_pairs(10.0, 1e-2, batch=5)
    grads = []
    for dtype in (torch.float32, torch.float64):
        a, b = u.to(dtype).clone().requires_grad_(), v.to(dtype).clone().requires_grad_()
        weights = torch.linspace(-1, 1, 25, dtype=dtype).view(5, 5)
        if dtype == torch.float64:  # the reference: the plain difference, in float64
            s = -(a.flatten(1)[:, None] - b.flatten(1)[None]).norm(dim=-1)
        else:
            s = similarity("euclidean", a, b)
        (s * weights).sum().backward()
        grads.append((a.grad.double(), b.grad.double()))
    # The accuracy the centred form is built for (not a summation-order bound): a plain fp32
    # ‖u‖² + ‖v‖² − 2uᵀv at norm 10 and distance 1e-2 loses all digits (γ_64 · 100 / 1e-4 ≫ 1); the
    # centred difference keeps a relative error of about γ_64 ≈ 4e-6 of each gradient, far inside 1e-3.
    for got, expected in zip(*grads):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-3)


def test_euclidean_near_pairs_in_bounded_blocks_equal_one_block(monkeypatch):
    u, v = close_pairs(10.0, 1e-3, batch=6)
    results = []
    for budget in (geometry.CHUNK_ELEMENTS, 2 * 64):  # the second: 2 pairs of 64 dims per block
        monkeypatch.setattr(geometry, "CHUNK_ELEMENTS", budget)
        a, b = u.clone().requires_grad_(), v.clone().requires_grad_()
        s = similarity("euclidean", a, b)
        (s * torch.linspace(-1, 1, 36).view(6, 6)).sum().backward()
        results.append((s.detach(), a.grad, b.grad))
    for one, blocked in zip(*results):  # per element the same fp32 operations; gradients summed in blocks
        torch.testing.assert_close(blocked, one, **fp32_pair(2 * 64 + 6, float(one.abs().max())))


def test_sphere_is_cosine():
    u, v = torch.randn(6, 1, 10), torch.randn(4, 1, 10)
    expected = torch.nn.functional.cosine_similarity(u.flatten(1)[:, None], v.flatten(1)[None], dim=-1)
    # two fp32 formulas for a cosine of 10 coordinates, |s| ≤ 1
    torch.testing.assert_close(similarity("sphere", to_space("sphere", u), to_space("sphere", v)), expected,
                               **fp32_pair(3 * 10))


@pytest.mark.parametrize("topology", ALL)
def test_chunked_equals_unchunked_in_values_and_gradients(topology):
    base_u, base_v = torch.randn(10, 4, 6, dtype=torch.float64), torch.randn(9, 4, 6, dtype=torch.float64)
    results = []
    for chunk in (None, 3):
        u, v = base_u.clone().requires_grad_(), base_v.clone().requires_grad_()
        keywords = curved(topology)
        s = similarity(topology, to_space(topology, u, **keywords), to_space(topology, v, **keywords), chunk_size=chunk,
                       **keywords)
        (s * torch.linspace(-1, 1, s.numel()).view_as(s)).sum().backward()
        results.append((s.detach(), u.grad, v.grad))
    # float64 in both: equal up to summation order, γ_24 of float64 on values ≤ π√m. The hyperboloids also centre
    # ‖û − v̂‖² on the rows a chunk holds: its relative error is at most γ_24 / NEAR_PAIR_FRACTION ≈ 3e-12 (nearer
    # pairs are recomputed directly), passed on through δ (a sum of terms ≥ 0) and arcosh(1 + δ) (relative condition
    # ≤ 1) to each distance and its gradient: normwise 1e-10 of the largest, with room.
    for a, b in zip(*results):
        atol = 1e-10 * max(1.0, float(b.abs().max())) if TOPOLOGIES[topology].curved else 24 * 2.0**-53 * math.pi * 2 * 10
        torch.testing.assert_close(a, b, atol=atol, rtol=0)


def test_geodesic_chunks_hold_no_full_intermediate(monkeypatch):
    seen = []
    original = geometry.negative_geodesic

    def spy(u, v):
        seen.append(u.shape[0] * v.shape[0] * u.shape[1])
        return original(u, v)

    monkeypatch.setitem(TOPOLOGIES, "ps-geodesic", dataclasses.replace(TOPOLOGIES["ps-geodesic"], pairwise=spy))
    u = to_space("ps-geodesic", torch.randn(256, 4, 8))
    s = similarity("ps-geodesic", u, u, chunk_size=32)
    assert s.shape == (256, 256) and max(seen) == 32 * 256 * 4  # never 256 × 256 × 4
    assert geometry.chunk_rows("ps-geodesic", 16384, 16) * 16384 * 16 <= geometry.CHUNK_ELEMENTS


@pytest.mark.parametrize("topology", ALL)
def test_gradients_finite_at_identical_points(topology):
    raw = torch.randn(4, 3, 5, requires_grad=True)
    u = to_space(topology, raw, **curved(topology))
    s = similarity(topology, u, u, **curved(topology))  # diagonal: u = v exactly
    s.sum().backward()
    assert torch.isfinite(s).all() and torch.isfinite(raw.grad).all()


@pytest.mark.parametrize("topology", ALL)
def test_fp32_under_bf16_autocast(topology):
    u = to_space(topology, torch.randn(8, 4, 8), **curved(topology)).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = similarity(topology, u, u, **curved(topology))
    assert s.dtype == torch.float32


def test_unknown_topology_and_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="unknown topology 'hyperbolic'.*ps-inner"):
        to_space("hyperbolic", torch.randn(2, 1, 3))
    with pytest.raises(ValueError, match=r"equal \(m, n\)"):
        similarity("ps-inner", torch.randn(2, 2, 3), torch.randn(2, 3, 2))
