"""Typed configuration: dataclasses, named presets stored as JSON data, type-checked overrides.

A run is described by :class:`Config` (model, train, data, evaluate sections). Presets live in
``topoclip/preset_data/*.json``; a preset may name a ``"base"`` preset whose values it overrides.
``--set section.field=value`` overrides are parsed and type-checked against the dataclasses;
unknown keys are refused with the list of valid ones. Nothing here executes code from a config.
"""
from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional, Union

from topoclip.data.scenes import SceneConfig
from topoclip.geometry import TOPOLOGIES


class ConfigError(ValueError):
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
        return self.class_tokens if self.topology.startswith("ps-") else 1

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
    num_workers: int = 2
    log_every: int = 10
    eval_every: int = 0  # steps between evaluations; 0 = only at the end
    checkpoint_every: int = 200
    keep_checkpoints: int = 2


# --------------------------------------------------------------------------- data


@dataclass
class DataConfig:
    """Where training pairs come from: the built-in scenes, a CSV/TSV, or WebDataset shards."""

    source: Literal["scenes", "csv", "shards"] = "scenes"
    scenes: SceneConfig = field(default_factory=SceneConfig)
    # csv: the CSV/TSV path; shards: brace patterns, several sources joined by "::"
    # (e.g. "web/{00000..00099}.tar::cc/{000..009}.tar").
    train_data: str = ""
    weights: list[float] = field(default_factory=list)  # one per "::" source; needs resampled
    csv_image_key: str = "filepath"
    csv_caption_key: str = "title"
    csv_separator: str = ""  # "" = tab for .tsv, comma otherwise
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


def validate_model(config: ModelConfig) -> None:
    """Refuse a model that cannot work, naming the field and the fix."""
    if config.topology not in TOPOLOGIES:
        raise ConfigError(f"model.topology={config.topology!r} is unknown; choose one of {sorted(TOPOLOGIES)}")
    for name, value in [("class_tokens", config.class_tokens), ("embed_dim", config.embed_dim)]:
        if value < 1:
            raise ConfigError(f"model.{name}={value} must be ≥ 1")
    if config.spheres < 0:
        raise ConfigError(f"model.spheres={config.spheres} must be ≥ 0 (0 = one sphere per class token)")
    total = config.class_tokens * config.embed_dim
    if config.spheres and not config.topology.startswith("ps-") and config.spheres != 1:
        raise ConfigError(f"model.spheres={config.spheres} only applies to product-sphere topologies; "
                          f"set model.spheres=0 for {config.topology!r} or pick ps-inner / ps-geodesic")
    if total % config.sphere_count:
        raise ConfigError(f"class_tokens·embed_dim = {config.class_tokens}·{config.embed_dim} = {total} is not divisible "
                          f"by model.spheres={config.spheres}; choose spheres dividing {total}")
    for tower, sub in [("vision", config.vision), ("text", config.text)]:
        for name in ("width", "layers", "heads"):
            if getattr(sub, name) < 1:
                raise ConfigError(f"model.{tower}.{name}={getattr(sub, name)} must be ≥ 1")
        if sub.width % sub.heads:
            raise ConfigError(f"model.{tower}.width={sub.width} is not divisible by model.{tower}.heads={sub.heads}; "
                              f"pick heads dividing {sub.width}")
    vision = config.vision
    if vision.image_size % vision.patch_size:
        raise ConfigError(f"model.vision.image_size={vision.image_size} is not a multiple of "
                          f"model.vision.patch_size={vision.patch_size}")
    if config.text.context_length < 2:
        raise ConfigError(f"model.text.context_length={config.text.context_length} must be ≥ 2 ([CLS] and [SEP])")
    if not 0 <= config.text.cls_token_id < config.text.vocab_size:
        raise ConfigError(f"model.text.cls_token_id={config.text.cls_token_id} is outside the vocabulary "
                          f"(vocab_size={config.text.vocab_size})")
    temperature = config.temperature
    if temperature.max_scale <= 0 or not math.isfinite(temperature.max_scale):
        raise ConfigError(f"model.temperature.max_scale={temperature.max_scale} must be a positive number")


