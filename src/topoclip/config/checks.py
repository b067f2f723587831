"""The configuration's checks: every number in its range (NUMERIC_RANGES), then each section's rules; a config
read from a folder may not run a command. All raise ConfigError naming the field and the fix, before anything
is built."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from topoclip.config.schema import (LORA_TARGETS, LORA_TOWERS, TEMPLATE_MODES, Config, ConfigError, CurvatureConfig, DataConfig, EvaluateConfig, ModelConfig,
                                    TrainConfig)
from topoclip.data.sources import SOURCES, SourceError, check_readable, get_source
from topoclip.core.errors import file_name_problem
from topoclip.core.geometry import TOPOLOGIES, get_topology
from topoclip.core.losses import get_loss


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
# The longest vision sequence: (image_size / patch_size)² + class tokens, the bound of the text context.
MAX_POSITIONS = 65536
INT64_LIMIT = 2**63  # every integer setting ends in a torch or numpy int64 (a seed, a size, a step)
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
    "model.vision.layer_norm_eps": Range(0, 0.1, low_inclusive=False,
                                          note="ε keeps the LayerNorm's variance off 0: 1e-5 (CLIP) or 1e-6 (SigLIP)"),
    "model.vision.mean": FINITE,
    "model.vision.std": POSITIVE,
    "model.text.vocab_size": Range(1, 2**22, note="the token embedding is vocab_size · model.text.width fp32 "
                                                   "numbers: 16 GiB at 4,194,304 × 1024"),
    "model.text.context_length": Range(2, 65536, note="room for [CLS] and [SEP]; attention is context² a head"),
    "model.text.width": Range(1, 16384, note="a layer holds about 12 · width² fp32 weights: 12 GiB at 16384"),
    "model.text.layers": Range(1, 1024, note="each layer holds about 12 · width² fp32 weights"),
    "model.text.heads": AT_LEAST_ONE,
    "model.text.mlp_ratio": POSITIVE,
    "model.text.layer_norm_eps": Range(0, 0.1, low_inclusive=False,
                                        note="ε keeps the LayerNorm's variance off 0: 1e-5 (CLIP) or 1e-6 (SigLIP)"),
    "model.text.cls_token_id": NON_NEGATIVE,
    "model.text.end_token_id": NON_NEGATIVE,
    "model.temperature.init": FINITE,
    "model.temperature.max_scale": POSITIVE,
    "model.temperature.bias_init": FINITE,
    "model.curvature.init": Range(1e-3, 1e3, note="c of the curvature −c; MERU starts at 1"),
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
    "train.lock_image_unlocked_groups": Range(0, note="0 = the whole locked tower frozen"),
    "train.margin": Range(0, 1000, note="in similarity units (or range half-widths with train.margin_relative)"),
    "train.max_hinge_warmup_steps": Range(0, note="0 = the hardest negative from the first step"),
    "train.entailment_weight": Range(0, 100, note="0 = no entailment loss; MERU's is 0.2"),
    "train.lock_text_unlocked_layers": Range(0, note="0 = the whole locked tower frozen"),
    "train.lora_rank": Range(0, 4096, note="0 = no LoRA; an adapter holds rank · (its input + output width) weights"),
    "train.lora_alpha": POSITIVE,
    "train.lora_dropout": Range(0, 1, high_inclusive=False),
    "train.accumulation_steps": AT_LEAST_ONE,
    "train.num_workers": Range(0, 256, note="0 reads data in the main process; each worker is a process "
                                            "holding its prefetched batches"),
    "evaluate.num_workers": Range(0, 256, note="0 decodes in the main process; each worker is a process"),
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
        huge = next((item for item in items if isinstance(item, int) and not -INT64_LIMIT <= item < INT64_LIMIT), None)
        if huge is not None:  # before any arithmetic: float(2**1100) overflows, str() of 5,000 digits is refused
            raise ConfigError(f"{key} is an integer of {huge.bit_length()} bits, past the 64-bit integers that torch "
                              f"and numpy take (|value| < 2^63); e.g. {key}={json.dumps(_default_of(key))} (the default)")
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
    # An image size that is not a multiple of the patch size drops its last image_size mod patch_size rows and columns
    # of pixels, as a strided convolution does (transformers', timm's, OpenCLIP's ViTs): SigLIP SO400M/14 at 384 px is
    # 27 patches of 14 a side, its last 6 pixels unread.
    if vision.image_size < vision.patch_size:
        raise ConfigError(f"model.vision.image_size={vision.image_size} is smaller than one patch "
                          f"(model.vision.patch_size={vision.patch_size}); pick a patch size at most the image size")
    positions = (vision.image_size // vision.patch_size) ** 2 + (config.class_tokens if vision.pooling == "class_tokens"
                                                                 else 0)
    if positions > MAX_POSITIONS:
        raise ConfigError(f"model.vision.image_size={vision.image_size} with patch_size={vision.patch_size} makes "
                          f"{positions:,} positions, over {MAX_POSITIONS:,} (attention is positions² a head); raise "
                          f"the patch size or lower the image size (ViT-B/16: 224 and 16)")
    if not config.text.cls_token_id < config.text.vocab_size:
        raise ConfigError(f"model.text.cls_token_id={config.text.cls_token_id} is outside the vocabulary "
                          f"(vocab_size={config.text.vocab_size})")
    end = config.text.end_token_id
    if end is not None and (config.text.pooling != "end_of_text" or not end < config.text.vocab_size):
        raise ConfigError(f"model.text.end_token_id={end} is the token model.text.pooling=end_of_text reads; "
                          + (f"this model pools {config.text.pooling}: set model.text.end_token_id=null"
                             if config.text.pooling != "end_of_text" else
                             f"it is outside the vocabulary (vocab_size={config.text.vocab_size})"))
    if config.text.attention == "causal" and config.text.pooling == "class_tokens":
        raise ConfigError("model.text.attention=causal with pooling=class_tokens: class tokens at the start would "
                          "see only themselves; set model.text.pooling=end_of_text (OpenAI CLIP's layout)")


def validate_train(config: TrainConfig) -> None:
    """Refuse an optimisation recipe that cannot work (numbers are range-checked first)."""
    if config.batch_size % config.accumulation_steps:
        raise ConfigError(f"train.batch_size={config.batch_size} is not divisible by "
                          f"train.accumulation_steps={config.accumulation_steps}")


REPORTERS = ("tensorboard", "wandb")


def validate_reporters(config: TrainConfig) -> None:
    """train.report_to names known reporters; "wandb" must be installed (said before training, not after)."""
    import importlib.util

    unknown = [name for name in config.report_to if name not in REPORTERS]
    if unknown:
        raise ConfigError(f"train.report_to has {unknown}; choose from {list(REPORTERS)} (metrics.jsonl is always "
                          f"written)")
    if "wandb" in config.report_to and importlib.util.find_spec("wandb") is None:
        raise ConfigError("train.report_to has \"wandb\" but wandb is not installed: pip install 'topoclip[wandb]' "
                          "(or drop it from train.report_to)")


def group_count(layers: int) -> int:
    """Groups of a tower of `layers` blocks, as `topoclip.run.training.lock.tower_groups` makes them: the embeddings,
    layers − 1 blocks, the last block with the final norm, the projection."""
    return layers + 2


def validate_locks(config: Config) -> None:
    """Unlocked groups of a locked tower: 0 … its groups (layers + 2); none without the lock."""
    train, model = config.train, config.model
    for tower, locked, unlocked, layers in (("image", train.lock_image, train.lock_image_unlocked_groups,
                                             model.vision.layers),
                                            ("text", train.lock_text, train.lock_text_unlocked_layers, model.text.layers)):
        key = "train.lock_image_unlocked_groups" if tower == "image" else "train.lock_text_unlocked_layers"
        if unlocked and not locked:
            raise ConfigError(f"{key}={unlocked} without train.lock_{tower}=true: it says how much of a locked "
                              f"tower to train; lock the tower too")
        if not 0 <= unlocked <= group_count(layers):
            raise ConfigError(f"{key}={unlocked}: the {tower} tower has {group_count(layers)} groups (the "
                              f"embeddings, {layers} blocks, the projection); pick 0 … {group_count(layers)}")
    if train.lock_image and train.lock_text and not (train.lock_image_unlocked_groups or train.lock_text_unlocked_layers):
        raise ConfigError("train.lock_image and train.lock_text lock both towers: only τ would train; unlock "
                          "some groups (train.lock_image_unlocked_groups / train.lock_text_unlocked_layers)")


def validate_lora(config: Config) -> None:
    """LoRA's targets and towers from their lists; no LoRA on a locked tower, nor with FSDP; peft installed."""
    train = config.train
    for key, values, choices in (("train.lora_targets", train.lora_targets, LORA_TARGETS),
                                 ("train.lora_towers", train.lora_towers, LORA_TOWERS)):
        unknown = [value for value in values if value not in choices]
        if unknown or not values or len(set(values)) != len(values):
            raise ConfigError(f"{key}={values!r:.120}: give one or more of {', '.join(choices)}, each once")
    if not train.lora_rank:
        return
    locked = [tower for tower in train.lora_towers if getattr(train, f"lock_{tower}")]
    if locked:
        raise ConfigError(f"train.lora_towers has the {locked[0]} tower, which train.lock_{locked[0]} locks: LoRA "
                          f"already freezes a tower's own weights; drop the lock, or the tower from train.lora_towers")
    if train.parallelism == "fsdp":
        raise ConfigError("train.lora_rank with train.parallelism=fsdp is not built: the adapters are small, and the "
                          "frozen towers hold no optimiser state; use train.parallelism=ddp")
    widths = {"image": config.model.vision.width, "text": config.model.text.width}
    narrowest = min(widths[tower] for tower in train.lora_towers)
    if train.lora_rank > narrowest:
        raise ConfigError(f"train.lora_rank={train.lora_rank} is more than the width of a tower it adapts "
                          f"({narrowest}): a low-rank adapter has rank ≤ its width; pick 1 … {narrowest}")
    if train.lora_dropout and "attn.in_proj_weight" in train.lora_targets:
        raise ConfigError(f"train.lora_dropout={train.lora_dropout:g} with attn.in_proj_weight in train.lora_targets: "
                          f"peft's adapter on a parameter (the packed q/k/v) has no dropout; drop attn.in_proj_weight "
                          f"from train.lora_targets, or set train.lora_dropout=0")


