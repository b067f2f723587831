"""The hyperbolic topologies (MERU's Lorentz model, and its product): the closed forms against float64 references
derived independently, fp32 accuracy, MERU's own code, the entailment loss, and every consumer working or refusing."""
import json
import math
import os
from pathlib import Path

import pytest
import torch

from topoclip.config import ConfigError, load_config
from topoclip.core import geometry as G
from topoclip.model.clip import CLIP

from _tolerance import gamma

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def tangent(count, radii, dim=16, seed=0):
    """(count, dim) float64 vectors in random directions with norms spread over `radii` (low, high)."""
    generator = torch.Generator().manual_seed(seed)
    v = torch.randn(count, dim, generator=generator, dtype=torch.float64)
    return v / v.norm(dim=-1, keepdim=True) * torch.linspace(*radii, count, dtype=torch.float64)[:, None]


def hyperboloid(x, c):
    """Space components (…, n) -> full coordinates (…, n + 1) on ⟨x, x⟩_L = −1/c, the time first."""
    return torch.cat([(1 / c + x.square().sum(-1, keepdim=True)).sqrt(), x], dim=-1)


def lorentz_product(a, b):
    """⟨a, b⟩_L = −a₀b₀ + Σ aᵢbᵢ of full coordinates, pairwise: (A, n + 1), (B, n + 1) -> (A, B)."""
    return -a[:, :1] * b[:, 0][None] + a[:, 1:] @ b[:, 1:].T


# --------------------------------------------------------------------------- closed forms (float64)


