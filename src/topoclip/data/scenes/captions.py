"""Captions: what a caption means (`Mention`, `Caption`) and how a random true caption of a scene is written.

A caption mentions a random subset of what is true of a scene (colour, shape, size, grid position, one
spatial relation, the number of objects), so several images match a caption and several captions match
an image.

Decisions (tests rely on them):
- Every caption names the colour or the shape (or both) of every object it mentions.
- Positions are grid cells: "on the left" means column 0 (any row), "at the top" row 0 (any column),
  "in the top left" the cell (0, 0), "in the centre" the cell (1, 1). A relation ("A to the left of B",
  "above") means what `relation_holds` says: column (row) order of the grid cells.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations
from typing import Optional

import numpy as np

from .layout import RELATIONS, Scene, SceneObject, relation_holds

ROW_WORDS = ("top", "middle", "bottom")
COLUMN_WORDS = ("left", "centre", "right")
COUNT_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}

# Caption phrasings. {a}/{b}: a mention with its article ("a red star"); {the_a}/{the_b}: without it.
ONE_OBJECT_TEMPLATES = ("{a}.", "a photo of {a}.", "there is {a}.", "an image with {a}.", "a picture showing {a}.")
COUNT_TEMPLATE = "{count} objects, one of them {a}."
RELATION_TEMPLATES = ("{a} {relation} {b}.", "a photo of {a} {relation} {b}.", "the {the_a} is {relation} the {the_b}.")
PAIR_TEMPLATES = ("a picture of {a} and {b}.", "an image with {a} and {b}.")
PAIR_COUNT_TEMPLATES = {2: "two objects: {a} and {b}.", "more": "{count} objects, including {a} and {b}."}


# --------------------------------------------------------------------------------------------------
# A caption's meaning
# --------------------------------------------------------------------------------------------------


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
# Writing a random true caption
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
