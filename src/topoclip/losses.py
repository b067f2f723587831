"""Contrastive losses as pure functions of similarity tensors.

Both take the similarities of the *local* rows (this process's b samples) against *all* columns
(the batch, possibly gathered across ranks: B = world · b), and the index of the local block, so
the same functions serve a single process (local_index 0, B = b) and a distributed trainer
(each rank scores its rows against the gathered batch). Everything is computed in fp32 (float64 stays float64: the tests' exact reference).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from topoclip.geometry import fp32_or_wider


def _targets(rows: int, local_index: int, device) -> torch.Tensor:
    # The positive of local row i is global column local_index·b + i.
    return torch.arange(rows, device=device) + local_index * rows


def infonce_loss(similarity_image_text: torch.Tensor, similarity_text_image: torch.Tensor,
                 scale: torch.Tensor, bias: Optional[torch.Tensor] = None, local_index: int = 0) -> torch.Tensor:
    """Symmetric InfoNCE (paper Eq. 2):  ( CE(τ·S, y) + CE(τ·Sᵀ, y) ) / 2.

    Args:
        similarity_image_text: (b, B) s(u_i, v_j) of local images against all texts.
        similarity_text_image: (b, B) s(v_i, u_j) of local texts against all images
            (in one process, simply the transpose of the former).
        scale: τ, 0-d. bias: ignored (kept so every loss has one signature).
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
                 scale: torch.Tensor, bias: Optional[torch.Tensor] = None, local_index: int = 0) -> torch.Tensor:
    """SigLIP: −(1/b) Σ_i Σ_j log σ(z_ij · (τ·s_ij + β)), z = +1 for the positive pair, −1 else.

    Only the image rows are used (every pair (i, j) is counted once across ranks);
    `similarity_text_image` is accepted for a common signature. β = 0 when bias is None.
    """
    rows, columns = similarity_image_text.shape
    logits = fp32_or_wider(scale) * fp32_or_wider(similarity_image_text)
    if bias is not None:
        logits = logits + fp32_or_wider(bias)
    signs = -torch.ones(rows, columns, device=logits.device, dtype=logits.dtype)
    signs[torch.arange(rows, device=logits.device), _targets(rows, local_index, logits.device)] = 1.0
    # log σ(x) via logsigmoid: exact and stable for |x| large (τ·s reaches ±100·m).
    return -F.logsigmoid(signs * logits).sum() / rows


LossFunction = Callable[..., torch.Tensor]

LOSSES: dict[str, LossFunction] = {"infonce": infonce_loss, "sigmoid": sigmoid_loss}


def get_loss(name: str) -> LossFunction:
    """The registry entry for `name`, or a ValueError listing the known losses."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(LOSSES)}") from None
