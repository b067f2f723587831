"""Embedding topologies: where embeddings live and how two of them are scored.

An embedding is a tensor (m, n): m rows of dimension n. Every topology supplies

- ``project(x)``: raw encoder outputs (B, m, n) -> points on the space (B, m, n);
- ``pairwise(u, v)``: similarities s = −d(u, v) of every row of u (Bu, m, n) against every row
  of v (Bv, m, n) -> (Bu, Bv), in fp32.

| name        | space       | d(u, v)                          | range of s    |
|-------------|-------------|----------------------------------|---------------|
| sphere      | S^{mn−1}    | −uᵀv (whole vector normalised)   | [−1, 1]       |
| euclidean   | R^{mn}      | ‖u − v‖₂ (no normalisation)      | (−∞, 0]       |
| ps-geodesic | PS(n, m)    | sqrt(Σ_k arccos²(u_kᵀv_k))       | [−√m·π, 0]    |
| ps-inner    | PS(n, m)    | −Σ_k u_kᵀv_k                     | [−m, m]       |
| lorentz     | H^{mn}      | arcosh(−c⟨u, v⟩_L) / √c          | (−∞, 0]       |
| lorentz-product | (H^n)^m | Σ_k arcosh(−c⟨u_k, v_k⟩_L) / √c  | (−∞, 0]       |

The two hyperbolic topologies are MERU's (Desai et al., ICML 2023) and its product, PHyCLIP's ℓ1 product of
hyperbolic factors: a point of the hyperboloid ⟨x, x⟩_L = −1/c (curvature −c) is stored as its space
components x ∈ R^n, its time component t = sqrt(1/c + ‖x‖²) implied; ⟨u, v⟩_L = uᵀv − t_u t_v. Raw outputs
reach the hyperboloid by the exponential map at its origin. The curvature c is the model's (learnable):
`to_space`, `similarity` and the other functions take it as `curvature=` for these topologies (`curved`).

``TOPOLOGIES`` is a plain dict: adding a topology is adding one entry here.
The public entry points are :func:`to_space` and :func:`similarity`; the latter computes in fp32
(autocast off) and, for the topologies whose pairwise form needs a (rows, Bv, ·) intermediate,
in row chunks so memory stays O(chunk · Bv · m) — with gradient checkpointing per chunk when
gradients are needed, so the backward pass does not keep every chunk's intermediate either.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Projection onto a unit sphere divides by the norm; a raw vector of norm 0 would give NaN.
# F.normalize clamps the norm from below by this value (the output is then ~0, not NaN).
NORM_EPSILON = 1e-12

# arccos'(x) = −1/sqrt(1 − x²) is infinite at x = ±1, which a matching pair (u_k = v_k) hits.
# Cosines are clamped into [−1 + ε, 1 − ε] first: at ε = 1e-6 (representable next to 1 in fp32,
# whose spacing there is 6e-8) the slope is at most 1/sqrt(2e-6) ≈ 707, and the distance is off
# by at most arccos(1 − ε) ≈ 1.4e-3 rad per sphere.
ARCCOS_CLAMP_EPSILON = 1e-6

# ‖u − v‖ = sqrt(‖u − v‖²). The sqrt has an infinite slope at 0 (u = v, which a matching pair can
# reach): the squared distance is clamped from below by this value, so distances under 1e-6 read as
# 1e-6 and their gradient is 0 rather than infinite (or NaN).
SQUARED_DISTANCE_MIN = 1e-12

# The euclidean score expands ‖u − v‖² = ‖u‖² + ‖v‖² − 2uᵀv (one matmul, no (Bu, Bv, d) tensor). In
# fp32 that sum's rounding error is a few ulps of ‖u‖² + ‖v‖², so a pair much closer than its norms
# loses every digit (‖u‖ = 10, d = 1e-3: 99.9 % off). Two remedies keep the error relative to d:
# both sets are first centred on one point (distances are translation-invariant), which removes a
# shared offset; a pair whose expanded ‖u − v‖² is still below this fraction of ‖u‖² + ‖v‖² (centred)
# is recomputed as the direct difference u − v, which is exact in fp32 for nearby values. At 1e-3 the
# expansion's relative error on the pairs it keeps is at most ~1e-4 (a few × 6e-8 / 1e-3), and only
# the pairs closer than ~3 % of their (centred) norms, usually the matching ones, are recomputed.
NEAR_PAIR_FRACTION = 1e-3

# Default memory budget, in fp32 elements, for one chunk's (rows, Bv, m) intermediate: 2^25
# elements = 128 MiB. A 16k × 16k geodesic score with m = 16 then runs in chunks of 128 rows.
CHUNK_ELEMENTS = 2**25


# --------------------------------------------------------------------------- projections


def fp32_or_wider(x: torch.Tensor) -> torch.Tensor:
    """`x` in fp32, or unchanged when it is already wider (float64): the precision floor of similarities
    and losses. Half-precision inputs (autocast) are raised to fp32; a float64 model (the tests' exact
    reference) stays float64 end to end instead of being rounded to fp32 here."""
    return x if x.dtype == torch.float64 else x.float()


def normalize_whole(x: torch.Tensor) -> torch.Tensor:
    """(B, m, n) -> (B, m, n) with the flattened (m·n)-vector of unit norm."""
    flat = F.normalize(x.flatten(1), dim=-1, eps=NORM_EPSILON)
    return flat.view_as(x)


def normalize_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, m, n) -> (B, m, n) with each of the m rows of unit norm (a point of PS(n, m))."""
    return F.normalize(x, dim=-1, eps=NORM_EPSILON)


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


