"""Captioned scenes, rendered on the fly: the built-in image-caption data for the default run and the tests.

A scene is 1-3 coloured shapes on a low-contrast background, laid out on a 3x3 grid. Its captions
mention a random subset of what is true of it (colour, shape, size, grid position, one spatial relation,
the number of objects), so several images match a caption and several captions match an image.

Settings control the three effects the paper studies:
- correspondence noise: `noise` = fraction p of training pairs whose caption is another pair's caption;
- compositional transfer: `held_out` colour-shape pairs never occur in the train (or val) split, and do
  occur in the test split and in the "composition" classification sets;
- domain shift: `style="out-of-domain"` renders the same scenes (same objects, same captions) with other
  backgrounds (checkerboards, high-frequency texture) and outlined or striped objects.

Decisions (tests rely on them):
- Sample i of a split is a pure function of (seed, split, i): every random draw comes from a numpy
  Generator seeded with a SeedSequence of (seed, stream, split, i, purpose), so DataLoader workers and
  any access order give the same bytes. The object layout is drawn before anything style-specific, so a
  scene and its out-of-domain twin have the same objects.
- Every caption names the colour or the shape (or both) of every object it mentions.
- "Two samples are the same" means equal `Scene.key()`: a hash of every render parameter (objects,
  exact centres, diameters, rotations, colours, background). Splits use separate seed streams and the
  tests check that their keys (and image bytes) never collide.
- Positions are grid cells; "on the left" means column 0 (any row), "at the top" row 0 (any column),
  "in the top left" the cell (0, 0), "in the centre" the cell (1, 1). "A to the left of B" means A's
  column is smaller than B's (so A's centre is left of B's centre in pixels); "above" likewise with rows.
- Held-out compositions are excluded from the train and val splits (val mirrors training), and from
  the "shape" and "colour" classification sets (they measure in-distribution recognition).
- Noise: exactly round(p * train_size) train pairs (Python `round`) are noisy, chosen by a fixed
  permutation from the seed; a noisy pair's caption is the clean caption of a donor pair drawn from the
  seed whose caption is NOT true of the noisy pair's image (so it also differs from the clean caption).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import permutations
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .types import ClassificationSet, RetrievalSet

# Bump when any change alters the images or captions produced for a given config.
GENERATOR_VERSION = 1

SHAPES = ("circle", "square", "triangle", "star", "cross", "diamond", "heart", "crescent")
COLOURS = {  # name -> RGB; saturated or extreme, so they never blend into the grey-ish backgrounds
    "red": (215, 35, 35),
    "green": (35, 165, 55),
    "blue": (35, 75, 215),
    "yellow": (240, 215, 35),
    "purple": (135, 45, 175),
    "orange": (245, 135, 20),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
COLOUR_NAMES = tuple(COLOURS)
SIZES = ("small", "large")
SIZE_DIAMETERS = {"small": (0.24, 0.32), "large": (0.40, 0.50)}  # fraction of image_size: 8-16 px at 32 px
ROW_WORDS = ("top", "middle", "bottom")
COLUMN_WORDS = ("left", "centre", "right")
POSITIONS = ("top left", "top", "top right", "left", "centre", "right", "bottom left", "bottom", "bottom right")
RELATIONS = ("to the left of", "to the right of", "above", "below")
STYLES = ("in-domain", "out-of-domain")
SPLITS = ("train", "val", "test")
COUNT_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}

# Caption phrasings. {a}/{b}: a mention with its article ("a red star"); {the_a}/{the_b}: without it.
ONE_OBJECT_TEMPLATES = ("{a}.", "a photo of {a}.", "there is {a}.", "an image with {a}.", "a picture showing {a}.")
COUNT_TEMPLATE = "{count} objects, one of them {a}."
RELATION_TEMPLATES = ("{a} {relation} {b}.", "a photo of {a} {relation} {b}.", "the {the_a} is {relation} the {the_b}.")
PAIR_TEMPLATES = ("a picture of {a} and {b}.", "an image with {a} and {b}.")
PAIR_COUNT_TEMPLATES = {2: "two objects: {a} and {b}.", "more": "{count} objects, including {a} and {b}."}

# Zero-shot prompts; the class name fills "{}". "the" avoids a/an mistakes ("an orange object").
SHAPE_PROMPTS = ["a {}.", "a photo of a {}.", "there is a {}.", "an image with a {}.", "the {}."]
COLOUR_PROMPTS = ["the {} object.", "a photo of the {} object.", "the {} shape.", "an image with the {} object."]
COMPOSITION_PROMPTS = ["the {}.", "a photo of the {}.", "an image with the {}.", "the {} is in the picture."]


@dataclass
class SceneConfig:
    """Settings of the generated data; a split's sample i is a pure function of (these settings, split, i)."""

    image_size: int = 32  # pixels per side; 32-64 typical
    min_objects: int = 1
    max_objects: int = 3
    seed: int = 0
    train_size: int = 50_000
    val_size: int = 2_000
    test_size: int = 2_000
    noise: float = 0.0  # fraction of training pairs whose caption is another pair's
    held_out: list[str] = field(default_factory=lambda: ["red circle", "blue triangle", "green star", "yellow square"])
    style: str = "in-domain"  # or "out-of-domain"

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the bad field and how to fix it."""
        def need_int(name: str, low: int) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"SceneConfig.{name} must be an integer >= {low}; got {value!r}")

        need_int("image_size", 16)
        need_int("min_objects", 1)
        need_int("max_objects", 1)
        if self.max_objects > 9:
            raise ValueError(f"SceneConfig.max_objects must be <= 9 (one object per 3x3 grid cell); got {self.max_objects}")
        if self.min_objects > self.max_objects:
            raise ValueError(f"SceneConfig.min_objects ({self.min_objects}) must be <= max_objects ({self.max_objects})")
        need_int("seed", 0)
        for name in ("train_size", "val_size", "test_size"):
            need_int(name, 0)
        if isinstance(self.noise, bool) or not isinstance(self.noise, (int, float)) or not 0.0 <= self.noise <= 1.0:
            raise ValueError(f"SceneConfig.noise must be a fraction in [0, 1] (share of training pairs with a wrong caption); got {self.noise!r}")
        if self.noise > 0 and self.train_size < 2:
            raise ValueError("SceneConfig.noise > 0 needs train_size >= 2 (a noisy pair borrows another pair's caption)")
        if self.style not in STYLES:
            raise ValueError(f"SceneConfig.style must be one of {list(STYLES)}; got {self.style!r}")
        if isinstance(self.held_out, str) or not isinstance(self.held_out, (list, tuple)):
            raise ValueError(f"SceneConfig.held_out must be a list of 'colour shape' strings; got {self.held_out!r}")
        pairs = set()
        for item in self.held_out:
            words = item.split() if isinstance(item, str) else []
            if len(words) != 2 or words[0] not in COLOURS or words[1] not in SHAPES:
                raise ValueError(
                    f"SceneConfig.held_out entry {item!r} must be 'colour shape' with colour in {list(COLOUR_NAMES)} "
                    f"and shape in {list(SHAPES)}, e.g. 'red circle'"
                )
            pairs.add((COLOUR_NAMES.index(words[0]), SHAPES.index(words[1])))
        for s, shape in enumerate(SHAPES):
            if all((c, s) in pairs for c in range(len(COLOURS))):
                raise ValueError(f"SceneConfig.held_out removes every colour of {shape!r} from training; keep at least one")
        for c, colour in enumerate(COLOUR_NAMES):
            if all((c, s) in pairs for s in range(len(SHAPES))):
                raise ValueError(f"SceneConfig.held_out removes every shape of {colour!r} from training; keep at least one")

    def size_of(self, split: str) -> int:
        """Number of samples in `split`."""
        _check_split(split)
        return getattr(self, f"{split}_size")


# --------------------------------------------------------------------------------------------------
# Structured scenes and captions
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


@dataclass(frozen=True)
class Mention:
    """What a caption says about one object; None = not mentioned. row/column: grid cell constraints."""

    colour: Optional[str] = None
    shape: Optional[str] = None
    size: Optional[str] = None
    row: Optional[int] = None
    column: Optional[int] = None

    def matches(self, obj: SceneObject) -> bool:
        """True when every mentioned attribute is true of `obj`."""
        return (
            (self.colour is None or self.colour == obj.colour)
            and (self.shape is None or self.shape == obj.shape)
            and (self.size is None or self.size == obj.size)
            and (self.row is None or self.row == obj.row)
            and (self.column is None or self.column == obj.column)
        )


@dataclass(frozen=True)
class Caption:
    """A caption and its meaning: 1-2 mentions, an optional relation (mention 0 to mention 1), an optional count."""

    text: str
    mentions: tuple[Mention, ...]
    relation: Optional[str] = None
    count: Optional[int] = None  # the caption states the scene has exactly this many objects

    def describes(self, scene: Scene) -> bool:
        """True when the caption is true of the scene (distinct objects for distinct mentions)."""
        objects = scene.objects
        if self.count is not None and self.count != len(objects):
            return False
        if len(self.mentions) == 1:
            return any(self.mentions[0].matches(o) for o in objects)
        first, second = self.mentions
        return any(
            first.matches(objects[a]) and second.matches(objects[b])
            and (self.relation is None or relation_holds(objects[a], self.relation, objects[b]))
            for a, b in permutations(range(len(objects)), 2)
        )


# --------------------------------------------------------------------------------------------------
# Seeds: one stream per (purpose, split, index)
# --------------------------------------------------------------------------------------------------

_SPLIT_STREAM, _CLASSIFICATION_STREAM, _NOISE_STREAM = 0, 1, 2
_SCENE, _CAPTION, _DONOR = 0, 1, 2  # purposes within a sample


def _generator(seed: int, stream: int, group: int, index: int, purpose: int) -> np.random.Generator:
    """A Generator that depends only on its five arguments (fixed-length key, so keys never alias)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, stream, group, index, purpose])))


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}; got {split!r}")