def require_lora_library(config: Config) -> None:
    """peft, when the run trains LoRA adapters (a model trained so loads without it: its weights are merged)."""
    if config.train.lora_rank and importlib.util.find_spec("peft") is None:
        raise ConfigError("train.lora_rank needs peft, the field's LoRA library: pip install 'topoclip[lora]'")


def command_urls(data: DataConfig) -> list[str]:
    """The URLs data.train_data expands to that would be opened by running a command or over the network (any
    scheme but file:, after brace expansion); such a value may come only from the user, never from a config.json
    read out of a folder."""
    source = SOURCES.get(data.source)  # an unknown source is refused by validate_source, with the choices
    try:
        return source.commands(data) if source else []
    except SourceError as error:
        raise ConfigError(str(error)) from None


# The settings a config read from a file (a folder's config.json, a preset or grid file) may not turn to a command or
# the network unless typed (see below).
FOLDER_GUARDED = ("data.train_data", "train.report_to")


def refuse_folder_commands(config: Config, file: Path, typed: Optional[dict] = None) -> None:
    """ConfigError when `file` (a config.json read from a folder, a preset or grid file: anyone's) would run a command
    or reach the network: a data.train_data that expands to a command or network URL, or train.report_to with "wandb"
    (which uploads), unless the user typed that same value (`typed`: FOLDER_GUARDED key -> the value the command line
    gave)."""
    typed = typed or {}
    found = command_urls(config.data)
    if found and config.data.train_data != typed.get("data.train_data"):
        raise ConfigError(f"{file} sets data.train_data to {found[0]!r:.200}, which runs a command or reads the network "
                          f"(after brace expansion); a setting read from a file never does either. If the file is "
                          f"your own, give the value on the command line: --set data.train_data="
                          f"'{config.data.train_data[:300]}'")
    if "wandb" in config.train.report_to and "wandb" not in (typed.get("train.report_to") or []):
        raise ConfigError(f"{file} sets train.report_to to {list(config.train.report_to)}: W&B uploads to the network, "
                          f"which a setting read from a file never turns on. If the file is your own, give it on the "
                          f"command line: --set 'train.report_to={json.dumps(list(config.train.report_to))}'")


