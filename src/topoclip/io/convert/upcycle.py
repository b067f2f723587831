"""Upcycle a single-token CLIP into Multi(n, m), ready to fine-tune (`topoclip train --init-from`).

What each part becomes (d = the source's embedding size, w = a tower's width):

- Image class token: the (1, w) class embedding copied m times; copies 2 … m get Gaussian noise
  of std `noise` × the embedding's RMS, so the m tokens can diverge. Its positional row is copied
  to the m class positions.
- Text tokens: class-token pooling (BERT style) copies positional row 0 to the m class positions,
  with the same noise on copies 2 … m (the text class tokens differ only by position).
  End-of-text pooling (OpenAI) needs no copy: the m end-of-text tokens sit at consecutive,
  already trained positions; the table only grows by m − 1 rows (copies of its last, with noise).
- Projections: **truncated SVD, not re-initialisation.** Both towers' (w, d) projections are
  multiplied by the same (d, n) matrix V: the n leading right singular vectors of the two
  projections stacked. Every token then gives the best rank-n approximation (up to a rotation)
  of the source's shared d-dimensional space, so image–text alignment survives and the upcycled
  model starts ranking like the source. n = d keeps the projections as they are; n > d is refused
  (there is nothing to split).
- Temperature: the similarity now lies in [−m, m] and starts at about m × the source's cosine,
  so t becomes t − ln m and max_scale becomes max_scale / m: the logits start where the source's
  were (the paper lowers the clamp to 100/16 for Multi(32, 16) the same way).
- Topology: ps-inner (the paper's) when m > 1, unless another is asked for; the spheres only (a hyperbolic
  model's similarity is unbounded, so the temperature rule has nothing to keep: train from an upcycled sphere
  instead, `--init-from`, which starts the curvature fresh).

With m = 1 and n = d nothing changes: the upcycled model reproduces the source exactly.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from topoclip.config import Config, ConfigError, from_dict, to_dict, validate
from topoclip.core.geometry import TOPOLOGIES, implied_topology
from topoclip.model.clip import CLIP

DEFAULT_NOISE = 0.02  # relative to the copied row's RMS


def _copies(row: torch.Tensor, count: int, noise: float, generator: torch.Generator) -> torch.Tensor:
    """(w,) -> (count, w): the row, then count − 1 copies with noise of std noise × RMS(row)."""
    rows = row[None].repeat(count, 1)
    if count > 1 and noise:
        scale = noise * row.float().square().mean().sqrt()
        rows[1:] += (torch.randn(count - 1, row.shape[0], generator=generator) * scale).to(row.dtype)
    return rows


def shared_basis(projections: list[torch.Tensor], dims: int) -> torch.Tensor:
    """(d, dims) orthonormal: the `dims` leading right singular vectors of the stacked (w, d) projections."""
    stacked = torch.cat([p.double() for p in projections], dim=0)  # (w_image + w_text, d)
    _, _, right = torch.linalg.svd(stacked, full_matrices=False)  # right: (d, d), rows by singular value
    return right[:dims].T


def upcycle(model: CLIP, config: Config, class_tokens: int, embed_dim: Optional[int] = None,
            noise: float = DEFAULT_NOISE, topology: Optional[str] = None, seed: int = 0) -> tuple[CLIP, Config]:
    """(Multi(embed_dim, class_tokens) model, its Config) from a single-token `model` (see the module text)."""
    source = config.model
    if source.class_tokens != 1:
        raise ConfigError(f"upcycling starts from a single-token model; this one has {source.class_tokens} class tokens")
    embed_dim = embed_dim or source.embed_dim
    if class_tokens < 1 or embed_dim < 1:
        raise ConfigError(f"class tokens ({class_tokens}) and embedding size ({embed_dim}) must be ≥ 1")
    if embed_dim > source.embed_dim:
        raise ConfigError(f"embedding size {embed_dim} exceeds the source's {source.embed_dim}: a projection can be "
                          f"reduced (truncated SVD), not grown; pick --embed-dim ≤ {source.embed_dim}")
    if noise < 0:
        raise ConfigError(f"noise={noise} must be ≥ 0")
    hyperbolic = [name for name in (source.topology, topology) if name in TOPOLOGIES and TOPOLOGIES[name].curved]
    if hyperbolic:
        raise ConfigError(f"upcycling keeps a sphere's bounded similarity in range (t − ln m); {hyperbolic[0]}'s is "
                          f"unbounded, so it upcycles the spheres only: upcycle to ps-inner, then train lorentz-product "
                          f"from it (topoclip train --init-from NEW_FOLDER --set model.topology=lorentz-product)")
    generator = torch.Generator().manual_seed(seed)
    m = class_tokens
    state = {name: tensor.detach().clone().cpu() for name, tensor in model.state_dict().items()}

    if source.vision.pooling == "attention":  # m queries of the attention-pooling head instead of m class tokens
        state["visual.head.probe"] = _copies(state["visual.head.probe"][0], m, noise, generator)
    else:
        state["visual.class_embedding"] = _copies(state["visual.class_embedding"][0], m, noise, generator)
        positions = state["visual.positional_embedding"]  # (1 + grid², w)
        state["visual.positional_embedding"] = torch.cat([positions[:1].repeat(m, 1), positions[1:]])
    positions = state["text.positional_embedding"]  # (context, w)
    if source.text.pooling == "class_tokens":
        state["text.positional_embedding"] = torch.cat([_copies(positions[0], m, noise, generator), positions[1:]])
    else:
        state["text.positional_embedding"] = torch.cat([positions, _copies(positions[-1], m, noise, generator)[1:]])
    if embed_dim != source.embed_dim:
        basis = shared_basis([state["visual.proj"], state["text.text_projection"]], embed_dim)  # (d, n)
        for name in ("visual.proj", "text.text_projection", "text.text_projection_bias"):
            if name in state:  # (the bias: SigLIP's text head)
                state[name] = (state[name].double() @ basis).to(state[name].dtype)

    values = to_dict(config)
    model_values = values["model"]
    model_values.update(class_tokens=m, embed_dim=embed_dim, spheres=0,
                        topology=topology or implied_topology(m, single=source.topology))
    if m > 1:
        temperature = model_values["temperature"]
        temperature["max_scale"] = source.temperature.max_scale / m
        temperature["init"] = float(state["temperature.t"]) - math.log(m)
        state["temperature.t"] = torch.tensor(temperature["init"], dtype=state["temperature.t"].dtype)
    values["name"] = f"{config.name or 'model'}-multi-{embed_dim}x{m}" if m > 1 else config.name
    upcycled_config = from_dict(Config, values)
    validate(upcycled_config)
    upcycled = CLIP(upcycled_config.model)
    upcycled.load_state_dict(state, strict=True)
    return upcycled, upcycled_config