# --------------------------------------------------------------------------------------------------
# Sampling a scene
# --------------------------------------------------------------------------------------------------


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
        kinds.append([c, s, size, _diameter(rng, size, size_px)])

    # Where: distinct grid cells, far enough apart that objects do not overlap; shrink if needed.
    order = rng.permutation(9).tolist()
    placed: list[tuple[int, int, float, float, float]] = []  # (row, column, x, y, diameter)
    for item in kinds:
        chosen = _free_cell(order, placed, item[3], size_px)
        if chosen is None and item[2] == "large":
            item[2] = "small"
            item[3] = _diameter(rng, "small", size_px)
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


@lru_cache(maxsize=64)
def _held_out_pairs(held_out: tuple[str, ...]) -> frozenset[tuple[int, int]]:
    return frozenset((COLOUR_NAMES.index(c), SHAPES.index(s)) for c, s in (item.split() for item in held_out))


def _diameter(rng: np.random.Generator, size: str, image_size: int) -> float:
    low, high = SIZE_DIAMETERS[size]
    return (low + (high - low) * rng.random()) * image_size


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


# --------------------------------------------------------------------------------------------------
# Rendering (numpy, 2x supersampled coverage inside each object's bounding box)
# --------------------------------------------------------------------------------------------------

_SUPERSAMPLE = 2
_STAR_INNER = 0.5  # inner / outer radius
_STAR_P2 = (_STAR_INNER * math.cos(math.pi / 5), _STAR_INNER * math.sin(math.pi / 5))
_OUTLINE_INNER = 0.55  # outline = shape minus the same shape scaled by this
_STRIPE_DARKEN = 0.45