def validate_data(config: DataConfig) -> None:
    """Refuse data settings that cannot work."""
    if config.weights and not config.resampled:
        raise ConfigError("data.weights need data.resampled=true (without resampling every shard is read once per epoch)")
    if config.weights and not any(weight > 0 for weight in config.weights):
        raise ConfigError(f"data.weights={config.weights} has no positive weight; give each source a weight ≥ 0, "
                          f"at least one > 0")
    if config.resampled and config.samples_per_epoch < 1:
        raise ConfigError("data.resampled=true draws shards endlessly: set data.samples_per_epoch")
    if len(config.csv_separator) > 1:  # csv reads one character; OpenCLIP's '\t' (two) is taken as a tab before this
        raise ConfigError(f"data.csv_separator={config.csv_separator!r:.20} must be one character (or empty: a tab for "
                          f".tsv, a comma otherwise); a tab is '\\t' or $'\\t' in a shell")
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


def validate_readable(data: DataConfig, batch_size: int) -> None:
    """The files a run of `data` with this global batch will read, opened before its run folder is made (a CSV's
    header, columns and first batch of rows)."""
    try:
        check_readable(data, batch_size)
    except SourceError as error:
        raise ConfigError(str(error)) from None


def validate_evaluate(config: EvaluateConfig, topology: str) -> None:
    for mode in config.template_modes:
        if mode not in TEMPLATE_MODES:
            choices = ", ".join(f"\"{name}\" ({whose})" for name, whose in TEMPLATE_MODES.items())
            raise ConfigError(f"evaluate.template_modes has {mode!r}; use one or more of {choices}")
    not_flat = get_topology(topology).not_flat
    if "flat" in config.template_modes and not_flat:
        raise ConfigError(f"evaluate.template_modes has \"flat\" (CLIP_benchmark's averaging of flat vectors), "
                          f"which {topology} cannot use: {not_flat}; use \"distance\" or \"embedding\"")


