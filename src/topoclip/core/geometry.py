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

``TOPOLOGIES`` is a plain dict: adding a topology is adding one entry here.
The public entry points are :func:`to_space` and :func:`similarity`; the latter computes in fp32
(autocast off) and, for the topologies whose pairwise form needs a (rows, Bv, ·) intermediate,
in row chunks so memory stays O(chunk · Bv · m) — with gradient checkpointing per chunk when
gradients are needed, so the backward pass does not keep every chunk's intermediate either.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
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
    u, v = u.flatten(1), v.flatten(1)  # (Bu, d), (Bv, d)
    # One centre for both sets: the midpoint of their means (image and text clouds may sit apart).
    # A constant shift does not change the distances, so no gradient flows through it.
    centre = (u.detach().mean(0) + v.detach().mean(0)) / 2  # (d,)
    centred_u, centred_v = u - centre, v - centre
    u_squared = centred_u.square().sum(-1, keepdim=True)  # (Bu, 1)
    v_squared = centred_v.square().sum(-1)[None, :]  # (1, Bv)
    squared = u_squared + v_squared - 2.0 * (centred_u @ centred_v.T)  # (Bu, Bv)
    with torch.no_grad():  # (k,) indices of the near pairs (one host sync for k)
        rows, columns = torch.nonzero(squared < NEAR_PAIR_FRACTION * (u_squared + v_squared), as_tuple=True)
    if rows.numel():  # usually a few matching pairs
        squared = squared.index_put((rows, columns), _pair_squared_distances(u, v, rows, columns))
    return -squared.clamp_min(SQUARED_DISTANCE_MIN).sqrt()


def _pair_squared_distances(u: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """‖u_r − v_c‖² by direct difference for k index pairs: (Bu, d), (Bv, d), (k,), (k,) -> (k,).

    At most CHUNK_ELEMENTS difference elements are held at a time (checkpointed when gradients are
    needed), so even a batch whose pairs are all near stays within the memory budget.
    """
    def block(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (u[r] - v[c]).square().sum(-1)

    pairs = max(1, CHUNK_ELEMENTS // u.shape[1])
    if rows.numel() <= pairs:
        return block(rows, columns)
    needs_grad = torch.is_grad_enabled() and (u.requires_grad or v.requires_grad)
    return torch.cat([checkpoint(block, r, c, use_reentrant=False) if needs_grad else block(r, c)
                      for r, c in zip(rows.split(pairs), columns.split(pairs))])


def negative_geodesic(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """s = −sqrt(Σ_k arccos²(u_kᵀv_k)), the product-sphere geodesic. Holds (Bu, Bv, m)."""
    cosines = torch.einsum("imn,jmn->ijm", u, v)  # (Bu, Bv, m)
    lim = 1.0 - ARCCOS_CLAMP_EPSILON
    angles = torch.arccos(cosines.clamp(-lim, lim))
    return -angles.square().sum(-1).sqrt()  # sum ≥ m·arccos(1−ε)² > 0: sqrt has a finite slope


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Topology:
    """One embedding space: its projection, its pairwise similarity, the range of s, and how it is named."""

    project: Callable[[torch.Tensor], torch.Tensor]
    pairwise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
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


def to_space(topology: str, x: torch.Tensor) -> torch.Tensor:
    """Map raw outputs (B, m, n) onto the topology's space -> (B, m, n), computed in fp32."""
    with torch.autocast(x.device.type, enabled=False):
        return get_topology(topology).project(fp32_or_wider(x))


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
    topology: str, u: torch.Tensor, v: torch.Tensor, chunk_size: Optional[int] = None
) -> torch.Tensor:
    """Similarities s = −d(u_i, v_j): (Bu, m, n), (Bv, m, n) -> (Bu, Bv) fp32.

    Computed in fp32 with autocast disabled. For chunked topologies, rows of u are scored
    `chunk_size` at a time (default: from CHUNK_ELEMENTS); with gradients enabled each chunk is
    checkpointed, so neither pass holds a (Bu, Bv, m) tensor.
    """
    entry = get_topology(topology)
    if u.dim() != 3 or v.dim() != 3 or u.shape[1:] != v.shape[1:]:
        raise ValueError(f"similarity expects (Bu, m, n) and (Bv, m, n) with equal (m, n); got {tuple(u.shape)} and {tuple(v.shape)}")
    with torch.autocast(u.device.type, enabled=False):
        u, v = fp32_or_wider(u), fp32_or_wider(v)
        if not entry.chunked:
            return entry.pairwise(u, v)
        rows = chunk_size or chunk_rows(topology, v.shape[0], u.shape[1])
        if rows >= u.shape[0]:
            return entry.pairwise(u, v)
        needs_grad = torch.is_grad_enabled() and (u.requires_grad or v.requires_grad)
        if not needs_grad:  # write blocks in place: peak memory is the (Bu, Bv) result plus one chunk
            out = torch.empty(u.shape[0], v.shape[0], device=u.device, dtype=u.dtype)
            for start in range(0, u.shape[0], rows):
                out[start : start + rows] = entry.pairwise(u[start : start + rows], v)
            return out
        blocks = [checkpoint(entry.pairwise, u[start : start + rows], v, use_reentrant=False)
                  for start in range(0, u.shape[0], rows)]
        return torch.cat(blocks)
