"""Contrastive losses as pure functions of similarity tensors.

Every loss takes the similarities of the *local* rows (this process's b samples) against *all*
columns (the batch, possibly gathered across ranks: B = world · b), and the index of the local
block, so the same functions serve a single process (local_index 0, B = b) and a distributed
trainer (each rank scores its rows against the gathered batch): each is a mean over the local
rows, so the mean over ranks is the loss of the global batch. Everything is computed in fp32
(float64 stays float64: the tests' exact reference).

The similarity s = −d is the topology's (topoclip.core.geometry), so the geometry stays one module:

| loss         | per query i (s⁺ = s_ii its positive, s_ij its negatives j ≠ i)       | τ   | both directions |
|--------------|-----------------------------------------------------------------------|-----|-----------------|
| infonce      | −log softmax(τ·s_i)_i                                                 | yes | yes             |
| sigmoid      | −Σ_j log σ(z_ij (τ s_ij + β))                                         | yes | one (all pairs) |
| contrastive  | δ_ii² + mean_j [ε − δ_ij]₊², δ = s_max − s                           | no  | one (all pairs) |
| triplet      | Σ_j [ε − s⁺ + s_ij]₊                                                  | no  | yes             |
| max-hinge    | max_j [ε − s⁺ + s_ij]₊  (VSE++: the hardest negative)                 | no  | yes             |
| n-pair       | log(1 + Σ_j exp(s_ij − s⁺)) = −log softmax(s_i)_i                     | no  | yes             |

The margin ε is train.margin (in similarity units; see `loss_keywords` for train.margin_relative).
train.max_hinge_warmup_steps trains max-hinge's first steps with triplet (step.loss_at).
A loss without τ leaves the model's τ unused: it keeps its initial value and gets no gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from topoclip.core.geometry import fp32_or_wider, get_topology


def _targets(rows: int, local_index: int, device) -> torch.Tensor:
    # The positive of local row i is global column local_index·b + i.
    return torch.arange(rows, device=device) + local_index * rows


def infonce_loss(similarity_image_text: torch.Tensor, similarity_text_image: torch.Tensor,
                 scale: torch.Tensor, bias: Optional[torch.Tensor] = None, local_index: int = 0, *,
                 margin: float = 0.0, best: float = 1.0) -> torch.Tensor:
    """Symmetric InfoNCE (paper Eq. 2):  ( CE(τ·S, y) + CE(τ·Sᵀ, y) ) / 2.

    Args:
        similarity_image_text: (b, B) s(u_i, v_j) of local images against all texts.
        similarity_text_image: (b, B) s(v_i, u_j) of local texts against all images
            (in one process, simply the transpose of the former).
        scale: τ, 0-d. bias, margin, best: ignored (kept so every loss has one signature).
        local_index: which block of B the local rows are (the rank).
    Returns: 0-d mean over the local rows of the two cross-entropies, halved.
    """
    rows = similarity_image_text.shape[0]
    targets = _targets(rows, local_index, similarity_image_text.device)
    scale = fp32_or_wider(scale)
    logits_image = scale * fp32_or_wider(similarity_image_text)
    logits_text = scale * fp32_or_wider(similarity_text_image)
    return (F.cross_entropy(logits_image, targets) + F.cross_entropy(logits_text, targets)) / 2


def sigmoid_loss(similarity_image_text: torch.Tensor, similarity_text_image: torch.Tensor,
                 scale: torch.Tensor, bias: Optional[torch.Tensor] = None, local_index: int = 0, *,
                 margin: float = 0.0, best: float = 1.0) -> torch.Tensor:
    """SigLIP: −(1/b) Σ_i Σ_j log σ(z_ij · (τ·s_ij + β)), z = +1 for the positive pair, −1 else.

    Only the image rows are used (every pair (i, j) is counted once across ranks);
    `similarity_text_image`, margin and best are accepted for a common signature. β = 0 when bias is None.
    """
    rows, columns = similarity_image_text.shape
    logits = fp32_or_wider(scale) * fp32_or_wider(similarity_image_text)
    if bias is not None:
        logits = logits + fp32_or_wider(bias)
    signs = -torch.ones(rows, columns, device=logits.device, dtype=logits.dtype)
    signs[torch.arange(rows, device=logits.device), _targets(rows, local_index, logits.device)] = 1.0
    # log σ(x) via logsigmoid: exact and stable for |x| large (τ·s reaches ±100·m).
    return -F.logsigmoid(signs * logits).sum() / rows


def _positive_mask(rows: int, columns: int, local_index: int, device) -> torch.Tensor:
    """(b, B) bool, True at each local row's positive column."""
    mask = torch.zeros(rows, columns, dtype=torch.bool, device=device)
    mask[torch.arange(rows, device=device), _targets(rows, local_index, device)] = True
    return mask


def _violations(similarity: torch.Tensor, margin: float, local_index: int) -> torch.Tensor:
    """(b, B) hinge terms [ε − s⁺ + s_ij]₊ of each local row against every column, 0 at the positive."""
    similarity = fp32_or_wider(similarity)
    rows, columns = similarity.shape
    positive = _positive_mask(rows, columns, local_index, similarity.device)
    anchor = similarity[positive].unsqueeze(1)  # (b, 1) s⁺ of each row
    return (margin - anchor + similarity).clamp(min=0).masked_fill(positive, 0.0)