def _shape_mask(shape: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Bool mask of a unit shape (fits in [-1, 1]^2) at local coordinates u (right), v (down)."""
    if shape == "circle":
        return u * u + v * v <= 0.9
    if shape == "square":
        return np.maximum(np.abs(u), np.abs(v)) <= 0.72
    if shape == "diamond":
        return np.abs(u) + np.abs(v) <= 1.0
    if shape == "triangle":  # apex up at (0, -1), base at v = 0.5
        return (v <= 0.5) & (v >= -1.0 + 1.7320508 * np.abs(u))
    if shape == "cross":
        au, av = np.abs(u), np.abs(v)
        return ((au <= 0.3) & (av <= 0.95)) | ((av <= 0.3) & (au <= 0.95))
    if shape == "star":  # 5 points, one up; fold the angle into one half-spike and test one edge
        radius = np.sqrt(u * u + v * v)
        angle = np.mod(np.arctan2(u, -v), np.float32(2 * math.pi / 5))
        folded = np.minimum(angle, np.float32(2 * math.pi / 5) - angle)
        px, py = radius * np.cos(folded), radius * np.sin(folded)
        (qx, qy) = _STAR_P2
        return (qx - 1.0) * py - qy * (px - 1.0) >= 0.0
    if shape == "heart":  # (x^2 + y^2 - 1)^3 <= x^2 y^3 with y up, scaled into the unit box
        x = u * 1.14
        y = 0.118 - v * 1.14
        t = x * x + y * y - 1.0
        return t * t * t <= x * x * y * y * y
    if shape == "crescent":  # a disc minus a disc shifted right; opens to the right
        return (u * u + v * v <= 0.9) & ((u - 0.45) ** 2 + v * v > 0.56)
    raise ValueError(f"unknown shape {shape!r}; use one of {list(SHAPES)}")


@lru_cache(maxsize=16)
def _pixel_grid(image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates x (1, S), y (S, 1), float32."""
    centres = np.arange(image_size, dtype=np.float32) + 0.5
    return centres[None, :], centres[:, None]


@lru_cache(maxsize=16)
def _upsample_matrix(image_size: int, low: int) -> np.ndarray:
    """(S, low) bilinear interpolation matrix: smooth noise = M @ coarse @ M.T."""
    positions = (np.arange(image_size) + 0.5) / image_size * (low - 1)
    left = np.clip(np.floor(positions).astype(int), 0, low - 2)
    weight = positions - left
    matrix = np.zeros((image_size, low), np.float32)
    matrix[np.arange(image_size), left] = 1 - weight
    matrix[np.arange(image_size), left + 1] = weight
    return matrix


def _background(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    """(S, S, 3) float32 background: low-contrast, desaturated (in-domain); dark, busy (out-of-domain)."""
    size = scene.image_size
    p = scene.background_parameters
    base = np.array(p[:3], np.float32)
    angle, amplitude, period, phase = p[3] * 2 * math.pi, p[4], p[5], p[6]
    x, y = _pixel_grid(size)
    if scene.background == "noise":  # smooth blobs, +-(6..12)
        low = size // 6 + 2
        coarse = rng.random((low, low), dtype=np.float32) * 2 - 1
        matrix = _upsample_matrix(size, low)
        field_ = (matrix @ coarse @ matrix.T) * (6 + 6 * amplitude)
    elif scene.background == "gradient":  # linear ramp, total swing 15..35
        ramp = (math.cos(angle) * x + math.sin(angle) * y) / size - 0.5
        field_ = ramp * (15 + 20 * amplitude)
    elif scene.background == "stripes":  # sinusoidal stripes, period 3..8 px, +-(5..10)
        wave = (math.cos(angle) * x + math.sin(angle) * y) * (2 * math.pi / (3 + 5 * period)) + phase * 2 * math.pi
        field_ = np.sin(wave) * (5 + 5 * amplitude)
    elif scene.background == "checkerboard":  # 2..4 px checks, contrast 35..60
        check = int(2 + 3 * period) if period < 1 else 4
        cells = ((np.floor(x / check) + np.floor(y / check)) % 2).astype(np.float32)
        field_ = cells * (35 + 25 * amplitude)
    elif scene.background == "texture":  # per-pixel noise, +-(25..40)
        field_ = (rng.random((size, size), dtype=np.float32) * 2 - 1) * (25 + 15 * amplitude)
    else:
        raise ValueError(f"unknown background {scene.background!r}")
    grain = rng.random((size, size), dtype=np.float32) * 8 - 4  # fine luminance grain, +-4
    return (field_ + grain)[:, :, None] + base  # broadcasts ramps and stripes to (S, S, 3)


def _coverage(mask: np.ndarray, h: int, w: int) -> np.ndarray:
    """(h*2, w*2) bool sub-pixel mask -> (h, w, 1) float32 fraction covered."""
    counts = mask.reshape(h, _SUPERSAMPLE, w, _SUPERSAMPLE).sum((1, 3), dtype=np.float32)
    return counts[:, :, None] * np.float32(1.0 / _SUPERSAMPLE**2)


def _draw(image: np.ndarray, obj: SceneObject) -> None:
    """Composite `obj` into `image` (S, S, 3) float32 in place, with 2x2 supersampled coverage."""
    size = image.shape[0]
    radius = obj.diameter / 2
    reach = radius * 1.15  # unit shapes fit in [-1, 1]^2; rotation adds a little
    x0, x1 = max(int(math.floor(obj.x - reach)), 0), min(int(math.ceil(obj.x + reach)), size)
    y0, y1 = max(int(math.floor(obj.y - reach)), 0), min(int(math.ceil(obj.y + reach)), size)
    if x1 <= x0 or y1 <= y0:
        return
    step = 1.0 / _SUPERSAMPLE
    xs = (np.arange(x0 * _SUPERSAMPLE, x1 * _SUPERSAMPLE, dtype=np.float32) + 0.5) * step - obj.x  # (w*2,)
    ys = (np.arange(y0 * _SUPERSAMPLE, y1 * _SUPERSAMPLE, dtype=np.float32) + 0.5) * step - obj.y  # (h*2,)
    cos, sin = math.cos(math.radians(obj.rotation)) / radius, math.sin(math.radians(obj.rotation)) / radius
    u = xs[None, :] * cos + ys[:, None] * sin  # (h*2, w*2) rotated, unit-scaled
    v = ys[:, None] * cos - xs[None, :] * sin
    mask = _shape_mask(obj.shape, u, v)
    if obj.style == "outline":
        mask &= ~_shape_mask(obj.shape, u / _OUTLINE_INNER, v / _OUTLINE_INNER)
    h, w = y1 - y0, x1 - x0
    rgb = np.array(obj.rgb, np.float32)
    patch = image[y0:y1, x0:x1]
    if obj.style == "striped":  # alternate the colour and a darker shade in diagonal bands
        light = mask & (np.mod(u + v, 0.6) < 0.3)
        dark = mask & ~light
        a_light, a_dark = _coverage(light, h, w), _coverage(dark, h, w)
        patch *= 1 - a_light - a_dark
        patch += a_light * rgb + a_dark * (rgb * _STRIPE_DARKEN)
        return
    alpha = _coverage(mask, h, w)  # (h, w, 1)
    patch *= 1 - alpha
    patch += alpha * rgb


def render_scene(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    """Render a scene to a uint8 image (S, S, 3); `rng` supplies the background texture only."""
    image = _background(scene, rng)  # (S, S, 3) float32, a fresh array
    for obj in scene.objects:
        _draw(image, obj)
    image += 0.5  # round, not truncate
    return np.clip(image, 0, 255, out=image).astype(np.uint8)


def object_coverage(obj: SceneObject, image_size: int) -> np.ndarray:
    """(S, S) float32 in [0, 1]: the fraction of each pixel `obj` covers (for checks and analyses)."""
    canvas = np.zeros((image_size, image_size, 3), np.float32)
    _draw(canvas, replace(obj, rgb=(255, 255, 255), style="filled"))
    return canvas[:, :, 0] / 255.0


# --------------------------------------------------------------------------------------------------
# Captions
# --------------------------------------------------------------------------------------------------


def _with_article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _sample_mention(obj: SceneObject, rng: np.random.Generator, allow_position: bool) -> tuple[Mention, str]:
    """A random true description of `obj` naming its colour or shape (or both); returns (meaning, words)."""
    draws = rng.random(7)
    say_colour, say_shape = draws[0] < 0.7, draws[1] < 0.7
    if not (say_colour or say_shape):
        say_colour = draws[2] < 0.5
        say_shape = not say_colour
    say_size = draws[3] < 0.3
    say_position = allow_position and draws[4] < 0.25
    words = []
    if say_size:
        words.append(obj.size)
    if say_colour:
        words.append(obj.colour)
    words.append(obj.shape if say_shape else ("object" if draws[5] < 0.5 else "shape"))
    row = column = None
    if say_position:
        options = []  # (row, column, phrase) that are true of the object's cell
        if (obj.row, obj.column) == (1, 1):
            options.append((1, 1, "in the centre"))
        if obj.row != 1 and obj.column != 1:
            options.append((obj.row, obj.column, f"in the {ROW_WORDS[obj.row]} {COLUMN_WORDS[obj.column]}"))
        if obj.row != 1:
            options.append((obj.row, None, f"at the {ROW_WORDS[obj.row]}"))
        if obj.column != 1:
            options.append((None, obj.column, f"on the {COLUMN_WORDS[obj.column]}"))
        row, column, phrase = options[int(draws[6] * len(options))]
        words.append(phrase)
    mention = Mention(
        colour=obj.colour if say_colour else None, shape=obj.shape if say_shape else None,
        size=obj.size if say_size else None, row=row, column=column,
    )
    return mention, " ".join(words)


def sample_caption(scene: Scene, rng: np.random.Generator) -> Caption:
    """A random true caption of `scene` (one of 13 phrasings; see the *_TEMPLATES constants)."""
    objects = scene.objects
    n = len(objects)
    kind = "one"
    if n > 1:
        draw = rng.random()
        kind = "one" if draw < 0.4 else "count" if draw < 0.5 else "relation" if draw < 0.8 else "pair"
    if kind in ("one", "count"):
        mention, words = _sample_mention(objects[int(rng.random() * n)], rng, allow_position=True)
        if kind == "one":
            text = ONE_OBJECT_TEMPLATES[int(rng.random() * len(ONE_OBJECT_TEMPLATES))].format(a=_with_article(words))
            return Caption(text, (mention,))
        return Caption(COUNT_TEMPLATE.format(count=COUNT_WORDS[n], a=_with_article(words)), (mention,), count=n)
    a, b = (int(v) for v in rng.choice(n, 2, replace=False))
    if kind == "relation":
        true = [r for r in RELATIONS if relation_holds(objects[a], r, objects[b])]
        relation = true[int(rng.random() * len(true))]
        first, words_a = _sample_mention(objects[a], rng, allow_position=False)
        second, words_b = _sample_mention(objects[b], rng, allow_position=False)
        template = RELATION_TEMPLATES[int(rng.random() * len(RELATION_TEMPLATES))]
        text = template.format(a=_with_article(words_a), b=_with_article(words_b), the_a=words_a, the_b=words_b, relation=relation)
        return Caption(text, (first, second), relation=relation)
    first, words_a = _sample_mention(objects[a], rng, allow_position=True)
    second, words_b = _sample_mention(objects[b], rng, allow_position=True)
    pick = int(rng.random() * (len(PAIR_TEMPLATES) + 1))
    if pick < len(PAIR_TEMPLATES):
        return Caption(PAIR_TEMPLATES[pick].format(a=_with_article(words_a), b=_with_article(words_b)), (first, second))
    template = PAIR_COUNT_TEMPLATES[2 if n == 2 else "more"]
    text = template.format(count=COUNT_WORDS[n], a=_with_article(words_a), b=_with_article(words_b))
    return Caption(text, (first, second), count=n)


# --------------------------------------------------------------------------------------------------
# The dataset
# --------------------------------------------------------------------------------------------------


class SceneDataset(Dataset):
    """Split `split` of the generated scenes: item i -> (image uint8 (S, S, 3) or transform(image), caption str)."""

    def __init__(self, config: SceneConfig, split: str = "train", transform: Optional[Callable] = None):
        config.validate()
        _check_split(split)
        self.config = config
        self.split = split
        self.transform = transform
        self._split_id = SPLITS.index(split)
        self._size = config.size_of(split)
        self._exclude_held_out = split in ("train", "val")
        self._noisy = np.zeros(self._size, dtype=bool)
        if split == "train" and config.noise > 0:
            chosen = _generator(config.seed, _NOISE_STREAM, 0, 0, 0).permutation(self._size)[: round(config.noise * self._size)]
            self._noisy[chosen] = True

    def __len__(self) -> int:
        return self._size

    def _index(self, i: int) -> int:
        i = int(i)
        if i < 0:
            i += self._size
        if not 0 <= i < self._size:
            raise IndexError(f"index {i} out of range for the {self.split} split of {self._size} samples")
        return i

    def _scene_and_rng(self, i: int) -> tuple[Scene, np.random.Generator]:
        rng = _generator(self.config.seed, _SPLIT_STREAM, self._split_id, i, _SCENE)
        return sample_scene(self.config, rng, exclude_held_out=self._exclude_held_out), rng

    def scene(self, i: int) -> Scene:
        """The structured scene of sample i (objects, their attributes and cells; `.relations`)."""
        return self._scene_and_rng(self._index(i))[0]

    def image(self, i: int) -> np.ndarray:
        """uint8 (S, S, 3) image of sample i (no transform)."""
        scene, rng = self._scene_and_rng(self._index(i))
        return render_scene(scene, rng)

    def annotated_captions_for(self, i: int, k: int = 5) -> list[Caption]:
        """k distinct true captions of sample i with their meaning; the first is its clean training caption."""
        i = self._index(i)
        scene = self.scene(i)
        rng = _generator(self.config.seed, _SPLIT_STREAM, self._split_id, i, _CAPTION)
        found: dict[str, Caption] = {}
        for _ in range(20 * k + 20):
            caption = sample_caption(scene, rng)
            found.setdefault(caption.text, caption)
            if len(found) == k:
                return list(found.values())
        raise ValueError(f"sample {i} of {self.split} yielded only {len(found)} distinct captions; ask for fewer than {k}")

    def captions_for(self, i: int, k: int = 5) -> list[str]:
        """k distinct true captions of sample i (for retrieval); the first is its clean training caption."""
        return [c.text for c in self.annotated_captions_for(i, k)]

    def clean_caption(self, i: int) -> Caption:
        """The caption written for sample i, before any noise."""
        i = self._index(i)
        return self._clean_caption(i, self.scene(i))

    def _clean_caption(self, i: int, scene: Scene) -> Caption:
        return sample_caption(scene, _generator(self.config.seed, _SPLIT_STREAM, self._split_id, i, _CAPTION))

    def paired_caption(self, i: int) -> Caption:
        """The caption sample i is trained with: the clean one, or for a noisy pair a donor's clean caption."""
        i = self._index(i)
        return self._paired_caption(i, self.scene(i))

    def _paired_caption(self, i: int, scene: Scene) -> Caption:
        if not self._noisy[i]:
            return self._clean_caption(i, scene)
        rng = _generator(self.config.seed, _SPLIT_STREAM, self._split_id, i, _DONOR)
        for _ in range(1000):
            donor = int(rng.integers(self._size - 1))
            donor += donor >= i  # never the pair itself
            caption = self.clean_caption(donor)
            if not caption.describes(scene):
                return caption
        raise RuntimeError(f"no donor caption found for noisy sample {i}; the scenes are too uniform for noise")

    @property
    def noisy_indices(self) -> np.ndarray:
        """(round(noise * train_size),) int64, sorted: the pairs whose caption was replaced (train only)."""
        return np.flatnonzero(self._noisy)

    def is_noisy(self, i: int) -> bool:
        """True when sample i is trained with another pair's caption."""
        return bool(self._noisy[self._index(i)])

    def __getitem__(self, i: int):
        i = self._index(i)
        scene, rng = self._scene_and_rng(i)
        image = render_scene(scene, rng)
        caption = self._paired_caption(i, scene).text
        return (self.transform(image) if self.transform is not None else image), caption

    def batch(self, indices: Sequence[int]) -> tuple[np.ndarray, list[str]]:
        """Untransformed images (B, S, S, 3) uint8 and their paired captions."""
        images = np.empty((len(indices), self.config.image_size, self.config.image_size, 3), np.uint8)
        captions = []
        for row, i in enumerate(indices):
            i = self._index(i)
            scene, rng = self._scene_and_rng(i)
            images[row] = render_scene(scene, rng)
            captions.append(self._paired_caption(i, scene).text)
        return images, captions


# --------------------------------------------------------------------------------------------------
# Evaluation sets
# --------------------------------------------------------------------------------------------------

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
    return ClassificationSet(name + suffix, images, torch.tensor(labels, dtype=torch.int64), classnames, list(templates))


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
        relevance_function(scenes, captions),
    )