def validate_train(config: TrainConfig) -> None:
    """Refuse an optimisation recipe that cannot work."""
    positive = ["batch_size", "steps", "accumulation_steps", "log_every", "keep_checkpoints"]
    for name in positive:
        if getattr(config, name) < 1:
            raise ConfigError(f"train.{name}={getattr(config, name)} must be ≥ 1")
    for name in ["lr", "weight_decay", "warmup_steps", "grad_clip", "eps", "eval_every", "checkpoint_every",
                 "num_workers", "threads"]:
        if getattr(config, name) < 0:
            raise ConfigError(f"train.{name}={getattr(config, name)} must be ≥ 0")
    if not all(0 <= beta < 1 for beta in config.betas):
        raise ConfigError(f"train.betas={config.betas} must lie in [0, 1)")
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
    """Build dataclass `cls` from a (partial) dict; unknown keys raise ConfigError listing valid ones."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]}; valid keys under {prefix or 'the top level'}: "
                          + ", ".join(prefix + n for n in names))
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


# --------------------------------------------------------------------------- overrides


def parse_value(text: str) -> Any:
    """`--set` value text -> JSON value when it parses (numbers, true/false, null, lists), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


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
            raise ConfigError(f"unknown key {key!r}; valid keys: " + ", ".join(keys))
        update: Any = parse_value(text)
        for part in reversed(key.split(".")):
            update = {part: update}
        out = merge(out, update)
    return out


# --------------------------------------------------------------------------- presets


PRESET_PACKAGE = "topoclip.preset_data"


def _preset_files() -> dict[str, Any]:
    root = resources.files(PRESET_PACKAGE)
    return {Path(p.name).stem: p for p in root.iterdir() if p.name.endswith(".json")}


def presets() -> list[str]:
    """Names of the presets shipped with topoclip (names starting with "_" are bases, not listed)."""
    return sorted(name for name in _preset_files() if not name.startswith("_"))


def preset_dict(name: str) -> dict:
    """The preset's values as a dict, with its `base` chain resolved (a file path also works)."""
    files = _preset_files()
    if name in files:
        values = json.loads(files[name].read_text())
    elif Path(name).is_file():
        values = json.loads(Path(name).read_text())
    else:
        raise ConfigError(f"unknown preset {name!r}; `topoclip presets` lists them: {', '.join(sorted(files))}")
    values.pop("description", None)
    own_name = values.get("name", Path(name).stem)
    base = values.pop("base", None)
    if base:
        values = merge(preset_dict(base), values)
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


def validate_data(config: DataConfig) -> None:
    """Refuse data settings that cannot work."""
    if config.source in ("csv", "shards") and not config.train_data:
        raise ConfigError(f"data.source={config.source!r} needs data.train_data (a CSV path or a shard pattern)")
    if config.weights and not config.resampled:
        raise ConfigError("data.weights need data.resampled=true (without resampling every shard is read once per epoch)")
    if config.resampled and config.samples_per_epoch < 1:
        raise ConfigError("data.resampled=true draws shards endlessly: set data.samples_per_epoch")
    if not 0 <= config.max_bad_fraction <= 1:
        raise ConfigError(f"data.max_bad_fraction={config.max_bad_fraction} must be a fraction in [0, 1]")
    low, high = config.augment_scale
    if not 0 < low <= high <= 1:
        raise ConfigError(f"data.augment_scale={config.augment_scale} must satisfy 0 < low ≤ high ≤ 1")


def validate_evaluate(config: EvaluateConfig) -> None:
    for mode in config.template_modes:
        if mode not in ("distance", "embedding"):
            raise ConfigError(f"evaluate.template_modes has {mode!r}; use \"distance\" (the paper's) and/or \"embedding\" (CLIP's)")
    if min(config.size, config.validation_size, config.batch_size) < 1:
        raise ConfigError("evaluate.size, evaluate.validation_size and evaluate.batch_size must be ≥ 1")


def validate(config: Config) -> None:
    """Validate every section; raises ConfigError before anything is built."""
    validate_model(config.model)
    validate_train(config.train)
    validate_data(config.data)
    validate_evaluate(config.evaluate)
    if config.train.loss == "infonce" and config.model.temperature.bias_init is not None:
        raise ConfigError("model.temperature.bias_init is the sigmoid loss's β; InfoNCE has no bias "
                          "(set train.loss=sigmoid, or model.temperature.bias_init=null)")