# --------------------------------------------------------------------------- pairwise scores


def inner_product(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """s = Σ_k u_kᵀv_k: one matmul of the flattened vectors. (Bu, m, n), (Bv, m, n) -> (Bu, Bv)."""
    return u.flatten(1) @ v.flatten(1).T


def negative_euclidean(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """s = −‖u − v‖₂ over the flattened vectors, without a (Bu, Bv, d) difference tensor.

    Accurate relative to the distance itself, also for pairs much closer than their norms (see
    NEAR_PAIR_FRACTION); the gradient is finite everywhere, 0 at u = v (see SQUARED_DISTANCE_MIN).
    """
    squared = squared_distances(u.flatten(1)[:, None], v.flatten(1)[:, None])[..., 0]  # (Bu, Bv)
    return -squared.clamp_min(SQUARED_DISTANCE_MIN).sqrt()


def squared_distances(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """‖u_k − v_k‖² of every row pair, factor by factor: (Bu, m, n), (Bv, m, n) -> (Bu, Bv, m), ≥ 0 up to rounding.

    Expanded as ‖u‖² + ‖v‖² − 2uᵀv (matmuls, no (Bu, Bv, m, n) difference), made accurate relative to each
    distance by centring and by recomputing the near pairs directly (see NEAR_PAIR_FRACTION).
    """
    # One centre per factor for both sets: the midpoint of their means (image and text clouds may sit apart).
    # A constant shift does not change the distances, so no gradient flows through it.
    centre = (u.detach().mean(0) + v.detach().mean(0)) / 2  # (m, n)
    centred_u, centred_v = u - centre, v - centre
    u_squared = centred_u.square().sum(-1)[:, None, :]  # (Bu, 1, m)
    v_squared = centred_v.square().sum(-1)[None, :, :]  # (1, Bv, m)
    if u.shape[1] == 1:  # one factor: a plain matmul
        cross = (centred_u[:, 0] @ centred_v[:, 0].T)[..., None]
    else:
        cross = torch.einsum("imn,jmn->ijm", centred_u, centred_v)
    squared = u_squared + v_squared - 2.0 * cross  # (Bu, Bv, m)
    with torch.no_grad():  # (k,) indices of the near pairs (one host sync for k)
        near = torch.nonzero(squared < NEAR_PAIR_FRACTION * (u_squared + v_squared), as_tuple=True)
    if near[0].numel():  # usually a few matching pairs
        squared = squared.index_put(near, _pair_squared_distances(u, v, *near))
    return squared


def _pair_squared_distances(u: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor,
                            factors: torch.Tensor) -> torch.Tensor:
    """‖u[r, k] − v[c, k]‖² by direct difference for p index triples: (Bu, m, n), (Bv, m, n), (p,) × 3 -> (p,).

    At most CHUNK_ELEMENTS difference elements are held at a time (checkpointed when gradients are
    needed), so even a batch whose pairs are all near stays within the memory budget.
    """
    def block(r: torch.Tensor, c: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (u[r, k] - v[c, k]).square().sum(-1)

    pairs = max(1, CHUNK_ELEMENTS // u.shape[2])
    if rows.numel() <= pairs:
        return block(rows, columns, factors)
    needs_grad = torch.is_grad_enabled() and (u.requires_grad or v.requires_grad)
    return torch.cat([checkpoint(block, r, c, k, use_reentrant=False) if needs_grad else block(r, c, k)
                      for r, c, k in zip(rows.split(pairs), columns.split(pairs), factors.split(pairs))])


def negative_geodesic(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """s = −sqrt(Σ_k arccos²(u_kᵀv_k)), the product-sphere geodesic. Holds (Bu, Bv, m)."""
    cosines = torch.einsum("imn,jmn->ijm", u, v)  # (Bu, Bv, m)
    lim = 1.0 - ARCCOS_CLAMP_EPSILON
    angles = torch.arccos(cosines.clamp(-lim, lim))
    return -angles.square().sum(-1).sqrt()  # sum ≥ m·arccos(1−ε)² > 0: sqrt has a finite slope


# --------------------------------------------------------------------------- hyperbolic (Lorentz) space
#
# Points are the space components x (…, n) of the hyperboloid ⟨x, x⟩_L = −1/c; the time component
# t = sqrt(1/c + ‖x‖²) is implied (MERU's convention, meru/lorentz.py). c > 0 is the curvature's magnitude.
# Every function takes the curvature as a 0-d tensor or a float and works factor by factor on (…, m, n).

# The exponential and logarithmic maps at the origin scale x by sinh(r)/r and asinh(r)/r, r = √c‖x‖; both ratios
# tend to 1 as r → 0, where x/r is 0/0. r is clamped from below by this value (MERU's eps): below it the ratios
# are 1 to within r²/6 ≈ 2e-17, and the gradient is the identity's.
MAP_NORM_MIN = 1e-8

# sinh overflows fp32 at r ≈ 89; MERU clamps its input at asinh(2^15) ≈ 11.09, so that a point's space norm is at
# most 2^15/√c. Beyond it a tangent vector's length no longer moves its point (the radial gradient is 0); its
# direction still does.
SINH_INPUT_MAX = math.asinh(2.0**15)

# d = arcosh(1 + δ)/√c, δ = −c⟨u, v⟩_L − 1 ≥ 0. arcosh'(1 + δ) = 1/sqrt(δ(2 + δ)) is infinite at δ = 0, which a
# matching pair can reach: δ is clamped from below by this value, as ARCCOS_CLAMP_EPSILON clamps the cosines, so
# the slope is at most 1/sqrt(2e-6) ≈ 707 and a distance under arcosh(1 + 1e-6)/√c ≈ 1.4e-3/√c reads as that.
# (MERU clamps −c⟨u, v⟩_L at 1 + 1e-8, which is 1 itself in fp32: its slope at a matching pair is unbounded.)
LORENTZ_DELTA_MIN = 1e-6

# MERU's entailment cones: the half-aperture of the cone at x is asin(2K / (√c‖x‖)), undefined within √c‖x‖ < 2K of
# the origin, where it is π/2 (the asin's input clamped at 1 − ARCCOS_CLAMP_EPSILON). K is MERU's min_radius.
ENTAILMENT_MIN_RADIUS = 0.1

# The exterior angle at x is undefined where y coincides with x: there both of atan2's arguments (D·sin θ, D·cos θ,
# D ≈ ‖x‖·√c·d(x, y)) vanish, and atan2's gradient is 0/0. Below this scale the angle reads π/2 (MERU's value there)
# with no gradient: points within ~1e-8/‖x‖ of each other.
ANGLE_SCALE_MIN = 1e-8


def lorentz_time(x: torch.Tensor, curvature) -> torch.Tensor:
    """The time components t = sqrt(1/c + ‖x‖²) of points x (…, n) -> (…)."""
    return (1.0 / curvature + x.square().sum(-1)).sqrt()


def exp_map0(x: torch.Tensor, curvature) -> torch.Tensor:
    """Tangent vectors at the hyperboloid's origin (…, n) -> the points they reach (…, n): x · sinh(r)/r, r = √c‖x‖."""
    r = torch.linalg.vector_norm(x, dim=-1, keepdim=True) * curvature**0.5
    r = r.clamp_min(MAP_NORM_MIN)
    return x * (torch.sinh(r.clamp_max(SINH_INPUT_MAX)) / r)


def log_map0(x: torch.Tensor, curvature) -> torch.Tensor:
    """Points (…, n) -> their tangent vectors at the origin (…, n), the inverse of `exp_map0`: x · asinh(r)/r.

    The distance to the origin is arcosh(√c·t)/√c = asinh(√c‖x‖)/√c; asinh needs no clamp (MERU's arcosh form
    clamps its input at 1 + eps instead)."""
    r = (torch.linalg.vector_norm(x, dim=-1, keepdim=True) * curvature**0.5).clamp_min(MAP_NORM_MIN)
    return x * (torch.asinh(r) / r)


def _lorentz_delta(unit_squared: torch.Tensor, u_norm: torch.Tensor, v_norm: torch.Tensor, curvature) -> torch.Tensor:
    """δ = −c⟨u, v⟩_L − 1 ≥ 0 from the directions' ‖û − v̂‖² and the norms a = ‖u‖, b = ‖v‖ (broadcast together).

    With t = sqrt(1/c + a²): δ = (c/2)·ab‖û − v̂‖² + ½·((a − b)(1 + (a + b)/(t_u + t_v)))²/((a + t_u)(b + t_v)), two
    terms ≥ 0, so nothing cancels: neither MERU's c(t_u t_v − uᵀv) − 1, which subtracts numbers of size c·t², nor
    (c/2)(‖u − v‖² − (t_u − t_v)²), which loses every digit for points on one ray from the origin (where the
    entailment loss drives captions and images). Not clamped: the distance clamps it (LORENTZ_DELTA_MIN)."""
    u_time = (1.0 / curvature + u_norm.square()).sqrt()
    v_time = (1.0 / curvature + v_norm.square()).sqrt()
    radial = (u_norm - v_norm) * (1.0 + (u_norm + v_norm) / (u_time + v_time))  # (a − b) + (t_u − t_v)
    return curvature / 2 * u_norm * v_norm * unit_squared + radial.square() / (2 * (u_norm + u_time) * (v_norm + v_time))


def _arcosh1p(delta: torch.Tensor) -> torch.Tensor:
    """arcosh(1 + δ) = log1p(δ + sqrt(δ(2 + δ))), accurate for small δ (1 + δ would round δ away)."""
    return torch.log1p(delta + (delta * (2.0 + delta)).sqrt())


def lorentz_distances(u: torch.Tensor, v: torch.Tensor, curvature) -> torch.Tensor:
    """Geodesic distances factor by factor: (Bu, m, n), (Bv, m, n) -> (Bu, Bv, m), each arcosh(−c⟨u_k, v_k⟩_L)/√c."""
    u_norm, v_norm = torch.linalg.vector_norm(u, dim=-1), torch.linalg.vector_norm(v, dim=-1)  # (Bu, m), (Bv, m)
    unit_squared = squared_distances(F.normalize(u, dim=-1, eps=NORM_EPSILON), F.normalize(v, dim=-1, eps=NORM_EPSILON))
    delta = _lorentz_delta(unit_squared, u_norm[:, None], v_norm[None], curvature).clamp_min(LORENTZ_DELTA_MIN)
    return _arcosh1p(delta) / curvature**0.5


def negative_lorentz(u: torch.Tensor, v: torch.Tensor, curvature) -> torch.Tensor:
    """s = −d(u, v) on one hyperboloid H^{mn}: the (Bu, m, n) rows are one point each. -> (Bu, Bv)."""
    return -lorentz_distances(u.flatten(1)[:, None], v.flatten(1)[:, None], curvature)[..., 0]


def negative_lorentz_product(u: torch.Tensor, v: torch.Tensor, curvature) -> torch.Tensor:
    """s = −Σ_k d(u_k, v_k) on m hyperboloids H^n (PHyCLIP's ℓ1 product). Holds (Bu, Bv, m)."""
    return -lorentz_distances(u, v, curvature).sum(-1)


def half_aperture(x: torch.Tensor, curvature) -> torch.Tensor:
    """Half-apertures of the entailment cones at points x (…, n) -> (…), in (0, π/2] (MERU's `half_aperture`)."""
    radius = (torch.linalg.vector_norm(x, dim=-1) * curvature**0.5).clamp_min(MAP_NORM_MIN)
    return torch.asin((2 * ENTAILMENT_MIN_RADIUS / radius).clamp_max(1.0 - ARCCOS_CLAMP_EPSILON))


def exterior_angle(x: torch.Tensor, y: torch.Tensor, curvature) -> torch.Tensor:
    """The exterior angle at x of the triangle (origin, x, y), pair by pair: (…, n), (…, n) -> (…) in [0, π]
    (MERU's `oxy_angle`): 0 when y lies on the ray from the origin through x, beyond x; π/2 where x and y coincide
    (within ANGLE_SCALE_MIN, where it is undefined; MERU's value there too).

    By the hyperbolic law of cosines cos θ = (t_y − (1 + δ) t_x)/D and, from the triangle's area, sin θ =
    √c‖x‖‖y‖ sin φ / D, φ the angle between x and y as vectors, D = ‖x‖ sqrt(δ(2 + δ)): θ = atan2 of the two
    numerators, with sin φ = ‖x̂ − ŷ‖‖x̂ + ŷ‖/2 and δ, t_y − t_x free of cancellation. MERU's arccos of their ratio
    loses the angle near 0 and π (a point on x's ray far out read ~0.2 rad in fp32), and its clamp would floor it
    at arccos(1 − ε), above the cones' half-aperture far from the origin."""
    x_norm, y_norm = torch.linalg.vector_norm(x, dim=-1), torch.linalg.vector_norm(y, dim=-1)
    x_unit, y_unit = F.normalize(x, dim=-1, eps=NORM_EPSILON), F.normalize(y, dim=-1, eps=NORM_EPSILON)
    difference = torch.linalg.vector_norm(x_unit - y_unit, dim=-1)  # 2 sin(φ/2)
    delta = _lorentz_delta(difference.square(), x_norm, y_norm, curvature)
    x_time, y_time = (1.0 / curvature + x_norm.square()).sqrt(), (1.0 / curvature + y_norm.square()).sqrt()
    cosine = (y_norm - x_norm) * (y_norm + x_norm) / (x_time + y_time) - delta * x_time  # D·cos θ
    sine = curvature**0.5 * x_norm * y_norm * difference * torch.linalg.vector_norm(x_unit + y_unit, dim=-1) / 2
    undefined = sine.square() + cosine.square() < ANGLE_SCALE_MIN**2
    angle = torch.atan2(torch.where(undefined, 0.0, sine), torch.where(undefined, 1.0, cosine))
    return torch.where(undefined, math.pi / 2, angle)


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Topology:
    """One embedding space: its projection, its pairwise similarity, the range of s, and how it is named."""

    project: Callable[..., torch.Tensor]  # (x) -> points, or (x, curvature) when `curved`
    pairwise: Callable[..., torch.Tensor]  # (u, v) -> s, or (u, v, curvature) when `curved`
    similarity_range: Callable[[int], tuple[float, float]]  # m -> (lowest, highest) s
    # True when `pairwise` holds a (rows, Bv, ·) intermediate and must run in row chunks.
    chunked: bool
    # True for a product of m spheres: an embedding is m unit rows, one per class token unless model.spheres
    # says otherwise; False when the m rows are one vector (m is then 1 whatever the class tokens).
    product: bool
    # Display name; {d} total dimension, {n} and {m} a row's size and the rows, {kind} "Multi" for several
    # class tokens and "PS" for one (product spheres only).
    label: str
    # Why no inner product of the flattened (B, m·n) embeddings equals the similarity; "" when Σ_k u_kᵀv_k
    # does, so that `flatten`'s vectors serve an inner-product index, CLIP_benchmark and OpenCLIP-style code.
    not_flat: str = ""
    # True for the hyperbolic spaces: `project` and `pairwise` take the curvature as a third argument.
    curved: bool = False

    def half_range(self, m: int) -> float:
        """(s_max − s_min) / 2 with m spheres: how far the logits τ·s reach either side of their middle per unit of τ,
        and the unit of a relative margin (inf for an unbounded similarity)."""
        low, high = self.similarity_range(m)
        return (high - low) / 2


TOPOLOGIES: dict[str, Topology] = {
    "sphere": Topology(normalize_whole, inner_product, lambda m: (-1.0, 1.0), chunked=False, product=False,
                       label="Sphere({d})"),
    "euclidean": Topology(identity, negative_euclidean, lambda m: (-math.inf, 0.0), chunked=False, product=False,
                          label="Euclidean R^{d}",
                          not_flat="its similarity −‖u − v‖ depends on the vectors' norms, which an inner product "
                                   "ranks differently"),
    "ps-geodesic": Topology(normalize_rows, negative_geodesic, lambda m: (-math.sqrt(m) * math.pi, 0.0),
                            chunked=True, product=True, label="{kind}({n},{m}) geodesic",
                            not_flat="its similarity −sqrt(Σ_k arccos²(u_kᵀv_k)) is not a function of Σ_k u_kᵀv_k; "
                                     "rank ps-inner candidates by model.similarity instead"),
    "ps-inner": Topology(normalize_rows, inner_product, lambda m: (-float(m), float(m)), chunked=False, product=True,
                         label="{kind}({n},{m})"),
    "lorentz": Topology(lambda x, c: exp_map0(x.flatten(1), c).view_as(x), negative_lorentz,
                        lambda m: (-math.inf, 0.0), chunked=False, product=False, curved=True, label="Lorentz H^{d}",
                        not_flat="its similarity −arcosh(−c⟨u, v⟩_L)/√c is a decreasing function of the Lorentzian "
                                 "product ⟨u, v⟩_L = uᵀv − t_u t_v, not of uᵀv; an inner-product index ranks by it when "
                                 "items are stored as [x, t] and queries as [x, −t] (geometry.lorentz_index_vectors)"),
    "lorentz-product": Topology(exp_map0, negative_lorentz_product, lambda m: (-math.inf, 0.0), chunked=True,
                                product=True, curved=True, label="{kind}-Lorentz(H^{n})^{m}",
                                not_flat="its similarity −Σ_k arcosh(−c⟨u_k, v_k⟩_L)/√c, a sum over hyperboloids, is "
                                         "no function of one inner product; rank candidates by model.similarity"),
}


def get_topology(name: str) -> Topology:
    """The registry entry for `name`, or a ValueError listing the known names."""
    try:
        return TOPOLOGIES[name]
    except KeyError:
        raise ValueError(f"unknown topology {name!r}; choose one of {sorted(TOPOLOGIES)}") from None


def implied_topology(class_tokens: int, single: str = "sphere") -> str:
    """The topology a model's shapes imply when nothing names it (an imported or upcycled checkpoint): several
    class tokens are the paper's Multi, ps-inner (Eq. 5's sum of per-sphere inner products); one keeps `single`."""
    return "ps-inner" if class_tokens > 1 else single


# --------------------------------------------------------------------------- public API


def _curvature(entry: Topology, topology: str, curvature):
    """The curvature in fp32 (or float64) for a curved topology; a ValueError when it is missing or given to a flat one,
    or is not one finite number > 0. A tensor's value is checked in eager mode on the CPU only: on an accelerator the
    check would wait for it every step, under torch.compile it would break the graph, and the model's c is exp of a
    clamped log, positive and finite by construction."""
    if entry.curved != (curvature is not None):
        raise ValueError(f"{topology} {'needs the model' if entry.curved else 'takes no'} curvature")
    if curvature is None:
        return None
    given = curvature
    if isinstance(curvature, torch.Tensor):
        if curvature.dim() != 0 or curvature.dtype == torch.bool or curvature.is_complex():
            raise ValueError(f"{topology}'s curvature is one real number (a 0-d tensor); got {curvature.dtype} of "
                             f"shape {tuple(curvature.shape)}")
        if curvature.device.type != "cpu" or torch.compiler.is_compiling():
            return fp32_or_wider(curvature)
        value, curvature = curvature.item(), fp32_or_wider(curvature)
    else:  # a Python or NumPy real number or 0-d real array, used as the float it is; no bool, complex or text
        if getattr(curvature, "shape", None) == () and getattr(getattr(curvature, "dtype", None), "kind", "") in "fiu":
            curvature = curvature.item()
        real = isinstance(curvature, numbers.Real) and not isinstance(curvature, bool)
        value = curvature = float(curvature) if real else math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{topology}'s curvature c (the space's is −c) must be a finite number > 0; got {given!r:.40}")
    return curvature


def _pairwise(entry: Topology, curvature) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return partial(entry.pairwise, curvature=curvature) if entry.curved else entry.pairwise


def to_space(topology: str, x: torch.Tensor, curvature=None) -> torch.Tensor:
    """Map raw outputs (B, m, n) onto the topology's space -> (B, m, n), computed in fp32.

    curvature: c > 0 (0-d tensor or float) for the curved topologies, None for the others."""
    entry = get_topology(topology)
    with torch.autocast(x.device.type, enabled=False):
        curvature = _curvature(entry, topology, curvature)
        x = fp32_or_wider(x)
        return entry.project(x, curvature) if entry.curved else entry.project(x)


def centroid(topology: str, points: torch.Tensor, curvature=None) -> torch.Tensor:
    """The mean of points (K, B, m, n) over K -> (B, m, n) on the space: CLIP's prompt ensemble. The spheres
    renormalise the mean (to_space); the hyperboloids average in the tangent space at the origin and map back
    (MERU's zero-shot classifier)."""
    entry = get_topology(topology)
    with torch.autocast(points.device.type, enabled=False):
        points = fp32_or_wider(points)
        if not entry.curved:
            return to_space(topology, points.mean(0))
        curvature = _curvature(entry, topology, curvature)
        rows = points if entry.product else points.flatten(2)
        return exp_map0(log_map0(rows, curvature).mean(0), curvature).view(points.shape[1:])


def entailment_hinges(topology: str, generic: torch.Tensor, specific: torch.Tensor, curvature) -> torch.Tensor:
    """How far each `specific` point lies outside the cone of its `generic` one, in radians, max(0, angle − aperture):
    (B, m, n), (B, m, n) -> (B, m) fp32 for m hyperboloids, (B, 1) for one (the whole vector is one point).

    MERU's text entails its image: generic = the caption, specific = the image. For m factors the cones are per
    factor."""
    entry = get_topology(topology)
    if not entry.curved:
        raise ValueError(f"{topology} has no entailment cones (only the hyperbolic topologies do)")
    with torch.autocast(generic.device.type, enabled=False):
        curvature = _curvature(entry, topology, curvature)
        generic, specific = fp32_or_wider(generic), fp32_or_wider(specific)
        if not entry.product:
            generic, specific = generic.flatten(1)[:, None], specific.flatten(1)[:, None]
        return (exterior_angle(generic, specific, curvature) - half_aperture(generic, curvature)).clamp_min(0)


def entailment(topology: str, generic: torch.Tensor, specific: torch.Tensor, curvature) -> torch.Tensor:
    """MERU's entailment loss of paired points (B, m, n) on a curved topology -> 0-d fp32: the hinges
    (`entailment_hinges`) averaged over pairs and factors, so that MERU's weight (0.2) keeps its scale for every m."""
    return entailment_hinges(topology, generic, specific, curvature).mean()


def lorentz_index_vectors(points: torch.Tensor, curvature, query: bool) -> torch.Tensor:
    """"lorentz" points (B, m, n) -> (B, m·n + 1) vectors for an inner-product index: items [x, t], queries
    [x, −t], whose inner product is ⟨q, x⟩_L = −cosh(√c·d)/c, so the largest is the nearest (the similarity itself is
    −arcosh(−c·ip)/√c, a decreasing function). The product form has no such vectors (see its `not_flat`)."""
    if points.dim() != 3 or points.shape[1] != 1:
        raise ValueError(f"lorentz_index_vectors takes a lorentz model's points (B, 1, d); got {tuple(points.shape)} (the "
                         f"product of hyperboloids, lorentz-product, has no inner-product form)")
    flat = fp32_or_wider(points).flatten(1)
    time = lorentz_time(flat, _curvature(get_topology("lorentz"), "lorentz", curvature))
    return torch.cat([flat, (-time if query else time)[:, None]], dim=1)


def flatten(topology: str, points: torch.Tensor) -> torch.Tensor:
    """Points on the space (B, m, n) -> (B, m·n) whose inner product is the similarity: flat(u) flat(v)ᵀ = s(u, v).

    For "sphere" and "ps-inner" (each sub-sphere unit-norm: the whole vector has norm √m). Refused with a
    ValueError naming the reason for the topologies whose similarity no inner product reproduces.
    """
    require_flat(topology)
    return points.flatten(1)


def require_flat(topology: str) -> None:
    """ValueError naming the reason when `topology`'s similarity is no inner product of flattened embeddings."""
    reason = get_topology(topology).not_flat
    if reason:
        raise ValueError(f"{topology} embeddings have no flat form: {reason}")


def chunk_rows(topology: str, num_columns: int, m: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Rows per chunk so that one chunk's (rows, num_columns, m) intermediate fits the budget."""
    return max(1, chunk_elements // max(1, num_columns * m))


def similarity(
    topology: str, u: torch.Tensor, v: torch.Tensor, chunk_size: Optional[int] = None, curvature=None
) -> torch.Tensor:
    """Similarities s = −d(u_i, v_j): (Bu, m, n), (Bv, m, n) -> (Bu, Bv) fp32.

    Computed in fp32 with autocast disabled. For chunked topologies, rows of u are scored
    `chunk_size` at a time (default: from CHUNK_ELEMENTS); with gradients enabled each chunk is
    checkpointed, so neither pass holds a (Bu, Bv, m) tensor. curvature: as for `to_space`.
    """
    entry = get_topology(topology)
    if u.dim() != 3 or v.dim() != 3 or u.shape[1:] != v.shape[1:]:
        raise ValueError(f"similarity expects (Bu, m, n) and (Bv, m, n) with equal (m, n); got {tuple(u.shape)} and {tuple(v.shape)}")
    with torch.autocast(u.device.type, enabled=False):
        u, v = fp32_or_wider(u), fp32_or_wider(v)
        pairwise = _pairwise(entry, _curvature(entry, topology, curvature))
        if not entry.chunked:
            return pairwise(u, v)
        rows = chunk_size or chunk_rows(topology, v.shape[0], u.shape[1])
        if rows >= u.shape[0]:
            return pairwise(u, v)
        needs_grad = torch.is_grad_enabled() and (u.requires_grad or v.requires_grad)
        if not needs_grad:  # write blocks in place: peak memory is the (Bu, Bv) result plus one chunk
            out = torch.empty(u.shape[0], v.shape[0], device=u.device, dtype=u.dtype)
            for start in range(0, u.shape[0], rows):
                out[start : start + rows] = pairwise(u[start : start + rows], v)
            return out
        blocks = [checkpoint(pairwise, u[start : start + rows], v, use_reentrant=False)
                  for start in range(0, u.shape[0], rows)]
        return torch.cat(blocks)
