"""A scene's structure and its random draw: which objects, in which grid cells, at which size, in which style.

A scene is `SceneConfig.min_objects`-`max_objects` coloured shapes (1-3 by default), one per cell of a
3x3 grid, plus a background. `sample_scene` draws it from a numpy Generator; `rendering` turns it into
pixels and `captions` describes it.

Decisions (tests rely on them):
- The object layout is drawn before anything style-specific, so a scene and its out-of-domain twin have
  the same objects.
- Positions are grid cells. "A to the left of B" means A's column is smaller than B's (so A's centre is
  left of B's centre in pixels: the centre jitter, <= 3 % of the image, keeps every column's centres
  strictly between its neighbours'); "above" likewise with rows.
- "Two samples are the same" means equal `Scene.key()`: a hash of every render parameter (objects,
  exact centres, diameters, rotations, colours, background).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import permutations
from typing import Optional

import numpy as np

from .config import COLOUR_NAMES, COLOURS, GENERATOR_VERSION, SHAPES, SIZES, SceneConfig

SIZE_DIAMETERS = {"small": (0.24, 0.32), "large": (0.40, 0.50)}  # fraction of image_size: 8-16 px at 32 px
POSITIONS = ("top left", "top", "top right", "left", "centre", "right", "bottom left", "bottom", "bottom right")
RELATIONS = ("to the left of", "to the right of", "above", "below")


# --------------------------------------------------------------------------------------------------
# Structured scenes
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SceneObject:
    """One drawn object. Centre (x, y) in pixels, y pointing down; row/column are its 3x3 grid cell."""

    shape: str
    colour: str
    size: str  # "small" | "large"
    row: int  # 0 top, 1 middle, 2 bottom
    column: int  # 0 left, 1 centre, 2 right
    x: float
    y: float
    diameter: float  # pixels
    rotation: float  # degrees
    rgb: tuple[int, int, int]  # the drawn colour (the named colour, slightly jittered)
    style: str = "filled"  # "filled" | "outline" | "striped"

    @property
    def position(self) -> str:
        """Grid-cell name, one of POSITIONS."""
        return POSITIONS[self.row * 3 + self.column]


def relation_holds(first: SceneObject, relation: str, second: SceneObject) -> bool:
    """True when `first <relation> second` (e.g. "above") holds for their grid cells."""
    if relation == "to the left of":
        return first.column < second.column
    if relation == "to the right of":
        return first.column > second.column
    if relation == "above":
        return first.row < second.row
    if relation == "below":
        return first.row > second.row
    raise ValueError(f"unknown relation {relation!r}; use one of {list(RELATIONS)}")


@dataclass(frozen=True)
class Scene:
    """Everything needed to render one image; `relations` lists every true (a, relation, b)."""

    objects: tuple[SceneObject, ...]
    background: str  # "noise" | "gradient" | "stripes" (in-domain), "checkerboard" | "texture" (out-of-domain)
    background_parameters: tuple[float, ...]
    style: str
    image_size: int

    @property
    def relations(self) -> list[tuple[int, str, int]]:
        """All true pairwise relations as (object index, relation, object index)."""
        return [
            (a, relation, b)
            for a, b in permutations(range(len(self.objects)), 2)
            for relation in RELATIONS
            if relation_holds(self.objects[a], relation, self.objects[b])
        ]

    def key(self) -> str:
        """Hash of every render parameter: two samples are "the same" iff their keys are equal."""
        def rounded(values):
            return tuple(round(float(v), 5) for v in values)

        parts = (
            GENERATOR_VERSION, self.style, self.image_size, self.background, rounded(self.background_parameters),
            tuple(
                (o.shape, o.colour, o.size, o.row, o.column, rounded((o.x, o.y, o.diameter, o.rotation)), o.rgb, o.style)
                for o in self.objects
            ),
        )
        return hashlib.sha1(repr(parts).encode()).hexdigest()


# --------------------------------------------------------------------------------------------------
# Sampling a scene: building blocks, then `sample_scene`
# --------------------------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _held_out_pairs(held_out: tuple[str, ...]) -> frozenset[tuple[int, int]]:
    """(colour index, shape index) of each held-out "colour shape" (cached: called once per scene)."""
    return frozenset((COLOUR_NAMES.index(c), SHAPES.index(s)) for c, s in (item.split() for item in held_out))


def _diameter(rng: np.random.Generator, size: str, image_size: int, scale: float = 1.0) -> float:
    low, high = SIZE_DIAMETERS[size]
    return (low + (high - low) * rng.random()) * image_size * scale


def _cell_centre(row: int, column: int, diameter: float, image_size: int) -> tuple[float, float]:
    """Centre of a grid cell, pulled inwards so that an object of `diameter` stays inside the image."""
    cell, radius = image_size / 3.0, diameter / 2
    return (
        min(max((column + 0.5) * cell, radius), image_size - radius),
        min(max((row + 0.5) * cell, radius), image_size - radius),
    )


def _free_cell(order, placed, diameter: float, image_size: int) -> Optional[tuple[int, int, float, float]]:
    """(row, column, x, y) of the first free cell in `order` far enough from every placed object, or None."""
    margin = 0.02 * image_size  # with the 0.92 below: bounding circles may touch; the shapes inside them do not
    for c in order:
        row, column = divmod(c, 3)
        x, y = _cell_centre(row, column, diameter, image_size)
        if all(
            (row, column) != (r, col) and math.hypot(x - px, y - py) >= 0.92 * (diameter + d) / 2 + margin
            for r, col, px, py, d in placed
        ):
            return row, column, x, y
    return None


def sample_scene(
    config: SceneConfig,
    rng: np.random.Generator,
    *,
    exclude_held_out: bool,
    style: Optional[str] = None,
    n_objects: Optional[int] = None,
    colour: Optional[str] = None,
    shape: Optional[str] = None,
) -> Scene:
    """Draw a scene. `colour`/`shape` fix the first object's attributes (for classification sets).

    Layout (objects, cells, sizes) is drawn first, style-specific choices last, so changing `style`
    changes only the rendering. Integers come from `int(rng.random() * n)`: 3x cheaper than rng.integers.
    """
    size_px = config.image_size
    style = style or config.style
    held_out = _held_out_pairs(tuple(config.held_out)) if exclude_held_out else frozenset()
    span = config.max_objects - config.min_objects + 1
    count = config.min_objects + int(rng.random() * span) if n_objects is None else n_objects

    # What: colour, shape, size of each object, resampling held-out compositions.
    kinds = []  # [colour index, shape index, size, diameter in px]
    for k in range(count):
        while True:
            c = COLOUR_NAMES.index(colour) if (k == 0 and colour is not None) else int(rng.random() * len(COLOURS))
            s = SHAPES.index(shape) if (k == 0 and shape is not None) else int(rng.random() * len(SHAPES))
            if (c, s) not in held_out:
                break
            if k == 0 and colour is not None and shape is not None:
                raise ValueError(f"{colour} {shape} is held out; it cannot be drawn with exclude_held_out=True")
        size = SIZES[int(rng.random() * 2)]
        kinds.append([c, s, size, _diameter(rng, size, size_px, config.object_scale)])

    # Where: distinct grid cells, far enough apart that objects do not overlap; shrink if needed.
    order = rng.permutation(9).tolist()
    placed: list[tuple[int, int, float, float, float]] = []  # (row, column, x, y, diameter)
    for item in kinds:
        chosen = _free_cell(order, placed, item[3], size_px)
        if chosen is None and item[2] == "large":
            item[2] = "small"
            item[3] = _diameter(rng, "small", size_px, config.object_scale)
            chosen = _free_cell(order, placed, item[3], size_px)
        if chosen is None:  # crowded: accept an overlap rather than fail
            taken = {(p[0], p[1]) for p in placed}
            row, column = next(divmod(c, 3) for c in order if divmod(c, 3) not in taken)
            chosen = (row, column, *_cell_centre(row, column, item[3], size_px))
        placed.append((*chosen, item[3]))
    # Per object: centre jitter (2), rotation, colour jitter (3). Jitter (<= 3 % of the image) keeps
    # every column's centres strictly between its neighbours', so relations read off cells hold in pixels.
    draws = rng.random((count, 6)).tolist()

    # How: background and object style (drawn last).
    if style == "in-domain":
        background = ("noise", "gradient", "stripes")[int(rng.random() * 3)]
        grey, low_tint = 95.0 + 70.0 * rng.random(), -10.0
    else:
        background = ("checkerboard", "texture")[int(rng.random() * 2)]
        grey, low_tint = 45.0 + 65.0 * rng.random(), -8.0
    tint_and_extra = rng.random(7).tolist()  # 3 channel tints, then angle, amplitude, period, phase in [0, 1)
    parameters = tuple(grey + low_tint * (1 - 2 * t) for t in tint_and_extra[:3]) + tuple(tint_and_extra[3:])
    if style == "in-domain":
        object_styles = ["filled"] * count
    else:
        object_styles = [("outline", "striped")[int(v * 2)] for v in rng.random(count).tolist()]

    objects = []
    for k, ((c, s, size, diameter), (row, column, x, y, _)) in enumerate(zip(kinds, placed)):
        jitter_x, jitter_y, turn, *rgb_draws = draws[k]
        radius = diameter / 2
        named = COLOURS[COLOUR_NAMES[c]]
        objects.append(SceneObject(
            shape=SHAPES[s], colour=COLOUR_NAMES[c], size=size, row=row, column=column,
            x=min(max(x + (jitter_x - 0.5) * 0.06 * size_px, radius), size_px - radius),
            y=min(max(y + (jitter_y - 0.5) * 0.06 * size_px, radius), size_px - radius),
            diameter=diameter, rotation=(turn - 0.5) * 20.0,  # +-10 degrees: squares never look like diamonds
            rgb=tuple(min(max(int(v + (d - 0.5) * 20.0), 0), 255) for v, d in zip(named, rgb_draws)),
            style=object_styles[k],
        ))
    return Scene(tuple(objects), background, parameters, style, size_px)
