"""What a run does not train: locked towers (LiT) and partial unlocking, as OpenCLIP's --lock-image, --lock-image-unlocked-groups,
--lock-text and --lock-text-unlocked-layers.

A tower is cut into groups, first to last, as OpenCLIP cuts its own (open_clip.transformer:
VisionTransformer.lock, lock_text_tower):

- image: [patch embedding, class tokens, positions, ln_pre], each block but the last, [the last block,
  ln_post (and SigLIP's attention-pooling head)], the projection;
- text: [token embedding, positions (and the embedding LayerNorm of a BERT-style tower)], each block but
  the last, [the last block, ln_final], the projection (and SigLIP's bias of it).

Locking sets requires_grad=False on every parameter of the tower, then unlocks the last N groups.
Locked parameters are left out of the optimiser (so of its weight decay: AdamW's decay is part of its
step) and of gradient clipping, and never change. Our towers have no BatchNorm and no dropout, so
OpenCLIP's freeze_bn_stats has nothing to freeze here and locked towers behave the same in train and eval
mode; LayerNorm gains and biases are locked like any weight (OpenCLIP: "LayerNorm treated like other
weights").
"""
from __future__ import annotations

from torch import nn

from topoclip.config import TrainConfig


def tower_groups(tower: nn.Module, kind: str) -> list[list]:
    """OpenCLIP's groups of a topoclip tower ("image" or "text"), first to last; each a list of modules/parameters."""
    blocks = list(tower.transformer.resblocks)
    if kind == "image":
        head = tower.attention_pooling
        first = [tower.conv1, *([] if head else [tower.class_embedding]), tower.positional_embedding, tower.ln_pre]
        last = [blocks[-1], tower.ln_post, *([tower.head] if head else [])]
        projection = [tower.proj]
    else:
        first = [tower.token_embedding, tower.positional_embedding, tower.ln_embedding]
        last = [blocks[-1], tower.ln_final]
        projection = [tower.text_projection, *([tower.text_projection_bias] if tower.text_projection_bias is not None
                                               else [])]
    return [first, *([block] for block in blocks[:-1]), last, projection]


def _parameters(items) -> list[nn.Parameter]:
    found = []
    for item in items:
        found += [item] if isinstance(item, nn.Parameter) else list(item.parameters())
    return found


def lock_tower(tower: nn.Module, kind: str, unlocked_groups: int = 0) -> None:
    """requires_grad=False on all of `tower` but its last `unlocked_groups` groups (see the module docstring)."""
    groups = tower_groups(tower, kind)
    if not 0 <= unlocked_groups <= len(groups):
        raise ValueError(f"{unlocked_groups} unlocked groups: the {kind} tower has {len(groups)}")
    for parameter in tower.parameters():
        parameter.requires_grad = False
    for group in groups[len(groups) - unlocked_groups:]:
        for parameter in _parameters(group):
            parameter.requires_grad = True


def apply_locks(model: nn.Module, settings: TrainConfig) -> None:
    """Lock the towers train.lock_image / train.lock_text name, and τ (and β) when the loss has no temperature
    (its registry entry, topoclip.core.losses.LOSSES): call before the optimiser and DDP are built, so that neither waits
    for a gradient that never comes."""
    from topoclip.core.losses import get_loss

    if not get_loss(settings.loss).temperature:
        model.temperature.requires_grad_(False)
    if settings.lock_image:
        lock_tower(model.visual, "image", settings.lock_image_unlocked_groups)
    if settings.lock_text:
        lock_tower(model.text, "text", settings.lock_text_unlocked_layers)
