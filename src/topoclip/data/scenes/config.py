"""Settings of the generated scenes: the vocabulary, `SceneConfig`, and the seed of every random draw.

Decisions (tests rely on them):
- Sample i of a split is a pure function of (seed, split, i): every random draw comes from a numpy
  Generator seeded with a SeedSequence of (seed, stream, split, i, purpose) (`_generator`), so DataLoader
  workers and any access order give the same bytes.
- Each split, each classification set and the noise permutation draw from their own keys: split samples
  (seed, 0, split, i, purpose), classification images (seed, 1, set, i, purpose), the noise permutation
  (seed, 2, 0, 0, 0). The tests check that the splits' scene keys (and image bytes) never collide.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

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
STYLES = ("in-domain", "out-of-domain")
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
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
    # Multiplies every object's diameter (small 24-32 %, large 40-50 % of the image at 1.0). Larger
    # objects make shape easier to see at 32 px; crowded scenes shrink objects that do not fit.
    object_scale: float = 1.0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the bad field and how to fix it."""
        def need_int(name: str, low: int) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"SceneConfig.{name} must be an integer >= {low}; got {value!r}")

        need_int("image_size", 16)
        if isinstance(self.object_scale, bool) or not isinstance(self.object_scale, (int, float)) or not 0.5 <= self.object_scale <= 1.8:
            raise ValueError(f"SceneConfig.object_scale must be a number in [0.5, 1.8] (1.8 makes a large object 90 % of "
                             f"the image); got {self.object_scale!r}")
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