@pytest.mark.parametrize("c", [0.3, 1.0, 2.5])
def test_distance_is_the_arcosh_of_the_lorentz_product(c):
    u = G.exp_map0(tangent(9, (0.2, 3.0), seed=1), c)
    v = G.exp_map0(tangent(7, (0.2, 3.0), seed=2), c)
    expected = torch.acosh(-c * lorentz_product(hyperboloid(u, c), hyperboloid(v, c))) / c**0.5  # the definition
    got = -G.similarity("lorentz", u[:, None], v[:, None], curvature=c)
    # float64 both; the definition's −c⟨u, v⟩_L = z cancels numbers of size c·t_u·t_v ≤ cosh(3)² ≈ 100 into z = 1 + δ,
    # δ ≥ 0.005 here (asserted): an error of ~100 · 2⁻⁵³ ≈ 1e-14 in z, which arcosh(1 + δ) ≈ sqrt(2δ) turns into at most
    # 1e-14/sqrt(2 · 0.005) = 1e-13 in the distance.
    assert (-c * lorentz_product(hyperboloid(u, c), hyperboloid(v, c)) - 1).min() > 0.005
    torch.testing.assert_close(got, expected, atol=1e-11, rtol=1e-11)
    # The product form: the sum of the factors' distances (PHyCLIP's ℓ1 product).
    pairs, others = torch.stack([u[:6], v[:6]], dim=1), torch.stack([v[:6], u[3:]], dim=1)  # (6, 2, n): two factors
    product = -G.similarity("lorentz-product", pairs, others, curvature=c)
    factors = sum(torch.acosh(-c * lorentz_product(hyperboloid(pairs[:, k], c), hyperboloid(others[:, k], c)))
                  for k in range(2)) / c**0.5
    torch.testing.assert_close(product, factors, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("c", [0.3, 1.0, 2.5])
def test_the_exponential_map_walks_the_geodesic_from_the_origin(c):
    v = tangent(12, (1e-9, 10.0), seed=3) / c**0.5  # √c‖v‖ up to 10: inside MERU's sinh clamp (11.09)
    x = G.exp_map0(v, c)
    # On the geodesic through the origin along v, at distance ‖v‖ (the origin's space components are 0).
    origin = torch.zeros(1, 1, v.shape[1], dtype=torch.float64)
    torch.testing.assert_close(G.lorentz_distances(origin, x[:, None], c)[0, :, 0],
                               v.norm(dim=-1).clamp_min(math.acosh(1 + G.LORENTZ_DELTA_MIN) / c**0.5),
                               atol=1e-12, rtol=1e-12)  # float64: a few roundings of each closed form
    cosine = (x * v).sum(-1) / (x.norm(dim=-1) * v.norm(dim=-1))
    torch.testing.assert_close(cosine, torch.ones(12, dtype=torch.float64), atol=1e-14, rtol=0)
    torch.testing.assert_close(G.log_map0(x, c), v, atol=1e-12, rtol=1e-12)  # the inverse
    beyond = G.exp_map0(tangent(2, (20.0, 30.0), seed=4) / c**0.5, c)  # past the clamp: at the clamp's distance
    torch.testing.assert_close(beyond.norm(dim=-1), torch.full((2,), 2.0**15 / c**0.5, dtype=torch.float64))


@pytest.mark.parametrize("c", [0.3, 1.0, 2.5])
def test_the_exterior_angle_is_the_hyperbolic_law_of_cosines(c):
    x = G.exp_map0(tangent(10, (0.3, 2.5), seed=5), c)
    y = G.exp_map0(tangent(10, (0.3, 2.5), seed=6).flip(0), c)
    # Independently: the triangle (origin, x, y) with sides a = d(O, x), b = d(x, y), e = d(O, y), scaled to
    # curvature −1 by √c; its interior angle at x from cosh e = cosh a cosh b − sinh a sinh b cos θ; exterior π − θ.
    a, e = (torch.asinh(c**0.5 * p.norm(dim=-1)) for p in (x, y))
    b = c**0.5 * torch.stack([G.lorentz_distances(x[i:i + 1, None], y[i:i + 1, None], c)[0, 0, 0] for i in range(10)])
    interior = torch.acos((torch.cosh(a) * torch.cosh(b) - torch.cosh(e)) / (torch.sinh(a) * torch.sinh(b)))
    # float64: the law's argument carries ~2⁻⁵³·cosh a·cosh b/(sinh a·sinh b)·(a few) ≲ 1e-14 (cosh ≤ 100 here), and stays
    # 1e-5 from ±1 (asserted), where arccos's slope is ≤ 224: ≲ 3e-12 in the angle
    assert (torch.cos(interior).abs() < 1 - 1e-5).all()
    torch.testing.assert_close(G.exterior_angle(x, y, c), math.pi - interior, atol=1e-9, rtol=0)


def test_the_half_aperture_and_the_entailment_loss():
    c = 0.7
    x = G.exp_map0(tangent(6, (0.5, 3.0), seed=7), c)
    radius = c**0.5 * x.norm(dim=-1)
    torch.testing.assert_close(G.half_aperture(x, c), torch.asin(2 * G.ENTAILMENT_MIN_RADIUS / radius))  # MERU's
    near = G.exp_map0(tangent(2, (1e-6, 0.05), seed=8), c)  # inside the ball of radius 2K: the widest cone
    assert (G.half_aperture(near, c) > math.pi / 2 - 2e-3).all()
    # A point on the ray from the origin through x, beyond x, is inside x's cone: angle 0 (to the arccos clamp), loss 0.
    beyond = x * 1.5
    assert G.exterior_angle(x, beyond, c).max() <= math.acos(1 - G.ARCCOS_CLAMP_EPSILON) + 1e-9
    assert G.entailment("lorentz", x[:, None], beyond[:, None], c) < 1e-6
    # Behind x (towards the origin): the exterior angle is π (to the arccos clamp), outside every cone by π − aperture.
    behind = x * 0.5
    expected = (math.pi - G.half_aperture(x, c)).mean()
    torch.testing.assert_close(G.entailment("lorentz", x[:, None], behind[:, None], c), expected,
                               atol=math.acos(1 - G.ARCCOS_CLAMP_EPSILON) + 1e-9, rtol=0)
    with pytest.raises(ValueError, match="no entailment cones"):
        G.entailment("sphere", x[:, None], behind[:, None], None)
    # Far from the origin the cones are narrow (aperture ~1e-3 at ‖x‖ = 200): a point on the ray is still inside, in
    # float64 and in fp32. Failed before: the arccos clamp floored the angle at 1.4e-3, above the aperture (a loss
    # pulling the caption inwards), and fp32's arccos read a point on the ray at radius 6 as 0.2 rad off.
    far = G.exp_map0(tangent(4, (5.0, 7.0), seed=9) / c**0.5, c)
    assert G.entailment("lorentz", far[:, None], (far * 1.01)[:, None], c) == 0
    torch.testing.assert_close(G.exterior_angle(far, far * 0.99, c), torch.full((4,), math.pi, dtype=torch.float64))
    torch.testing.assert_close(G.exterior_angle(far, far, c),  # undefined where they coincide: MERU's π/2
                               torch.full((4,), math.pi / 2, dtype=torch.float64), atol=0, rtol=0)
    # fp32 against float64 on the same fp32 points, near the ray far out. The angle is atan2(√c‖x‖‖y‖ sin φ, ·): fp32's
    # worst case on sin φ = ‖x̂ − ŷ‖‖x̂ + ŷ‖/2 is about 2γ_(n+8) (the unit vectors' roundings), which the
    # triangle turns into √c‖y‖·2γ/sinh(√c·d) radians (d = d(x, y)); the cosine's side is no worse.
    x32 = G.exp_map0(tangent(4, (4.0, 6.0), seed=9) / c**0.5, c).float()
    for y32 in (x32 * 1.02, x32 * 0.98):
        got, exact = G.exterior_angle(x32, y32, c).double(), G.exterior_angle(x32.double(), y32.double(), c)
        d = G.lorentz_distances(x32.double()[:, None], y32.double()[:, None], c).diagonal().squeeze(0)
        bound = c**0.5 * y32.double().norm(dim=-1) * 2 * gamma(16 + 8) / torch.sinh(c**0.5 * d)
        assert (bound < 0.05).all() and ((got - exact).abs() <= bound).all(), ((got - exact).abs(), bound)


def test_the_hinges_are_per_pair_and_factor_and_their_mean_is_the_loss():
    c = 0.7
    x = G.exp_map0(tangent(6, (0.5, 3.0), seed=7), c).view(3, 2, -1)  # 3 pairs, m = 2 factors of H^16
    y = torch.stack([x[:, 0] * 1.5, x[:, 1] * 0.5], dim=1)  # factor 0 beyond its caption's point, factor 1 behind it
    hinges = G.entailment_hinges("lorentz-product", x, y, c)
    assert hinges.shape == (3, 2)
    assert (hinges[:, 0] == 0).all()
    # behind: outside by π − aperture, to the angle's clamp (as in the test above)
    torch.testing.assert_close(hinges[:, 1], math.pi - G.half_aperture(x[:, 1], c),
                               atol=math.acos(1 - G.ARCCOS_CLAMP_EPSILON) + 1e-9, rtol=0)
    assert G.entailment("lorentz-product", x, y, c) == hinges.mean()
    # one hyperboloid: the whole (m·n) vector is one point, one hinge a pair, of the flattened points
    whole = G.entailment_hinges("lorentz", x, y, c)
    assert whole.shape == (3, 1)
    torch.testing.assert_close(whole[:, 0], (G.exterior_angle(x.flatten(1), y.flatten(1), c)
                                             - G.half_aperture(x.flatten(1), c)).clamp_min(0), atol=0, rtol=0)
    assert G.entailment("lorentz", x, y, c) == whole.mean()


def test_gradients_are_finite_at_every_degenerate_point():
    c = torch.tensor(1.0, requires_grad=True)
    raw = torch.zeros(4, 2, 8)
    raw[1] = 1e-12
    raw[2] = 50.0  # past the sinh clamp
    raw[3] = torch.randn(2, 8)
    raw.requires_grad_()
    for topology in ("lorentz", "lorentz-product"):
        points = G.to_space(topology, raw, curvature=c)
        total = G.similarity(topology, points, points, curvature=c).sum() + G.entailment(topology, points, points, c)
        total = total + G.entailment(topology, points, points.flip(0), c)
        total.backward()
        assert torch.isfinite(total) and torch.isfinite(raw.grad).all() and torch.isfinite(c.grad)


# --------------------------------------------------------------------------- fp32


@pytest.mark.parametrize("radial", [False, True], ids=["any-direction", "on-the-ray"])
@pytest.mark.parametrize("radius, distance", [(1.0, 1e-2), (3.0, 1e-2), (3.0, 1e-1), (6.0, 3e-2), (0.5, 1.0)])
def test_fp32_distances_are_accurate_relative_to_the_distance(radius, distance, radial):
    """Near pairs far from the origin, in any direction and on one ray (where the entailment loss drives captions and
    images). Failed before: MERU's c(t_u t_v − uᵀv) − 1 cancels numbers of size c·t² (5 % off at d = 0.03, t ≈ 10), and
    (c/2)(‖u − v‖² − (t_u − t_v)²) lost every digit on a ray (10 % off at tangent radius 6, 48× at 11)."""
    c = 1.0
    generator = torch.Generator().manual_seed(9)
    direction = torch.randn(8, 64, generator=generator, dtype=torch.float64)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    step = direction if radial else torch.randn(8, 64, generator=generator, dtype=torch.float64)
    u, v = direction * radius, direction * radius + step / step.norm(dim=-1, keepdim=True) * distance  # tangent
    x, y = G.exp_map0(u, c).float(), G.exp_map0(v, c).float()
    exact = -G.similarity("lorentz", x.double()[:, None], y.double()[:, None], curvature=c)  # same fp32 inputs
    got = -G.similarity("lorentz", x[:, None], y[:, None], curvature=c)
    # The bound, from float64 quantities: δ = (c/2)·ab·g + r²/(2(a + t_x)(b + t_y)), g = ‖x̂ − ŷ‖², r = (a − b)(1 + (a +
    # b)/(t_x + t_y)), two terms ≥ 0. g carries γ_64/NEAR_PAIR_FRACTION of itself (the centred expansion keeps only
    # pairs that far from their norms; nearer ones are recomputed directly), a and b γ_64 each, so a − b carries
    # γ_64·(a + b) and r² twice that relative to |a − b|; a handful of roundings more on each. Then δ's error over δ,
    # which arcosh(1 + δ) passes on at most whole (its relative condition is ≤ 1).
    xd, yd = x.double(), y.double()
    a, b = xd.norm(dim=-1)[:, None], yd.norm(dim=-1)[None]
    tx, ty = (1 / c + a**2).sqrt(), (1 / c + b**2).sqrt()
    unit = ((xd / a)[:, None] - (yd / b.T)[None]).square().sum(-1)
    radial_term = ((a - b) * (1 + (a + b) / (tx + ty))).square() / (2 * (a + tx) * (b + ty))
    angular_term = c / 2 * a * b * unit
    g = gamma(64 + 8)
    delta = (angular_term + radial_term).clamp_min(G.LORENTZ_DELTA_MIN)
    error_delta = angular_term * (g / G.NEAR_PAIR_FRACTION + 4 * g) + radial_term * (2 * g * (a + b) / (a - b).abs().clamp_min(1e-300) + 8 * g)
    bound = error_delta / delta + gamma(8)
    error = (got.double() - exact).abs() / exact.abs()
    assert (error <= bound).all(), (error.max().item(), bound.min().item())
    assert error.diagonal().max() < 1e-3  # the matching pairs keep three digits or more



# --------------------------------------------------------------------------- MERU's own code


def meru_comparison():
    """docs/results/meru-equality.json, or, given TOPOCLIP_MERU=CHECKOUT (a clone of facebookresearch/meru), the
    comparison run now."""
    checkout = os.environ.get("TOPOCLIP_MERU")
    if not checkout:
        return json.loads((RESULTS / "meru-equality.json").read_text())
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("meru_equality", Path(__file__).resolve().parents[1] / "scripts"
                                                  / "meru_equality.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["meru_equality"] = module
    spec.loader.exec_module(module)
    meru = module.meru_module(Path(checkout))
    return {"runs": [module.compare(meru, c, seed) for seed, c in enumerate(module.CURVATURES)]}


def test_equal_to_meru_s_lorentz_functions_to_float64_rounding():
    """MERU's distance, exponential and logarithmic maps, half-aperture and exterior angle on random float64 inputs
    at three curvatures (scripts/meru_equality.py; MERU is CC BY-NC, so not copied here): every difference within the
    bound the script derives from the inputs' condition numbers, MERU's additive eps = 1e-8 taken out."""
    results = meru_comparison()
    assert {run["curvature"] for run in results["runs"]} == {0.1, 1.0, 3.0}
    for run in results["runs"]:
        assert set(run["functions"]) == {"exp_map0", "log_map0", "pairwise_dist", "half_aperture", "oxy_angle"}
        for name, row in run["functions"].items():
            assert row["max_abs_difference"] <= row["bound"], (run["curvature"], name, row)
            assert row["bound"] < 1e-7 * max(row["max_abs_value"], 1.0), (name, row)  # a bound that could fail
        # With MERU's eps left in, it alone moves the aperture and the angle: by far less than a degree.
        assert run["functions"]["half_aperture"]["with_meru_eps"] < 1e-6
        assert run["functions"]["oxy_angle"]["with_meru_eps"] < 1e-6


# --------------------------------------------------------------------------- the model and its consumers


def tiny(topology="lorentz", *overrides):
    return CLIP(load_config("tiny", [f"model.topology={topology}", *overrides]).model)


def test_the_curvature_and_scalings_are_meru_s():
    model = tiny("lorentz", "model.curvature.init=0.5")
    d = model.config.class_tokens * model.config.embed_dim
    assert {"curvature.log_c", "curvature.log_image_scale", "curvature.log_text_scale"} <= dict(model.named_parameters()).keys()
    assert model.curvature_value.item() == pytest.approx(0.5)
    assert model.curvature.scale("image").item() == pytest.approx(d**-0.5)
    product = tiny("lorentz-product")  # the whole embedding's d for the product too (see topoclip.core.curvature)
    assert product.curvature.scale("text").item() == pytest.approx(d**-0.5) and product.config.sphere_count > 1
    with torch.no_grad():
        model.curvature.log_c.fill_(5.0)
        model.curvature.log_image_scale.fill_(0.3)
    model.curvature.clamp_()
    assert model.curvature_value.item() == pytest.approx(5.0)  # 10 × init
    assert model.curvature.scale("image").item() == 1.0
    frozen = tiny("lorentz", "model.curvature.learnable=false")
    assert "curvature.log_c" not in dict(frozen.named_parameters()) and "curvature.log_c" in frozen.state_dict()
    assert tiny("sphere").curvature is None and "curvature.log_c" not in tiny("sphere").state_dict()


def test_encoders_give_points_on_the_hyperboloid_scored_by_the_model_s_curvature():
    model = tiny("lorentz", "model.curvature.init=2.0").eval()
    images = torch.randn(3, 3, model.config.vision.image_size, model.config.vision.image_size)
    with torch.no_grad():
        points = model.encode_image(images)
        raw = model.visual(images).reshape(3, *model.embedding_shape)
        expected = G.exp_map0((raw * model.curvature.scale("image")).flatten(1), 2.0).view_as(raw)
        torch.testing.assert_close(points, expected)
        torch.testing.assert_close(model.similarity(points, points),
                                   G.similarity("lorentz", points, points, curvature=2.0))
    with pytest.raises(ValueError, match="no flat form.*lorentz_index_vectors"):
        model.encode_image(images, flat=True)


def test_the_index_vectors_rank_as_the_distance():
    c = 0.8
    gallery = G.exp_map0(torch.randn(500, 1, 16, dtype=torch.float64), c)
    queries = G.exp_map0(torch.randn(20, 1, 16, dtype=torch.float64), c)
    ip = G.lorentz_index_vectors(queries, c, query=True) @ G.lorentz_index_vectors(gallery, c, query=False).T
    expected = G.similarity("lorentz", queries, gallery, curvature=c)
    torch.testing.assert_close(ip, lorentz_product(hyperboloid(queries[:, 0], c), hyperboloid(gallery[:, 0], c)))
    assert torch.equal(ip.argsort(dim=1, descending=True)[:, :10], expected.argsort(dim=1, descending=True)[:, :10])


@pytest.mark.parametrize("c", [-1.0, 0, 0.0, math.nan, math.inf, True, "1", bytearray(b"2"), 1 + 0j, torch.tensor(-1.0),
                               torch.tensor([1.0, 2.0]), torch.tensor(True), torch.tensor(1 + 0j)])
def test_the_library_refuses_a_curvature_that_is_not_one_finite_number_above_0(c):
    """From the hostile test of #61: c = −1 gave finite numbers (of no space), 0 a bare ZeroDivisionError, nan all-NaN
    scores, and to_space a complex-number error; the index helper took a product's points and ranked them wrongly."""
    x = torch.randn(4, 1, 8)
    for call in (lambda: G.similarity("lorentz", x, x, curvature=c), lambda: G.to_space("lorentz", x, curvature=c),
                 lambda: G.lorentz_index_vectors(x, c, query=True)):
        with pytest.raises(ValueError, match="curvature"):
            call()
    with pytest.raises(ValueError, match=r"a lorentz model's points \(B, 1, d\); got \(3, 4, 16\)"):
        G.lorentz_index_vectors(torch.randn(3, 4, 16), 1.0, query=False)


def test_the_library_takes_a_curvature_as_any_number_type():
    """NumPy's real scalars and 0-d arrays are numbers too (the second review: a 0-d array was refused as not one);
    its bools and complex numbers are not (the third: they were taken)."""
    import numpy as np

    x = torch.randn(4, 1, 8, dtype=torch.float64)
    expected = G.similarity("lorentz", x, x, curvature=0.5)
    for c in (np.float32(0.5), np.array(0.5), torch.tensor(0.5, dtype=torch.float64)):
        assert torch.equal(G.similarity("lorentz", x, x, curvature=c), expected)
    for c in (np.bool_(True), np.array(True), np.complex128(1 + 5j)):  # NumPy's bools and complex numbers are no c
        with pytest.raises(ValueError, match="curvature"):
            G.similarity("lorentz", x, x, curvature=c)


def test_the_cost_analysis_counts_the_curvature_and_the_scalings_apart():
    """From the hostile test of #61: the parts of `analyze cost`'s parameter count summed to 3 less than its total."""
    from topoclip.analysis.cost import count_parameters

    counts = count_parameters(CLIP(load_config("tiny", ["model.topology=lorentz"]).model))
    assert counts["curvature"] == 3 and counts["total"] == sum(v for k, v in counts.items() if k != "total")


def test_the_prompt_ensemble_averages_in_the_tangent_space():
    c = 1.3
    v = torch.randn(4, 2, 8, dtype=torch.float64)
    points = G.to_space("lorentz-product", torch.stack([v, -v]), curvature=c)  # (2, 4, 2, 8): x and its mirror
    torch.testing.assert_close(G.centroid("lorentz-product", points, c), torch.zeros(4, 2, 8, dtype=torch.float64))
    same = G.to_space("lorentz", v, curvature=c)
    torch.testing.assert_close(G.centroid("lorentz", torch.stack([same, same, same]), c), same)


def test_settings_that_cannot_work_are_refused_before_training():
    with pytest.raises(ConfigError, match="entailment_weight.*needs the cones of a hyperbolic space"):
        load_config("tiny", ["train.entailment_weight=0.2"])
    with pytest.raises(ConfigError, match="model.curvature.init"):
        load_config("tiny", ["model.topology=lorentz", "model.curvature.init=0"])
    with pytest.raises(ConfigError, match="model.curvature is the hyperbolic topologies'"):
        load_config("tiny", ["model.curvature.learnable=false"])  # a sphere has no curvature to freeze
    with pytest.raises(ConfigError, match="margin_relative.*unbounded"):
        load_config("tiny", ["model.topology=lorentz", "train.loss=triplet", "train.margin_relative=true"])
    with pytest.raises(ConfigError, match="\"flat\".*lorentz-product cannot use"):
        load_config("tiny", ["model.topology=lorentz-product", "evaluate.template_modes=[\"flat\"]"])


def test_exports_and_upcycling_refuse_in_one_line(tmp_path, capsys):
    from topoclip.io.convert.openclip_export import openclip_refusal
    from topoclip.io.convert.upcycle import upcycle

    config = load_config("tiny", ["model.topology=lorentz", "model.class_tokens=1"])
    assert "points of hyperbolic space (lorentz), scored by their distance" in openclip_refusal(config)
    with pytest.raises(ConfigError, match="upcycles the spheres only"):
        upcycle(CLIP(config.model), config, 4)
    sphere = load_config("tiny", ["model.topology=sphere", "model.class_tokens=1"])
    with pytest.raises(ConfigError, match="lorentz-product's is unbounded"):
        upcycle(CLIP(sphere.model), sphere, 4, topology="lorentz-product")
    # `benchmark` says it before it asks for clip_benchmark (installing that would not help)
    from topoclip.cli import main
    from topoclip.io.checkpoint import save_checkpoint

    folder = save_checkpoint(tmp_path / "lorentz", CLIP(config.model), config)
    assert main(["benchmark", str(folder), "--", "--dataset", "cifar10"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "lorentz embeddings have no flat form" in error and "topoclip eval" in error


def test_onnx_carries_the_curvature(tmp_path):
    pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    from topoclip.io.export_onnx import compare_with_pytorch, export_onnx

    config = load_config("tiny", ["model.topology=lorentz-product", "model.curvature.init=0.4"])
    model = CLIP(config.model).eval()
    export_onnx(model, config, None, tmp_path / "onnx")
    differences = compare_with_pytorch(model, config, tmp_path / "onnx", batch=3)
    # fp32 under two runtimes: the towers' roundings, then the exponential map's (relative, on points of norm ≲ 2)
    assert differences["image"] < 1e-5 and differences["text"] < 1e-5, differences
    session = onnxruntime.InferenceSession(str(tmp_path / "onnx" / "image_encoder.onnx"), providers=["CPUExecutionProvider"])
    metadata = session.get_modelmeta().custom_metadata_map
    assert metadata["topoclip.topology"] == "lorentz-product"
    assert float(metadata["topoclip.curvature"]) == pytest.approx(0.4)


def test_init_from_crosses_between_the_spheres_and_the_hyperboloids(tmp_path, capsys):
    """The topology is the run's choice: a hyperbolic run from a sphere checkpoint gets its towers and τ and a fresh
    curvature; a sphere run from a hyperbolic checkpoint leaves the curvature out."""
    from topoclip.io.checkpoint import save_checkpoint
    from topoclip.run.training.init_from import check_initial_checkpoint, load_initial_weights

    sphere_config = load_config("tiny")
    sphere = CLIP(sphere_config.model)
    folder = save_checkpoint(tmp_path / "sphere", sphere, sphere_config)
    config = load_config("tiny", ["model.topology=lorentz-product", "model.curvature.init=0.5",
                                  f"train.init_from={folder}"])
    check_initial_checkpoint(config)
    hyperbolic = CLIP(config.model)
    load_initial_weights(hyperbolic, config)
    assert torch.equal(hyperbolic.visual.proj, sphere.visual.proj)
    assert hyperbolic.curvature_value.item() == pytest.approx(0.5)  # as built: the checkpoint has none
    with torch.no_grad():
        hyperbolic.curvature.log_c.fill_(-0.2)
    back_folder = save_checkpoint(tmp_path / "hyperbolic", hyperbolic, config)
    back = load_config("tiny", [f"train.init_from={back_folder}"])
    check_initial_checkpoint(back)
    again = CLIP(back.model)
    load_initial_weights(again, back)
    assert again.curvature is None and torch.equal(again.text.text_projection, sphere.text.text_projection)
    # Between two hyperbolic runs, the learned c comes with the weights.
    twice = load_config("tiny", ["model.topology=lorentz-product", f"train.init_from={back_folder}"])
    model = CLIP(twice.model)
    load_initial_weights(model, twice)
    assert model.curvature.log_c.item() == pytest.approx(-0.2)
    # ... unless it lies outside the new run's clamp range, which would move it at the first step: refused.
    outside = load_config("tiny", ["model.topology=lorentz-product", "model.curvature.init=20",
                                   f"train.init_from={back_folder}"])
    with pytest.raises(ConfigError, match="outside this run's range.*model.curvature.init=0.8187"):
        check_initial_checkpoint(outside)
    # A run that does not learn c keeps its configured one, whatever the checkpoint's (from the hostile test of #61:
    # it trained at the checkpoint's c while its config.json said another), and says so; no range to check.
    fixed = load_config("tiny", ["model.topology=lorentz-product", "model.curvature.init=20",
                                 "model.curvature.learnable=false", f"train.init_from={back_folder}"])
    check_initial_checkpoint(fixed)
    model = CLIP(fixed.model)
    load_initial_weights(model, fixed)
    assert model.curvature_value.item() == pytest.approx(20.0)
    saved = f"{math.exp(torch.tensor(-0.2).item()):.9g}"  # log c as stored (fp32), its exp as the loader takes it
    assert f"keeps c = model.curvature.init = 20, not train.init_from's c = {saved}" in capsys.readouterr().err
    # the note's own advice ends the note (the second review: 6 digits of c did not, a rel_tol of 1e-6 apart)
    followed = load_config("tiny", ["model.topology=lorentz-product", f"model.curvature.init={saved}",
                                    "model.curvature.learnable=false", f"train.init_from={back_folder}"])
    load_initial_weights(CLIP(followed.model), followed)
    assert "note" not in capsys.readouterr().err


# --------------------------------------------------------------------------- the hierarchy measure


def test_each_caption_of_a_chain_entails_the_ones_before_it():
    """The measure's premise, exact: every scene a level-j caption describes, each level i < j describes too."""
    from topoclip.analysis.hierarchy import LEVELS, chain
    from topoclip.data.scenes.dataset import SceneDataset

    dataset = SceneDataset(load_config("tiny").data.scenes, "test")
    scenes = [dataset.scene(i) for i in range(200)]
    for scene in scenes[:40]:
        links = chain(scene.objects[0])
        assert len(links) == LEVELS and all(meaning.matches(scene.objects[0]) for _, meaning in links)
        for j in range(LEVELS):  # over every object of every scene: specific ⇒ generic
            for other in (obj for s in scenes for obj in s.objects):
                if links[j][1].matches(other):
                    assert all(links[i][1].matches(other) for i in range(j))
    texts = [text for text, _ in chain(scenes[0].objects[0])]
    assert texts[0] == "a photo of an object." and len(set(texts)) == LEVELS


def test_the_wilson_interval():
    from topoclip.analysis.hierarchy import wilson

    # 81 of 100, z = 1.96: centre (0.81 + z²/200)/(1 + z²/100) = 0.79853, half-width
    # z·sqrt(0.81·0.19/100 + z²/40000)/(1 + z²/100) = 0.07632 -> [0.7222, 0.8749]
    low, high = wilson(81, 100)
    assert (round(low, 4), round(high, 4)) == (0.7222, 0.8749)
    assert wilson(0, 50)[0] == pytest.approx(0.0, abs=1e-15) and wilson(50, 50)[1] == pytest.approx(1.0)


def test_the_hierarchy_analysis_writes_its_measures(tmp_path, monkeypatch):
    from topoclip.analysis.hierarchy import analyze_hierarchy, wilson
    from topoclip.io.checkpoint import save_checkpoint
    from topoclip.preprocess.tokenizer import Tokenizer
    from topoclip.run.inference import load_folder
    from topoclip.run.training.tokenizer_setup import fit_to_trained_tokenizer

    tokenizer = Tokenizer.train(["a photo of a small red star in the top left.", "an object", "a large blue circle"],
                                vocab_size=60, context_length=24)
    config = fit_to_trained_tokenizer(load_config("tiny", ["model.topology=lorentz-product"]), tokenizer)
    folder = save_checkpoint(tmp_path / "model", CLIP(config.model), config, tokenizer)
    result = analyze_hierarchy(load_folder(folder, "cpu"), tmp_path / "out", size=20, traversal_images=5, steps=3)
    assert (tmp_path / "out" / "hierarchy.png").is_file() and (tmp_path / "out" / "hierarchy.json").is_file()
    for name in ("trained", "untrained"):  # an untrained model of the same config is the baseline
        measured = result[name]
        assert measured["generic_nearer"]["all"]["chains"] == 20  # a chain is the unit of the interval
        assert all(row["trials"] == 20 for row in measured["generic_nearer"]["adjacent"])
        assert [row["s"] for row in measured["traversal"]] == [1.0, 0.5, 0.0]
        # At the origin every image is the same point: one caption is retrieved for all.
        assert measured["traversal"][-1]["level_std"] == 0.0
    # The report's table reads these files as they are written, one a seed (docs/results/lorentz-hierarchy-STEPS/).
    import shutil

    from topoclip.experiments import results as report

    landed = tmp_path / "results" / "lorentz-hierarchy-4"
    landed.mkdir(parents=True)
    for seed in (0, 1):
        shutil.copy(tmp_path / "out" / "hierarchy.json", landed / f"lorentz-product_lr-1e-3-seed-{seed}.json")
    monkeypatch.setattr(report.files, "RESULTS", tmp_path / "results")
    table = report.renderer_for("lorentz-hierarchy-4")(report.load_results("lorentz-hierarchy-4"))
    share = result["trained"]["generic_nearer"]["all"]["mean"]
    assert f"| lorentz-product_lr-1e-3 | 2 | {share:.2f} ± 0.00 | " in table
    assert "| cell | s = 1.0 | s = 0.5 | s = 0.0 |" in table and "(the first 5 images)" in table
    assert table.startswith("20 test scenes a run, each a chain of 5 captions from the generic (object)")
    # pooled: 2 seeds × 10 pairs × 20 chains = 400 trials, the successes those of one file twice
    pairs = result["trained"]["generic_nearer"]["pairs"].values()
    successes = 2 * sum(round(p["fraction"] * 20) for p in pairs)
    low, high = wilson(successes, 400)
    assert f" | {successes / 400:.3f} ({low:.3f}–{high:.3f}) | " in table
    other = json.loads((landed / "lorentz-product_lr-1e-3-seed-1.json").read_text())
    other["size"] = 21  # measured on other scenes: its numbers would share a column
    (landed / "lorentz-product_lr-1e-3-seed-1.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="seed-1 was measured on other test scenes"):
        report.renderer_for("lorentz-hierarchy-4")(report.load_results("lorentz-hierarchy-4"))
    sphere = fit_to_trained_tokenizer(load_config("tiny"), tokenizer)
    other = save_checkpoint(tmp_path / "sphere", CLIP(sphere.model), sphere, tokenizer)
    with pytest.raises(ConfigError, match="needs an origin"):
        analyze_hierarchy(load_folder(other, "cpu"), tmp_path / "out2", size=4, traversal_images=2)


def test_fp16_keeps_the_tower_scalings_gradient_finite():
    """Failed before: α multiplied the fp16 tower output under autocast, so log α's gradient (a sum over every
    coordinate) was reduced in fp16 and overflowed at the loss scales GradScaler starts with: steps skipped."""
    from topoclip.preprocess.tokenizer import TextBatch
    from topoclip.run.training.step import forward_backward_loss

    class Scaler:  # GradScaler's first scale, without its unscaling: the raw scaled gradients are what overflows
        def scale(self, loss):
            return loss * 65536.0

    torch.manual_seed(0)
    model = tiny("lorentz")
    size, length = model.config.vision.image_size, model.config.text.context_length
    images = torch.randn(8, 3, size, size)
    ids = torch.randint(5, model.config.text.vocab_size, (8, length))
    forward_backward_loss(model, images, TextBatch(ids, torch.ones_like(ids, dtype=torch.bool)), "infonce",
                          precision="fp16", scaler=Scaler(), entailment_weight=0.2)
    bad = [name for name, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert bad == [] and model.curvature.log_text_scale.grad is not None


def test_the_step_gives_the_loss_s_two_parts_of_the_whole_batch_at_any_accumulation():
    import copy

    from topoclip.core.losses import get_loss
    from topoclip.preprocess.tokenizer import TextBatch
    from topoclip.run.training.step import forward_backward_loss

    from _tolerance import model_roundings

    torch.manual_seed(0)
    model = tiny("lorentz").double()
    reference, accumulated = copy.deepcopy(model), copy.deepcopy(model)
    size, length = model.config.vision.image_size, model.config.text.context_length
    images = torch.randn(8, 3, size, size, dtype=torch.float64)
    ids = torch.randint(5, model.config.text.vocab_size, (8, length))
    text = TextBatch(ids, torch.ones_like(ids, dtype=torch.bool))
    parts, parts_accumulated = {}, {}
    loss = forward_backward_loss(model, images, text, "infonce", entailment_weight=0.2, terms=parts)
    forward_backward_loss(accumulated, images, text, "infonce", accumulation_steps=4, entailment_weight=0.2,
                          terms=parts_accumulated)
    assert set(parts) == set(parts_accumulated) == {"contrastive_loss", "entailment_loss"}
    assert loss == parts["contrastive_loss"] + 0.2 * parts["entailment_loss"]  # the same operations: exact
    out = reference(images, text)  # the same operations on the same weights: exact
    s = reference.similarity(out.image_embeds, out.text_embeds)
    assert parts["contrastive_loss"] == get_loss("infonce")(s, s.T, out.scale)
    assert parts["entailment_loss"] == reference.entailment(out.text_embeds, out.image_embeds)
    assert parts["entailment_loss"] > 0.05  # some images lie outside their caption's cone: the check below is not vacuous
    # k = 4: the last micro-batch's loss is the whole batch's (cached rows beside live ones), differing from k = 1 only
    # in the towers' summation orders: the whole loss's float64 bound (tests/training/test_step.py) holds for each part
    n = model_roundings(model.config, 8)
    for name, value in parts.items():
        assert abs(float(parts_accumulated[name]) - float(value)) <= n * 2.0**-53 * abs(float(value)), name
    single = {}
    forward_backward_loss(copy.deepcopy(reference), images, text, "infonce", terms=single)
    assert single == {}  # a loss of one part has no parts to log


@pytest.mark.slow
def test_a_run_logs_the_curvature_the_scalings_and_the_entailment_loss_s_parts(tmp_path, capsys):
    from topoclip.run.training.trainer import train

    small = ["train.num_workers=0", "train.log_every=1", "train.steps=3", "train.checkpoint_every=0", "evaluate.size=32",
             "evaluate.template_modes=[\"distance\"]", "data.scenes.train_size=256", "data.scenes.val_size=32",
             "data.scenes.test_size=32"]
    records = {}
    for name, settings in {"entail": ["model.topology=lorentz", "train.entailment_weight=0.2"],
                           "lorentz": ["model.topology=lorentz"], "sphere": []}.items():
        run = train(load_config("tiny", small + settings), out_dir=tmp_path / name, progress=False)
        lines = (run / "metrics.jsonl").read_text().splitlines()
        records[name] = [r for r in map(json.loads, lines) if "loss" in r]
        assert [r["step"] for r in records[name]] == [1, 2, 3]
        assert (run / "plots" / "curvature.png").is_file() == (name != "sphere")
        plots = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("plots: "))
        assert plots.endswith("(loss, temperature, learning_rate, " + ("curvature, " if name != "sphere" else "") + "evaluation)")
    hyperbolic, parts = {"curvature", "alpha_image", "alpha_text"}, {"contrastive_loss", "entailment_loss"}
    for record in records["entail"]:
        assert hyperbolic | parts <= set(record)
        # the logged loss is the step's fp32 loss, computed as contrastive + 0.2·entailment from the logged fp32 parts
        contrastive, entailment = (torch.tensor(record[key], dtype=torch.float32) for key in sorted(parts))
        assert record["loss"] == float(contrastive + 0.2 * entailment)
        assert 0 < record["alpha_image"] <= 1 and 0 < record["alpha_text"] <= 1  # MERU's clamp: α ≤ 1
    from topoclip.io.run_folder import is_record  # every reader takes the new numbers as numbers, or leaves the line

    assert not is_record({**records["entail"][0], "entailment_loss": "0.1"})
    assert all(hyperbolic <= set(r) and not parts & set(r) for r in records["lorentz"])
    assert all(not (hyperbolic | parts) & set(r) for r in records["sphere"])


def curvature_pull_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("curvature_pull", Path(__file__).resolve().parents[1] / "scripts"
                                                  / "curvature_pull.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_curvature_s_pull_is_the_training_step_s_log_c_gradient_split_by_part():
    import copy

    from topoclip.core.losses import loss_keywords
    from topoclip.preprocess.tokenizer import TextBatch
    from topoclip.run.training.step import forward_backward_loss

    from _tolerance import model_roundings

    torch.manual_seed(0)
    model = tiny("lorentz", "model.curvature.init=0.5").double()
    size, length = model.config.vision.image_size, model.config.text.context_length
    images = torch.randn(8, 3, size, size, dtype=torch.float64)
    ids = torch.randint(5, model.config.text.vocab_size, (8, length))
    text = TextBatch(ids, torch.ones_like(ids, dtype=torch.bool))
    keywords = loss_keywords(load_config("tiny", ["model.topology=lorentz"]))
    script = curvature_pull_script()
    measured = script.pull(copy.deepcopy(model), [(images, text)] * 2, "infonce", keywords)
    assert measured["c"] == pytest.approx(0.5) and measured["c_floor"] == pytest.approx(0.05)  # MERU's c₀/10
    assert measured["entailment_pull"] != 0 and measured["contrastive_pull"] != 0  # not vacuous
    n = model_roundings(model.config, 8)
    for weight in (0.0, 0.2):
        step, terms = copy.deepcopy(model), {}
        forward_backward_loss(step, images, text, "infonce", entailment_weight=weight, terms=terms, keywords=keywords)
        # the same operations in float64, bar the order in which autograd sums log c's several uses: within float64's
        # γ_n of the reference, the normwise bound tests/training/test_step.py holds the step's log c gradient to
        expected = float(step.curvature.log_c.grad)
        got = measured["contrastive_pull"] + weight * measured["entailment_pull"]
        assert abs(got - expected) <= n * 2.0**-53 * abs(expected), (weight, got, expected)
    assert (measured["contrastive"], measured["entailment"]) == (float(terms["contrastive_loss"]),
                                                                 float(terms["entailment_loss"]))
    # the share outside the cones: the pairs whose hinge is not 0, counted from the hinges themselves
    out = model(images, text)
    hinge = G.exterior_angle(out.text_embeds.flatten(1), out.image_embeds.flatten(1), model.curvature_value) \
        - G.half_aperture(out.text_embeds.flatten(1), model.curvature_value)
    assert measured["outside"] == (hinge.clamp_min(0) > 0).double().mean().item() and 0 < measured["outside"]
    with pytest.raises(ValueError, match="no curvature"):
        script.pull(tiny("sphere"), [], "infonce", keywords)
    with pytest.raises(ValueError, match="not learned"):
        script.pull(tiny("lorentz", "model.curvature.learnable=false"), [], "infonce", keywords)


def test_the_curvature_pull_table_averages_each_cell_s_seeds():
    from topoclip.experiments.results.grids import curvature_pull_table

    def run(cell, seed, weight, c, pull, step=100):
        return {"cell": cell, "seed": seed, "step": step, "weight": weight, "c": c, "c_floor": 0.1, "contrastive": 1.5,
                "entailment": 0.01, "outside": 0.25, "contrastive_pull": 0.0, "entailment_pull": pull}

    def rows(result):
        return {line.split(" | ")[0]: line for line in curvature_pull_table(result).splitlines() if line.startswith("| ")}

    result = {"command": "python scripts/curvature_pull.py", "batches": 8,
              "runs": [run("entail", 0, 0.2, 0.1, 0.05), run("entail", 1, 0.2, 0.1, 0.15), run("plain", 0, 0.0, 0.4, 1.0)]}
    drawn = rows(result)
    assert drawn["| entail"].endswith("| +2.0e-02 ± 1.4e-02 |")  # 0.2 × (0.05, 0.15): mean 0.02, sd 0.0141
    assert "| 0.100 ± 0.000 (0.1) |" in drawn["| entail"] and "| 25.0 ± 0.0 % |" in drawn["| entail"]
    assert drawn["| plain"].endswith("| — (not trained) |")
    result["runs"].append(run("entail", 0, 0.2, 0.1, 0.1, step=200))  # another schedule of the cell: a row apart
    assert {"| entail, 100 steps", "| entail, 200 steps"} <= set(rows(result))
    for wrong, message in ((run("entail", 2, 0.1, 0.1, 0.1), "its runs differ"), (run("entail", 1, 0.2, 0.1, 0.1),
                                                                                 "a seed appears twice")):
        with pytest.raises(ValueError, match=f"entail: {message}"):
            curvature_pull_table({**result, "runs": result["runs"] + [wrong]})


@pytest.mark.slow
def test_the_curvature_pull_script_reads_a_finished_run(tmp_path):
    import subprocess
    import sys

    from topoclip.run.training.trainer import train

    run = train(load_config("tiny", ["model.topology=lorentz", "train.entailment_weight=0.2", "train.steps=1",
                                     "train.num_workers=0", "evaluate.size=16", "data.scenes.train_size=64",
                                     "data.scenes.val_size=16", "data.scenes.test_size=16"]),
                out_dir=tmp_path / "cell" / "seed-0", progress=False)  # as ablate lays its runs out
    done = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "curvature_pull.py"),
                           "--batches", "1", str(run)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (measured,) = json.loads(done.stdout)["runs"]
    assert (measured["cell"], measured["step"], measured["weight"]) == ("cell", 1, 0.2)
    assert measured["c_floor"] == pytest.approx(0.1) and 0.1 <= measured["c"] <= 10


def test_the_landscape_s_loss_is_the_training_loss_with_its_entailment_term(tmp_path):
    from topoclip.analysis.landscape import batch_losses, model_loss_function, trainable_weights
    from topoclip.io.checkpoint import save_checkpoint
    from topoclip.preprocess.tokenizer import Tokenizer
    from topoclip.run.inference import load_folder
    from topoclip.run.training.step import batch_loss
    from topoclip.run.training.tokenizer_setup import fit_to_trained_tokenizer

    tokenizer = Tokenizer.train(["a large blue circle", "an object"], vocab_size=40, context_length=16)
    config = fit_to_trained_tokenizer(load_config("tiny", ["model.topology=lorentz", "train.entailment_weight=0.2"]),
                                      tokenizer)
    loaded = load_folder(save_checkpoint(tmp_path / "model", CLIP(config.model), config, tokenizer), "cpu")
    model, size = loaded.model, config.model.vision.image_size
    images, text = torch.randn(8, 3, size, size), tokenizer(["a large blue circle"] * 4 + ["an object"] * 4)
    scale = float(model.temperature.scale.detach())
    with torch.no_grad():
        landscape = batch_losses(model, {k: v.detach() for k, v in trainable_weights(model).items()}, images, text,
                                 [scale], model_loss_function(loaded))[0]
    training = batch_loss(model, images, text, config.train.loss, "fp32", None, config.train.entailment_weight)
    # the same operations on the same inputs (a functional call of the same weights): equal to fp32 rounding of the
    # loss, whose terms are ≤ ln(8) + 0.2·π
    torch.testing.assert_close(landscape, training, atol=1e-5, rtol=0)
    assert abs(float(training) - float(batch_loss(model, images, text, config.train.loss, "fp32"))) > 1e-3  # the term
