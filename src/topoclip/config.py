"""Typed configuration: dataclasses, named presets stored as JSON data, type-checked overrides.

A run is described by :class:`Config` (model, train, data, evaluate sections). Presets live in
``topoclip/preset_data/*.json``; a preset may name a ``"base"`` preset whose values it overrides.
``--set section.field=value`` overrides are parsed and type-checked against the dataclasses;
an unknown key is refused with the nearest valid ones ("did you mean"). Every number is then
range-checked (finite, and in the range NUMERIC_RANGES gives its field) before anything is built.
Nothing here executes code from a config.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional, Union

from topoclip.data.scenes import SceneConfig
from topoclip.data.sources import SOURCES, SourceError, get_source
from topoclip.errors import UserError
from topoclip.geometry import TOPOLOGIES


class ConfigError(UserError, ValueError):
    """A configuration that cannot work; the message names the field and the fix."""


# --------------------------------------------------------------------------- model


@dataclass
class VisionConfig:
    """ViT image tower (pre-norm by default, as the reference release)."""

    image_size: int = 224
    patch_size: int = 16
    width: int = 768
    layers: int = 12
    heads: int = 12
    mlp_ratio: float = 4.0
    activation: Literal["gelu", "quick_gelu"] = "gelu"
    norm_first: bool = True
    # Normalisation of input pixels (OpenAI CLIP's statistics).
    mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class TextConfig:
    """BERT-style bidirectional text tower (post-norm with an embedding LayerNorm by default)."""

    vocab_size: int = 30522
    context_length: int = 77
    width: int = 512
    layers: int = 12
    heads: int = 8
    mlp_ratio: float = 4.0
    activation: Literal["gelu", "quick_gelu"] = "gelu"
    norm_first: bool = False
    embedding_norm: bool = True
    # The m class tokens are this id repeated m times; the tokenizer's [CLS] ([CLS] = 101 in BERT
    # vocabularies, 2 in vocabularies topoclip trains).
    cls_token_id: int = 101
    # OpenAI CLIP's text tower is "causal" (each token attends to itself and earlier ones) and
    # pooled at its end-of-text token; see topoclip.pooling for the two layouts of the m tokens.
    attention: Literal["bidirectional", "causal"] = "bidirectional"
    pooling: Literal["class_tokens", "end_of_text"] = "class_tokens"


@dataclass
class TemperatureConfig:
    """τ = exp(t): init is t; max_scale clamps τ after each step; SigLIP's bias is optional."""

    init: float = 2.659
    max_scale: float = 100.0
    learnable: bool = True
    bias_init: Optional[float] = None


@dataclass
class ModelConfig:
    """A CLIP with `class_tokens` class tokens per tower, each projected to `embed_dim`.

    The (class_tokens · embed_dim) outputs are read as `spheres` rows of
    n = class_tokens · embed_dim / spheres: Multi(32, 16) is class_tokens=16, embed_dim=32,
    spheres=16; the single-token Ob(64, 8) is class_tokens=1, embed_dim=512, spheres=8.
    `spheres` 0 means one per class token (and 1 for sphere and euclidean, whose space is not a
    product).
    """

    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    temperature: TemperatureConfig = field(default_factory=TemperatureConfig)
    topology: str = "ps-inner"
    class_tokens: int = 1
    embed_dim: int = 512
    spheres: int = 0

    @property
    def sphere_count(self) -> int:
        """m: the number of rows of an embedding."""
        if self.spheres:
            return self.spheres
        return self.class_tokens if TOPOLOGIES[self.topology].product else 1

    @property
    def sphere_dim(self) -> int:
        """n: the dimension of each row."""
        return self.class_tokens * self.embed_dim // self.sphere_count


# --------------------------------------------------------------------------- training