def validate(config: Config) -> None:
    """Validate every section; raises ConfigError before anything is built."""
    validate_numbers(config)
    validate_model(config.model)
    validate_train(config.train)
    validate_reporters(config.train)
    validate_locks(config)
    validate_lora(config)
    validate_source(config)
    validate_data(config.data)
    validate_evaluate(config.evaluate, config.model.topology)
    problem = file_name_problem(config.name) if config.name else None
    if problem:
        raise ConfigError(f"name={config.name!r:.80} must be a plain folder name ({problem}): it names the run "
                          f"folder runs/NAME-TIMESTAMP; to train somewhere else give --out FOLDER")
    if config.train.margin_relative and math.isinf(get_topology(config.model.topology).half_range(1)):
        raise ConfigError(f"train.margin_relative: {config.model.topology}'s similarity range is unbounded, so it has no "
                          f"half-width to measure the margin in; give train.margin in similarity units")
    if config.train.max_hinge_warmup_steps and config.train.loss != "max-hinge":
        raise ConfigError(f"train.max_hinge_warmup_steps is the max-hinge loss's warm-up; train.loss={config.train.loss} "
                          f"has none (set train.loss=max-hinge, or train.max_hinge_warmup_steps=0)")
    if config.model.curvature != CurvatureConfig() and not get_topology(config.model.topology).curved:
        raise ConfigError(f"model.curvature is the hyperbolic topologies' curvature; model.topology="
                          f"{config.model.topology} has none (set model.topology=lorentz or lorentz-product, or leave "
                          f"model.curvature at its defaults)")
    if config.train.entailment_weight and not get_topology(config.model.topology).curved:
        raise ConfigError(f"train.entailment_weight is MERU's entailment loss, which needs the cones of a hyperbolic "
                          f"space; model.topology={config.model.topology} has none (set model.topology=lorentz or "
                          f"lorentz-product, or train.entailment_weight=0)")
    if not get_loss(config.train.loss).bias and config.model.temperature.bias_init is not None:
        raise ConfigError(f"model.temperature.bias_init is the sigmoid loss's β; train.loss={config.train.loss} has no "
                          f"bias (set train.loss=sigmoid, or model.temperature.bias_init=null)")
