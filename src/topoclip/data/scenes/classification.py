"""Zero-shot classification sets from the generated scenes: "shape", "colour", "composition", "composition-held-out".

Every image holds one object, labels are balanced over the classes, and each (split, set, style) draws
from its own seed group, so the sets are fixed by the config.

Decisions (tests rely on them):
- Held-out compositions are excluded from the "shape" and "colour" sets (they measure in-distribution
  recognition); "composition" has every colour-shape class, and "composition-held-out" only images of
  held-out compositions, scored against all composition classes.
"""
from __future__ import annotations

import torch

from ..types import ClassificationSet
from .config import COLOUR_NAMES, SHAPES, SPLITS, SceneConfig, _CLASSIFICATION_STREAM, _SCENE, _check_split, _generator
from .layout import sample_scene
from .rendering import render_scene

# Zero-shot prompts; the class name fills "{}". "the" avoids a/an mistakes ("an orange object").
SHAPE_PROMPTS = ["a {}.", "a photo of a {}.", "there is a {}.", "an image with a {}.", "the {}."]
COLOUR_PROMPTS = ["the {} object.", "a photo of the {} object.", "the {} shape.", "an image with the {} object."]
COMPOSITION_PROMPTS = ["the {}.", "a photo of the {}.", "an image with the {}.", "the {} is in the picture."]

_CLASSIFICATION_SETS = ("shape", "colour", "composition", "composition-held-out")


def _classification_set(config: SceneConfig, split: str, name: str, style: str, size: int) -> ClassificationSet:
    """Single-object images with balanced labels; see `classification_sets`."""
    compositions = [f"{c} {s}" for c in COLOUR_NAMES for s in SHAPES]
    held_out = sorted(compositions.index(item) for item in set(config.held_out))
    if name == "shape":
        classnames, templates = list(SHAPES), SHAPE_PROMPTS
    elif name == "colour":
        classnames, templates = list(COLOUR_NAMES), COLOUR_PROMPTS
    else:
        classnames, templates = compositions, COMPOSITION_PROMPTS
    group = SPLITS.index(split) * 16 + _CLASSIFICATION_SETS.index(name) + (8 if style == "out-of-domain" else 0)
    images, labels = [], []
    for i in range(size):
        if name == "composition-held-out":
            label = held_out[i % len(held_out)]
        else:
            label = i % len(classnames)
        rng = _generator(config.seed, _CLASSIFICATION_STREAM, group, i, _SCENE)
        if name == "shape":
            scene = sample_scene(config, rng, exclude_held_out=True, style=style, n_objects=1, shape=SHAPES[label])
        elif name == "colour":
            scene = sample_scene(config, rng, exclude_held_out=True, style=style, n_objects=1, colour=COLOUR_NAMES[label])
        else:
            colour, shape = compositions[label].split()
            scene = sample_scene(config, rng, exclude_held_out=False, style=style, n_objects=1, colour=colour, shape=shape)
        images.append(render_scene(scene, rng))
        labels.append(label)
    suffix = "-ood" if style != config.style else ""
    domain = ", ".join(["held-out"] * (name == "composition-held-out") + ["out-of-domain"] * bool(suffix)) or "in-domain"
    return ClassificationSet(name + suffix, images, torch.tensor(labels, dtype=torch.int64), classnames, list(templates),
                             domain)


def classification_sets(
    config: SceneConfig, split: str = "test", size: int = 1000, include_out_of_domain: bool = True
) -> list[ClassificationSet]:
    """Zero-shot sets of `size` single-object images each (uint8 (S, S, 3)), labels balanced over classes.

    "shape" (8 classes) and "colour" (8 classes) avoid held-out compositions; "composition" has all
    colour-shape classes; "composition-held-out" has only images of held-out compositions, scored against
    all composition classes (omitted when `held_out` is empty). With `include_out_of_domain` and an
    in-domain config, "-ood" copies rendered in the out-of-domain style are added.
    """
    config.validate()
    _check_split(split)
    if size < 1:
        raise ValueError(f"size must be >= 1 images per set; got {size}")
    names = [n for n in _CLASSIFICATION_SETS if n != "composition-held-out" or config.held_out]
    styles = [config.style] + (["out-of-domain"] if include_out_of_domain and config.style == "in-domain" else [])
    return [_classification_set(config, split, name, style, size) for style in styles for name in names]