@dataclass
class TrainConfig:
    """Optimisation recipe (paper Table 5) and run mechanics."""

    batch_size: int = 256
    steps: int = 1000
    lr: float = 5e-4
    weight_decay: float = 0.2
    warmup_steps: int = 100
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clip; 0 turns it off
    loss: Literal["infonce", "sigmoid"] = "infonce"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    seed: int = 0
    device: str = "auto"  # "auto" = cuda if available else cpu
    threads: int = 0  # torch intra-op threads on CPU; 0 keeps torch's default
    accumulation_steps: int = 1  # exact contrastive gradient accumulation (micro-batches per step)
    gradient_checkpointing: bool = False
    compile: bool = False
    # fp32 matrix products on CUDA in TF32 (OpenCLIP's trainer does the same); false: bit-level fp32.
    allow_tf32: bool = True
    # torch's fused AdamW kernel where it exists (CUDA): one kernel for all weights, and a step skipped
    # for a non-finite loss without the host waiting for the GPU. Ignored on CPU.
    fused_optimizer: bool = True
    num_workers: int = 2
    log_every: int = 10
    eval_every: int = 0  # steps between evaluations; 0 = only at the end
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    # A checkpoint whose weights and tokenizer start the run (`topoclip train --init-from`); its model
    # must match this one (topoclip.training.init_from). "" = random initialisation.
    init_from: str = ""


# --------------------------------------------------------------------------- data


@dataclass
class DataConfig:
    """Where training pairs come from: the built-in scenes, a CSV/TSV, or WebDataset shards."""

    source: str = "scenes"  # a name in topoclip.data.sources.SOURCES
    scenes: SceneConfig = field(default_factory=SceneConfig)
    # csv: the CSV/TSV path; shards: brace patterns, several sources joined by "::"
    # (e.g. "web/{00000..00099}.tar::cc/{000..009}.tar").
    train_data: str = ""
    weights: list[float] = field(default_factory=list)  # one per "::" source; needs resampled
    csv_image_key: str = "filepath"
    csv_caption_key: str = "title"
    csv_separator: str = ""  # "" = tab for .tsv, comma otherwise
    # CSV image paths must lie inside the CSV's folder; true also reads absolute paths and "../" ones
    # (refused by default and counted as path_outside_root: a table should not reach other files).
    csv_allow_outside_paths: bool = False
    resampled: bool = False  # shards drawn with replacement (endless stream; needs samples_per_epoch)
    samples_per_epoch: int = 0  # shards: fixed epoch length (0 = one pass over the shards)
    shuffle_buffer: int = 1000
    max_bad_fraction: float = 0.01  # stop when skipped samples exceed this share of those seen
    # "" = train a WordPiece vocabulary of model.text.vocab_size on the training captions;
    # else a BERT vocab.txt or a tokenizer.json.
    tokenizer: str = ""
    augment_scale: tuple[float, float] = (0.8, 1.0)  # RandomResizedCrop area fraction


@dataclass
class EvaluateConfig:
    """What is evaluated during and after training (and by `topoclip eval`)."""

    template_modes: list[str] = field(default_factory=lambda: ["distance", "embedding"])
    size: int = 1000  # images per built-in evaluation set (scenes), final evaluation
    validation_size: int = 200  # the same for the periodic evaluations during training (train.eval_every)
    captions_per_image: int = 5
    classification: list[str] = field(default_factory=list)  # class-folder roots of the user's own sets
    retrieval: list[str] = field(default_factory=list)  # Karpathy-layout caption JSON files
    batch_size: int = 256


# --------------------------------------------------------------------------- top level


@dataclass
class Config:
    """Everything a run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    name: str = ""


# --------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts; every number must also be finite (no NaN, no ±Infinity)."""

    low: float = -math.inf
    high: float = math.inf
    low_inclusive: bool = True
    high_inclusive: bool = True
    note: str = ""  # what a boundary value means, e.g. "0 turns it off"

    def __contains__(self, value: float) -> bool:
        above = value >= self.low if self.low_inclusive else value > self.low
        below = value <= self.high if self.high_inclusive else value < self.high
        return math.isfinite(value) and above and below

    def describe(self) -> str:
        """'≥ 1', '> 0', 'in [0, 1)', 'in [1, 4,194,304]', ... (empty when any finite number will do)."""
        low, high = _bound(self.low), _bound(self.high)
        if self.low > -math.inf and self.high < math.inf:
            return f"in {'[' if self.low_inclusive else '('}{low}, {high}{']' if self.high_inclusive else ')'}"
        if self.low > -math.inf:
            return f"{'≥' if self.low_inclusive else '>'} {low}"
        if self.high < math.inf:
            return f"{'≤' if self.high_inclusive else '<'} {high}"
        return ""


