"""The retrieval set from the generated scenes, and its relevance: which captions are true of which images.

Decisions (tests rely on them):
- The set is the first `size` images of a split, each with `captions_per_image` distinct true captions
  (the first is its clean training caption).
- A caption is relevant to every image it is true of (`Caption.describes`), not only to the image it was
  written for; `relevance_function` computes the same truth for blocks of images and captions at once.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ..types import RetrievalSet
from .captions import Caption
from .config import COLOUR_NAMES, COLOURS, SHAPES, SIZES, STYLES, SceneConfig, _check_split
from .dataset import SceneDataset
from .layout import RELATIONS, Scene

# An object code packs (colour, shape, size, grid cell) into one integer in [0, _CODES); these decode it.
_CODES = len(COLOURS) * len(SHAPES) * len(SIZES) * 9
_CODE_CELL = np.arange(_CODES) % 9
_CODE_SIZE = (np.arange(_CODES) // 9) % 2
_CODE_SHAPE = (np.arange(_CODES) // 18) % len(SHAPES)
_CODE_COLOUR = np.arange(_CODES) // (18 * len(SHAPES))


def _image_codes(scenes: Sequence[Scene], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per image: object codes (N, width) (padding = _CODES), relation table (N, width, width, 5), counts (N,).

    code = ((colour * n_shapes + shape) * 2 + size) * 9 + cell; relation column 4 = "no relation" (True).
    """
    n = len(scenes)
    codes = np.full((n, width), _CODES, dtype=np.int64)
    relations = np.zeros((n, width, width, len(RELATIONS) + 1), dtype=bool)
    relations[..., len(RELATIONS)] = True
    counts = np.zeros(n, dtype=np.int64)
    for k, scene in enumerate(scenes):
        counts[k] = len(scene.objects)
        for a, o in enumerate(scene.objects):
            codes[k, a] = ((COLOUR_NAMES.index(o.colour) * len(SHAPES) + SHAPES.index(o.shape)) * 2 + SIZES.index(o.size)) * 9 + o.row * 3 + o.column
        for a, relation, b in scene.relations:
            relations[k, a, b, RELATIONS.index(relation)] = True
    return codes, relations, counts


def _caption_tables(captions: Sequence[Caption]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per caption: allowed object codes (T, 2, _CODES + 1) bool, relation (T,) in 0..4, count (T,) (-1 any), two (T,)."""
    t = len(captions)
    allowed = np.ones((t, 2, _CODES + 1), dtype=bool)
    allowed[:, :, _CODES] = False  # padding objects match nothing
    relation = np.full(t, len(RELATIONS), dtype=np.int64)
    count = np.full(t, -1, dtype=np.int64)
    two = np.zeros(t, dtype=bool)
    for j, caption in enumerate(captions):
        for d, m in enumerate(caption.mentions):
            ok = np.ones(_CODES, dtype=bool)
            if m.colour is not None:
                ok &= _CODE_COLOUR == COLOUR_NAMES.index(m.colour)
            if m.shape is not None:
                ok &= _CODE_SHAPE == SHAPES.index(m.shape)
            if m.size is not None:
                ok &= _CODE_SIZE == SIZES.index(m.size)
            if m.row is not None:
                ok &= _CODE_CELL // 3 == m.row
            if m.column is not None:
                ok &= _CODE_CELL % 3 == m.column
            allowed[j, d, :_CODES] = ok
        two[j] = len(caption.mentions) == 2
        if caption.relation is not None:
            relation[j] = RELATIONS.index(caption.relation)
        if caption.count is not None:
            count[j] = caption.count
    return allowed, relation, count, two


def relevance_function(scenes: Sequence[Scene], captions: Sequence[Caption]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`relevance(image_index (k,), caption_index (j,)) -> (k, j) bool`: caption j is true of image k.

    Vectorised: each caption mention becomes a lookup table over the 1,152 object codes; each image a
    few object codes. About 0.1-0.3 s for 1000 x 5000 on one core.
    """
    width = max(len(s.objects) for s in scenes)
    codes, relations, counts = (torch.from_numpy(a) for a in _image_codes(scenes, width))
    allowed, relation, count, two = (torch.from_numpy(a) for a in _caption_tables(captions))

    def relevance(image_index: torch.Tensor, caption_index: torch.Tensor) -> torch.Tensor:
        image_index = torch.as_tensor(image_index, dtype=torch.int64).cpu()
        caption_index = torch.as_tensor(caption_index, dtype=torch.int64).cpu()
        image_codes = codes[image_index]  # (k, O)
        table = allowed[caption_index]  # (j, 2, C + 1)
        first = table[:, 0][:, image_codes]  # (j, k, O): mention 0 fits object o
        second = table[:, 1][:, image_codes]
        single = first.any(-1)  # (j, k)
        image_relations = relations[image_index]  # (k, O, O, 5)
        caption_relation = relation[caption_index]  # (j,)
        pair = torch.zeros_like(single)
        for a in range(width):
            for b in range(width):
                if a != b:
                    holds = image_relations[:, a, b][:, caption_relation].T  # (j, k)
                    pair |= first[:, :, a] & second[:, :, b] & holds
        caption_count = count[caption_index][:, None]  # (j, 1)
        count_ok = (caption_count < 0) | (caption_count == counts[image_index][None, :])
        return (torch.where(two[caption_index][:, None], pair, single) & count_ok).T.contiguous()

    return relevance


def retrieval_set(
    config: SceneConfig, split: str = "test", size: int = 1000, captions_per_image: int = 5, style: Optional[str] = None
) -> RetrievalSet:
    """The first `size` images of `split` with `captions_per_image` distinct true captions each.

    `relevance` marks every caption whose meaning is true of an image, not only the paired ones.
    `style` renders the same scenes in another style (name gets "-ood" when it differs from the config's).
    """
    _check_split(split)
    style = style or config.style
    if style not in STYLES:
        raise ValueError(f"style must be one of {list(STYLES)}; got {style!r}")
    styled = replace(config, style=style, held_out=list(config.held_out))
    dataset = SceneDataset(styled, split)
    if not 1 <= size <= len(dataset):
        raise ValueError(f"size must be in [1, {len(dataset)}] (the {split} split's size); got {size}")
    if captions_per_image < 1:
        raise ValueError(f"captions_per_image must be >= 1; got {captions_per_image}")
    scenes, images, captions, owners = [], [], [], []
    for i in range(size):
        scenes.append(dataset.scene(i))
        images.append(dataset.image(i))
        for caption in dataset.annotated_captions_for(i, captions_per_image):
            captions.append(caption)
            owners.append(i)
    name = f"scenes-{split}" + ("-ood" if style != config.style else "")
    return RetrievalSet(
        name, images, [c.text for c in captions], torch.tensor(owners, dtype=torch.int64),
        relevance_function(scenes, captions), "out-of-domain" if style != config.style else "in-domain",
    )
