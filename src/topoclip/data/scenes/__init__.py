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

The modules, in reading order; each states the decisions it implements (tests rely on them):
- config: the vocabulary (shapes, colours, sizes, styles, splits), `SceneConfig`, `GENERATOR_VERSION`,
  and the seed of every random draw;
- layout: `SceneObject`, `Scene` (and its identity, `Scene.key()`), `relation_holds`, `sample_scene`;
- rendering: `render_scene` (a scene to uint8 pixels), `object_coverage`;
- captions: `Mention` and `Caption` (what a caption means), `sample_caption`;
- dataset: `SceneDataset`, one split of (image, caption) pairs with held-out compositions and noise;
- classification: `classification_sets`, the zero-shot shape / colour / composition sets;
- retrieval: `retrieval_set` and `relevance_function` (which captions are true of which images).
"""
import importlib

# Each name's module: loaded on first use (PEP 562), so that reading the settings (`SceneConfig`, which the config
# schema holds) does not load the renderer, the captioner and the evaluation sets.
_MODULES = {
    "config": ("COLOUR_NAMES", "COLOURS", "GENERATOR_VERSION", "SHAPES", "SIZES", "SPLITS", "STYLES", "SceneConfig"),
    "layout": ("POSITIONS", "RELATIONS", "SIZE_DIAMETERS", "Scene", "SceneObject", "relation_holds", "sample_scene"),
    "rendering": ("object_coverage", "render_scene"),
    "captions": ("COLUMN_WORDS", "COUNT_TEMPLATE", "COUNT_WORDS", "ONE_OBJECT_TEMPLATES", "PAIR_COUNT_TEMPLATES",
                 "PAIR_TEMPLATES", "RELATION_TEMPLATES", "ROW_WORDS", "Caption", "Mention", "sample_caption"),
    "dataset": ("SceneDataset",),
    "classification": ("COLOUR_PROMPTS", "COMPOSITION_PROMPTS", "SHAPE_PROMPTS", "classification_sets"),
    "retrieval": ("relevance_function", "retrieval_set"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})


__all__ = [
    # settings and vocabulary
    "GENERATOR_VERSION", "SceneConfig", "SHAPES", "COLOURS", "COLOUR_NAMES", "SIZES", "STYLES", "SPLITS",
    # scenes
    "SceneObject", "Scene", "relation_holds", "sample_scene", "SIZE_DIAMETERS", "POSITIONS", "RELATIONS",
    # rendering
    "render_scene", "object_coverage",
    # captions
    "Mention", "Caption", "sample_caption", "ROW_WORDS", "COLUMN_WORDS", "COUNT_WORDS",
    "ONE_OBJECT_TEMPLATES", "COUNT_TEMPLATE", "RELATION_TEMPLATES", "PAIR_TEMPLATES", "PAIR_COUNT_TEMPLATES",
    # the dataset and the evaluation sets
    "SceneDataset", "classification_sets", "SHAPE_PROMPTS", "COLOUR_PROMPTS", "COMPOSITION_PROMPTS",
    "retrieval_set", "relevance_function",
]