def _bound(value: float) -> str:
    """A range's bound as a person reads it: 4,194,304 rather than 4.1943e+06; 0.5 as 0.5."""
    return f"{int(value):,}" if math.isfinite(value) and value == int(value) else f"{value:g}"


FINITE = Range()
POSITIVE = Range(0, low_inclusive=False)
AT_LEAST_ONE = Range(1)
NON_NEGATIVE = Range(0)
FRACTION = Range(0, 1)
OFF_AT_ZERO = Range(0, note="0 turns it off")

# Every numeric field of Config (a list or tuple: each item), by its dotted key. A field missing here
# is only checked to be finite; tests/test_config.py checks the table covers every numeric field.
# data.scenes.* repeat SceneConfig's own checks so every range is read in one place.
NUMERIC_RANGES: dict[str, Range] = {
    # Upper bounds on sizes: what a config may ask for before memory is sized from it (a config may come from
    # anyone's folder). Each note names the memory the bound stands for; real models sit far below them.
    "model.vision.image_size": Range(1, 8192, note="a batch of 8192 px images is 805 MB an image in fp32"),
    "model.vision.patch_size": AT_LEAST_ONE,
    "model.vision.width": Range(1, 16384, note="a layer holds about 12 · width² fp32 weights: 12 GiB at 16384"),
    "model.vision.layers": Range(1, 1024, note="each layer holds about 12 · width² fp32 weights"),
    "model.vision.heads": AT_LEAST_ONE,
    "model.vision.mlp_ratio": POSITIVE,
    "model.vision.mean": FINITE,
    "model.vision.std": POSITIVE,
    "model.text.vocab_size": Range(1, 2**22, note="the token embedding is vocab_size · model.text.width fp32 "
                                                   "numbers: 16 GiB at 4,194,304 × 1024"),
    "model.text.context_length": Range(2, 65536, note="room for [CLS] and [SEP]; attention is context² a head"),
    "model.text.width": Range(1, 16384, note="a layer holds about 12 · width² fp32 weights: 12 GiB at 16384"),
    "model.text.layers": Range(1, 1024, note="each layer holds about 12 · width² fp32 weights"),
    "model.text.heads": AT_LEAST_ONE,
    "model.text.mlp_ratio": POSITIVE,
    "model.text.cls_token_id": NON_NEGATIVE,
    "model.temperature.init": FINITE,
    "model.temperature.max_scale": POSITIVE,
    "model.temperature.bias_init": FINITE,
    "model.class_tokens": Range(1, 4096, note="each class token adds a sequence position and an output row"),
    "model.embed_dim": Range(1, 65536, note="the projections are width · embed_dim fp32 numbers each"),
    "model.spheres": Range(0, note="0 = one sphere per class token"),
    "train.batch_size": Range(1, 2**20, note="the similarity matrix is batch² fp32 numbers: 4 TiB at 2^20"),
    "train.steps": Range(1, 10**12),
    "train.lr": Range(0, 10, low_inclusive=False, note="AdamW moves every weight by about lr a step"),
    "train.weight_decay": OFF_AT_ZERO,
    "train.warmup_steps": Range(0, note="0 = no warm-up"),
    "train.betas": Range(0, 1, high_inclusive=False),
    "train.eps": POSITIVE,
    "train.grad_clip": Range(0, note="0 turns clipping off"),
    "train.seed": NON_NEGATIVE,
    "train.threads": Range(0, 4096, note="0 keeps torch's default"),
    "train.accumulation_steps": AT_LEAST_ONE,
    "train.num_workers": Range(0, 256, note="0 reads data in the main process; each worker is a process "
                                            "holding its prefetched batches"),
    "train.log_every": AT_LEAST_ONE,
    "train.eval_every": Range(0, note="0 = only at the end"),
    "train.checkpoint_every": Range(0, note="0 = only at the end"),
    "train.keep_checkpoints": AT_LEAST_ONE,
    "data.scenes.image_size": Range(16),
    "data.scenes.min_objects": AT_LEAST_ONE,
    "data.scenes.max_objects": Range(1, 9, note="one object per 3x3 grid cell"),
    "data.scenes.seed": NON_NEGATIVE,
    "data.scenes.train_size": Range(0, 10**8, note="its shuffle order is 8 B a sample and its rendered pixels "
                                                    "3 KB a sample at 32 px: 800 MB and 300 GB at 10^8"),
    "data.scenes.val_size": Range(0, 10**7, note="rendered pixels are 3 KB a sample at 32 px: 30 GB at 10^7"),
    "data.scenes.test_size": Range(0, 10**7, note="rendered pixels are 3 KB a sample at 32 px: 30 GB at 10^7"),
    "data.scenes.noise": FRACTION,
    "data.scenes.object_scale": Range(0.5, 1.8, note="1.8 makes a large object 90 % of the image"),
    "data.weights": NON_NEGATIVE,
    "data.samples_per_epoch": Range(0, 10**12, note="0 = one pass over the shards"),
    "data.shuffle_buffer": Range(0, 10**6, note="0 or 1 = no shuffling; each worker holds that many encoded "
                                                "samples: ~100 GB at 10^6 web images of 100 KB"),
    "data.max_bad_fraction": FRACTION,
    "data.augment_scale": Range(0, 1, low_inclusive=False),
    "evaluate.size": Range(1, 10**6, note="images rendered and embedded per set: 3 GB of pixels at 10^6, "
                                          "and a 10^6 × captions similarity matrix for retrieval"),
    "evaluate.validation_size": Range(1, 10**6, note="as evaluate.size"),
    "evaluate.captions_per_image": Range(1, 100, note="retrieval scores images × captions pairs"),
    "evaluate.batch_size": Range(1, 2**20, note="a batch of images is embedded at once"),
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numeric_fields(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every number, or list/tuple of numbers, in a (nested) config dataclass."""
    found = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            found += numeric_fields(value, prefix + f.name + ".")
        elif _is_number(value) or (isinstance(value, (list, tuple)) and value and all(map(_is_number, value))):
            found.append((prefix + f.name, value))
    return found


def _default_of(key: str) -> Any:
    """The dataclass default of a dotted key (for the fix a message suggests)."""
    value: Any = Config()
    for part in key.split("."):
        value = getattr(value, part)
    return list(value) if isinstance(value, tuple) else value


def validate_numbers(config: "Config") -> None:
    """Refuse a non-finite number, or one outside its field's range, naming the field, value and a fix."""
    for key, value in numeric_fields(config):
        allowed = NUMERIC_RANGES.get(key, FINITE)
        items = value if isinstance(value, (list, tuple)) else [value]
        if all(item in allowed for item in items):
            continue
        shown = json.dumps(list(value) if isinstance(value, tuple) else value)  # NaN / Infinity as typed
        integer = all(isinstance(item, int) for item in items)
        what = ("integers" if integer else "finite numbers") if isinstance(value, (list, tuple)) else \
            ("an integer" if integer else "a finite number")
        rule = " ".join(part for part in (what, allowed.describe()) if part)
        note = f" ({allowed.note})" if allowed.note else ""
        default = _default_of(key)
        if default is None:
            fix = f"; or {key}=null (the default)"
        elif default == []:
            fix = ""
        else:
            fix = f"; e.g. {key}={json.dumps(default)} (the default)"
        raise ConfigError(f"{key}={shown} must be {rule}{note}{fix}")


def validate_model(config: ModelConfig) -> None:
    """Refuse a model that cannot work, naming the field and the fix (numbers are range-checked first)."""
    if config.topology not in TOPOLOGIES:
        raise ConfigError(f"model.topology={config.topology!r} is unknown; choose one of {sorted(TOPOLOGIES)}")
    total = config.class_tokens * config.embed_dim
    if config.spheres and not TOPOLOGIES[config.topology].product and config.spheres != 1:
        raise ConfigError(f"model.spheres={config.spheres} only applies to product-sphere topologies; "
                          f"set model.spheres=0 for {config.topology!r} or pick ps-inner / ps-geodesic")
    if total % config.sphere_count:
        raise ConfigError(f"class_tokens·embed_dim = {config.class_tokens}·{config.embed_dim} = {total} is not divisible "
                          f"by model.spheres={config.spheres}; choose spheres dividing {total}")
    for tower, sub in [("vision", config.vision), ("text", config.text)]:
        if sub.width % sub.heads:
            raise ConfigError(f"model.{tower}.width={sub.width} is not divisible by model.{tower}.heads={sub.heads}; "
                              f"pick heads dividing {sub.width}")
    vision = config.vision
    if vision.image_size % vision.patch_size:
        raise ConfigError(f"model.vision.image_size={vision.image_size} is not a multiple of "
                          f"model.vision.patch_size={vision.patch_size}; pick a patch size dividing it")
    if not config.text.cls_token_id < config.text.vocab_size:
        raise ConfigError(f"model.text.cls_token_id={config.text.cls_token_id} is outside the vocabulary "
                          f"(vocab_size={config.text.vocab_size})")
    if config.text.attention == "causal" and config.text.pooling == "class_tokens":
        raise ConfigError("model.text.attention=causal with pooling=class_tokens: class tokens at the start would "
                          "see only themselves; set model.text.pooling=end_of_text (OpenAI CLIP's layout)")


def validate_train(config: TrainConfig) -> None:
    """Refuse an optimisation recipe that cannot work (numbers are range-checked first)."""
    if config.batch_size % config.accumulation_steps:
        raise ConfigError(f"train.batch_size={config.batch_size} is not divisible by "
                          f"train.accumulation_steps={config.accumulation_steps}")


# --------------------------------------------------------------------------- dict <-> dataclass


def to_dict(obj: Any) -> Any:
    """A dataclass (nested) -> plain JSON-able dict (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp` (converting int→float, list→tuple); raise ConfigError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in args:
            if option is type(None):
                continue
            try:
                return coerce(value, option, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r} does not fit {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} must be one of {list(args)}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}={value!r} must have {len(args)} items")
            return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping of fields of {tp.__name__}")
        return from_dict(tp, value, prefix=key + ".")
    if tp is Any:
        return value
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{key}={value!r} must be {_type_name(tp)}")
    return value


def from_dict(cls: type, values: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from a (partial) dict; an unknown key raises ConfigError with the nearest ones."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(unknown_key_message(prefix + unknown[0]))
    kwargs = {name: coerce(value, hints[name], prefix + name) for name, value in values.items()}
    try:
        return cls(**kwargs)
    except ValueError as error:  # a section's own __post_init__ check
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {error}") from None


def merge(base: dict, update: dict) -> dict:
    """Deep-merge `update` into a copy of `base` (dicts merge, everything else replaces)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def flat_dict(values: dict, separator: str = ".", prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 5e-4}} -> {"train.lr": 5e-4}: every leaf of nested dicts by its joined key."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flat_dict(value, separator, f"{prefix}{key}{separator}"))
        else:
            flat[prefix + key] = value
    return flat


def valid_keys(cls: type = None, prefix: str = "") -> list[str]:
    """Every dotted key `--set` accepts (nested dataclasses expanded)."""
    cls = cls or Config
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys += valid_keys(tp, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def unknown_key_message(key: str) -> str:
    """'unknown key K; did you mean A or B? (keys under S: ...)': close matches and one section's keys."""
    keys = valid_keys()
    leaves = {k: k.rsplit(".", 1)[-1] for k in keys}
    # Close to the whole key ("train.lrr" -> train.lr; only those nearly as close as the best), or
    # the same field name under a section ("lr" -> train.lr).
    scored = sorted(((difflib.SequenceMatcher(None, key, k).ratio(), k) for k in keys), reverse=True)
    close = [k for score, k in scored[:3] if score >= max(0.6, scored[0][0] - 0.1)]
    near_leaves = difflib.get_close_matches(key.rsplit(".", 1)[-1], sorted(set(leaves.values())), n=2, cutoff=0.8)
    same_field = [k for leaf in near_leaves for k in keys if leaves[k] == leaf]
    suggestions = list(dict.fromkeys(close + same_field))[:3]
    message = f"unknown key {key!r}"
    if suggestions:
        message += "; did you mean " + " or ".join(suggestions) + "?"
    section = _nearest_section(suggestions[0] if suggestions else key, keys)
    # The section's own fields; its subsections shown once each, as "model.vision.…".
    rests = [k[len(section):] for k in keys if k.startswith(section)]
    children = dict.fromkeys(section + rest.split(".", 1)[0] + (".…" if "." in rest else "") for rest in rests)
    where = f"keys under {section}" if section else "sections"
    return message + f" ({where}: {', '.join(children)})"


def _nearest_section(key: str, keys: list[str]) -> str:
    """The longest "a.b." prefix of `key` that is a section of Config ("" for the top level)."""
    sections = {k[: i + 1] for k in keys for i, char in enumerate(k) if char == "."}
    parts = key.split(".")[:-1]
    for length in range(len(parts), 0, -1):
        if ".".join(parts[:length]) + "." in sections:
            return ".".join(parts[:length]) + "."
    return ""


# --------------------------------------------------------------------------- overrides


def parse_value(text: str) -> Any:
    """`--set` value text -> JSON value when it parses (numbers, true/false, null, lists), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
    except RecursionError:  # "[[[[...": no setting nests lists more than one deep
        raise ConfigError(f"a --set value nests lists {text.count('[')} deep ({text[:20]}...); no setting takes "
                          f"more than one level of list, e.g. data.weights=[1.0, 3.0]") from None


def apply_overrides(values: dict, overrides: list[str]) -> dict:
    """Apply ["section.field=value", ...] to a config dict (checked later by from_dict)."""
    keys = valid_keys()
    out = values
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. model.class_tokens=16")
        key, text = item.split("=", 1)
        key = key.strip()
        if key not in keys:
            raise ConfigError(unknown_key_message(key))
        update: Any = parse_value(text)
        for part in reversed(key.split(".")):
            update = {part: update}
        out = merge(out, update)
    return out


def override_value(overrides: list[str], key: str) -> Any:
    """The value the last of `overrides` gives `key` (None when none names it)."""
    value = None
    for item in overrides:
        name, _, text = item.partition("=")
        if name.strip() == key:
            value = parse_value(text)
    return value


# --------------------------------------------------------------------------- presets


PRESET_PACKAGE = "topoclip.preset_data"
DEFAULT_PRESET = "cpu-multi"  # what `topoclip train` trains with no --preset


def _preset_files() -> dict[str, Any]:
    root = resources.files(PRESET_PACKAGE)
    return {Path(p.name).stem: p for p in root.iterdir() if p.name.endswith(".json")}


def presets() -> list[str]:
    """Names of the presets shipped with topoclip (names starting with "_" are bases, not listed)."""
    return sorted(name for name in _preset_files() if not name.startswith("_"))


def read_preset_file(path: Path) -> dict:
    """A preset JSON file's values; ConfigError naming the file when it is not a JSON object."""
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        detail = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise ConfigError(f"preset file {path} is not valid JSON ({detail}); a preset is a JSON object of "
                          f'sections, e.g. {{"base": "cpu-multi", "train": {{"steps": 100}}}}') from None
    if not isinstance(values, dict):
        raise ConfigError(f"preset file {path} holds a JSON {type(values).__name__}, not an object of sections; "
                          f'e.g. {{"base": "cpu-multi", "train": {{"steps": 100}}}}')
    return values


def preset_dict(name: str, _bases: tuple = ()) -> dict:
    """The preset's values as a dict, with its `base` chain resolved (a file path also works)."""
    files = _preset_files()
    if name in files:
        values = json.loads(files[name].read_text())
    elif Path(name).is_file():
        values = read_preset_file(Path(name))
    else:
        close = difflib.get_close_matches(name, presets(), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown preset {name!r}; {hint}presets: {', '.join(presets())} "
                          f"(`topoclip presets` describes them; a path to a preset JSON file also works)")
    values.pop("description", None)
    own_name = values.get("name", Path(name).stem)
    base = values.pop("base", None)
    if base:
        if base in _bases:
            raise ConfigError(f"preset {name!r}: its base chain {' -> '.join(_bases + (name, base))} is a loop; "
                              f"end it at a shipped preset")
        values = merge(preset_dict(base, _bases + (name,)), values)
    values["name"] = own_name  # the run is named after the preset asked for, not its base
    return values


def load_config(preset: Optional[str] = None, overrides: Optional[list[str]] = None, values: Optional[dict] = None) -> Config:
    """Resolve a preset (or explicit values) plus overrides into a validated Config."""
    merged = preset_dict(preset) if preset else {}
    if values:
        merged = merge(merged, values)
    merged = apply_overrides(merged, overrides or [])
    config = from_dict(Config, merged)
    validate(config)
    return config


def describe_preset(name: str) -> str:
    files = _preset_files()
    return json.loads(files[name].read_text()).get("description", "") if name in files else ""


def command_urls(data: DataConfig) -> list[str]:
    """The parts of data.train_data that would be opened by running a command (a shard URL with a scheme but
    file:); such a value may come only from the user, never from a config.json read out of a folder."""
    source = SOURCES.get(data.source)  # an unknown source is refused by validate_source, with the choices
    return source.commands(data) if source else []


def refuse_folder_commands(config: Config, file: Path, typed: Optional[str] = None) -> None:
    """ConfigError when `file` (a config.json read from a folder) has data.train_data run a command,
    unless the user typed that same value (`typed`, from the command line)."""
    found = command_urls(config.data)
    if found and config.data.train_data != typed:
        raise ConfigError(f"{file} sets data.train_data to {found[0]!r}, which runs a command to read it; a config "
                          f"read from a folder never runs commands. If this is your own run, give the value on the "
                          f"command line: --set data.train_data='{config.data.train_data}'")


def validate_data(config: DataConfig) -> None:
    """Refuse data settings that cannot work."""
    if config.weights and not config.resampled:
        raise ConfigError("data.weights need data.resampled=true (without resampling every shard is read once per epoch)")
    if config.weights and not any(weight > 0 for weight in config.weights):
        raise ConfigError(f"data.weights={config.weights} has no positive weight; give each source a weight ≥ 0, "
                          f"at least one > 0")
    if config.resampled and config.samples_per_epoch < 1:
        raise ConfigError("data.resampled=true draws shards endlessly: set data.samples_per_epoch")
    low, high = config.augment_scale
    if low > high:
        raise ConfigError(f"data.augment_scale={list(config.augment_scale)} must satisfy low ≤ high, "
                          f"e.g. data.augment_scale=[0.8, 1.0]")


def validate_source(config: Config) -> None:
    """The data source's own checks (topoclip.data.sources), e.g. the scenes must hold a training batch."""
    try:
        get_source(config.data.source).check(config)
    except SourceError as error:
        raise ConfigError(str(error)) from None


def validate_evaluate(config: EvaluateConfig) -> None:
    for mode in config.template_modes:
        if mode not in ("distance", "embedding"):
            raise ConfigError(f"evaluate.template_modes has {mode!r}; use \"distance\" (the paper's) and/or \"embedding\" (CLIP's)")


def validate(config: Config) -> None:
    """Validate every section; raises ConfigError before anything is built."""
    validate_numbers(config)
    validate_model(config.model)
    validate_train(config.train)
    validate_source(config)
    validate_data(config.data)
    validate_evaluate(config.evaluate)
    if config.name and (Path(config.name).name != config.name or config.name in (".", "..")):
        raise ConfigError(f"name={config.name!r} must be a plain folder name (no '/', no '..'): it names the run "
                          f"folder runs/NAME-TIMESTAMP; to train somewhere else give --out FOLDER")
    if config.train.loss == "infonce" and config.model.temperature.bias_init is not None:
        raise ConfigError("model.temperature.bias_init is the sigmoid loss's β; InfoNCE has no bias "
                          "(set train.loss=sigmoid, or model.temperature.bias_init=null)")