def triplet_loss(similarity_image_text: torch.Tensor, similarity_text_image: torch.Tensor,
                 scale: torch.Tensor = None, bias: Optional[torch.Tensor] = None, local_index: int = 0, *,
                 margin: float = 0.2, best: float = 1.0) -> torch.Tensor:
    """Hinge rank loss over all in-batch negatives (Frome et al.; VSE's sum of violations), both directions:

        (1/b) Σ_i ( Σ_{j≠i} [ε − s_ii + s_ij]₊  +  Σ_{j≠i} [ε − s'_ii + s'_ij]₊ ),   s' = text→image rows.

    No τ (scale and bias are ignored); `best` is unused (one signature for every loss).
    """
    return (_violations(similarity_image_text, margin, local_index).sum(dim=1).mean()
            + _violations(similarity_text_image, margin, local_index).sum(dim=1).mean())


def max_hinge_loss(similarity_image_text: torch.Tensor, similarity_text_image: torch.Tensor,
                   scale: torch.Tensor = None, bias: Optional[torch.Tensor] = None, local_index: int = 0, *,
                   margin: float = 0.2, best: float = 1.0) -> torch.Tensor:
    """VSE++'s max of hinges (Faghri et al.): the hardest negative of each query, over the global batch, both ways:

        (1/b) Σ_i ( max_{j≠i} [ε − s_ii + s_ij]₊  +  max_{j≠i} [ε − s'_ii + s'_ij]₊ ).

    VSE++'s ContrastiveLoss(max_violation=True) sums over the batch instead of averaging; this is that sum
    divided by B, so it does not grow with the batch and averages exactly over ranks. No τ.
    """
    return (_violations(similarity_image_text, margin, local_index).max(dim=1).values.mean()
            + _violations(similarity_text_image, margin, local_index).max(dim=1).values.mean())


def n_pair_loss(similarity_image_text: torch.Tensor, similarity_text_image: torch.Tensor,
                scale: torch.Tensor = None, bias: Optional[torch.Tensor] = None, local_index: int = 0, *,
                margin: float = 0.2, best: float = 1.0) -> torch.Tensor:
    """Multi-class N-pair loss (Sohn), both directions: (1/b) Σ_i log(1 + Σ_{j≠i} exp(s_ij − s_ii)), halved sum of
    the two — InfoNCE with τ fixed at 1. No margin, no τ."""
    rows = similarity_image_text.shape[0]
    targets = _targets(rows, local_index, similarity_image_text.device)
    return (F.cross_entropy(fp32_or_wider(similarity_image_text), targets)
            + F.cross_entropy(fp32_or_wider(similarity_text_image), targets)) / 2


def pairwise_contrastive_loss(similarity_image_text: torch.Tensor, similarity_text_image: torch.Tensor,
                              scale: torch.Tensor = None, bias: Optional[torch.Tensor] = None, local_index: int = 0, *,
                              margin: float = 0.2, best: float = 1.0) -> torch.Tensor:
    """The pairwise contrastive loss (Chopra, Hadsell & LeCun) on δ = best − s ≥ 0, the distance from a perfect match
    (best: the topology's highest similarity: 1 on the sphere, m for ps-inner, 0 for the distances):

        (1/b) Σ_i ( δ_ii²  +  (1/(B−1)) Σ_{j≠i} [ε − δ_ij]₊² )

    a positive pulled to δ = 0, a negative pushed out to δ ≥ ε; positives and negatives weigh the same per
    anchor, as Hadsell et al. sample pairs. Every (image, text) pair is one pair, so only the image rows are
    used (as SigLIP's). No τ.
    """
    distance = best - fp32_or_wider(similarity_image_text)  # (b, B)
    rows, columns = distance.shape
    positive = _positive_mask(rows, columns, local_index, distance.device)
    pull = distance[positive].square()  # (b,)
    push = (margin - distance).clamp(min=0).square().masked_fill(positive, 0.0).sum(dim=1) / max(columns - 1, 1)
    return (pull + push).mean()


LossFunction = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Loss:
    """A loss of the registry: its function (the entry is called as the function is) and the facts about it that the
    trainer and the config checks read.

    temperature: it scales similarities by τ (the model's temperature is frozen for the others); bias: it adds a
    learned β (SigLIP's); image_rows_only: it reads only the image→text rows, every pair once, so the text→image
    block is not computed. Which losses take a margin ε is the table above.
    """

    function: LossFunction
    temperature: bool = False
    bias: bool = False
    image_rows_only: bool = False

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.function(*args, **kwargs)


LOSSES: dict[str, Loss] = {
    "infonce": Loss(infonce_loss, temperature=True),
    "sigmoid": Loss(sigmoid_loss, temperature=True, bias=True, image_rows_only=True),
    "contrastive": Loss(pairwise_contrastive_loss, image_rows_only=True),
    "triplet": Loss(triplet_loss),
    "max-hinge": Loss(max_hinge_loss),
    "n-pair": Loss(n_pair_loss),
}
TEMPERATURE_LOSSES = frozenset(name for name, loss in LOSSES.items() if loss.temperature)


def get_loss(name: str) -> Loss:
    """The registry entry for `name`, or a ValueError listing the known losses."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(LOSSES)}") from None


def loss_keywords(config) -> dict:
    """The keywords every loss takes, from a Config: margin (train.margin; with train.margin_relative, in units of
    the half-width of the topology's similarity range: ×m for ps-inner's [−m, m]) and best (the highest similarity)."""
    topology, m = get_topology(config.model.topology), config.model.sphere_count
    margin = config.train.margin * (topology.half_range(m) if config.train.margin_relative else 1.0)
    return {"margin": margin, "best": topology.similarity_range(m)[1]}
