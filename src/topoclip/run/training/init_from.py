"""Start a run from a checkpoint's weights (`topoclip train --init-from CHECKPOINT`, `train.init_from`).

The checkpoint (a topoclip checkpoint or run folder, e.g. one written by `topoclip convert`) gives
the new run its weights and its tokenizer (the text embedding is tied to its vocabulary). The run's
model must be the checkpoint's: every setting of model.vision and model.text (activation, norms,
attention, pooling, sizes, pixel statistics) and model.class_tokens / model.embed_dim must agree,
or the run is refused naming the first difference — a mismatch such as GELU against an OpenAI
checkpoint's QuickGELU would change every output silently. The topology, the sphere count and the
temperature and curvature settings and the loss are the run's choice; τ itself (temperature.t) comes with the weights,
and so do a hyperbolic checkpoint's curvature into a hyperbolic run and a sigmoid-loss checkpoint's bias into a
sigmoid-loss run (a run into hyperbolic space, or a SigLIP run from a softmax-trained CLIP, starts them fresh).
To change the number of class tokens, upcycle first: `topoclip convert SRC DST --class-tokens M`.
Without --preset the run takes the checkpoint's model and train settings; its data and evaluation
settings are never taken from the checkpoint (a folder may be anyone's, and data settings can name
a command: see config.refuse_folder_commands): they are the default preset's, or what --set gives.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Optional, Sequence, Union

from topoclip.core.curvature import CURVATURE_RANGE
from topoclip.core.distributed import launch_rank
from topoclip.core.geometry import get_topology
from topoclip.core.errors import CheckpointError
from topoclip.io.checkpoint import (TOKENIZER, check_weights_fit, first_non_finite, load_config_from, read_weights,
                                    resolve_checkpoint, stored_scalar)
from topoclip.config import DEFAULT_PRESET, Config, ConfigError, flat_dict, load_config, merge, to_dict
from topoclip.model.clip import CLIP

# Settings that may differ between the run and its starting checkpoint (see the module text).
FREE_MODEL_SETTINGS = ("topology", "spheres", "temperature", "curvature", "text.cls_token_id")
# Parts of the model a topology or a loss has or lacks: a hyperbolic run from a sphere checkpoint, or a sigmoid-loss
# run (`--siglip`) from a softmax-trained CLIP, starts them fresh at their configured init (model.curvature.init; the
# bias's −10, SigLIP's, where OpenCLIP's load_checkpoint puts a 0 that makes every pair's logit start at τ·s, far
# above 0 for a pretrained τ); the other way round the run leaves them out.
FRESH_PARTS = ("curvature.", "temperature.bias")


def starting_config(checkpoint: Union[str, Path], preset: Optional[str] = None,
                    overrides: Sequence[str] = ()) -> Config:
    """The config of a new run from `checkpoint`: `preset` (checked against the checkpoint when the run
    starts) or, without one, the checkpoint's own config; then `overrides`; train.init_from set."""
    try:
        folder = resolve_checkpoint(Path(checkpoint))
    except FileNotFoundError as error:
        raise ConfigError(f"--init-from: {error}") from None
    if preset:
        values = {}
    else:  # the model and how it was trained; never data or evaluation settings (the folder may be anyone's)
        saved = to_dict(load_config_from(folder))
        # train.report_to is left out too: "wandb" would upload, which a folder's config never turns on.
        train = {key: value for key, value in saved["train"].items() if key != "report_to"}
        values = {"name": saved["name"], "model": saved["model"], "train": train}
    # The data (and the evaluation sets) are the run's own: the default preset's, or what --set gives.
    return load_config(preset or DEFAULT_PRESET, list(overrides),
                       merge(values, {"train": {"init_from": str(checkpoint)}}))


def initial_checkpoint(config: Config) -> Path:
    """The checkpoint folder train.init_from names."""
    try:
        return resolve_checkpoint(Path(config.train.init_from))
    except FileNotFoundError as error:
        raise ConfigError(f"train.init_from: {error}") from None


def check_initial_checkpoint(config: Config) -> None:
    """Refuse a run whose model differs from its init_from checkpoint's (before anything is written)."""
    folder = initial_checkpoint(config)
    theirs = flat_dict(to_dict(load_config_from(folder).model))
    ours = flat_dict(to_dict(config.model))
    for key, value in ours.items():
        if key.startswith(FREE_MODEL_SETTINGS) or theirs.get(key) == value:
            continue
        hint = (f"upcycle it first: topoclip convert {config.train.init_from} NEW_FOLDER --class-tokens M --embed-dim N"
                if key in ("class_tokens", "embed_dim") else f"set --set model.{key}={_json(theirs.get(key))}")
        raise ConfigError(f"train.init_from={config.train.init_from}: its model.{key} is {_json(theirs.get(key))} but "
                          f"this run's is {_json(value)}; {hint} (or leave out the --preset, --set or OpenCLIP flag that "
                          f"changed it, to train the checkpoint's own config)")
    check_weights_fit(folder, config.model, FRESH_PARTS)  # from the safetensors header and a meta model
    check_initial_curvature(folder, config)


def check_initial_weights_finite(config: Config) -> None:
    """Refuse an init_from checkpoint holding a NaN or an infinity (before anything is written). No run writes one
    (the trainer's guard): it is a file from elsewhere, which training would spread. Reads every weight, so the
    trainer asks it once, not the command line's early checks."""
    damaged = first_non_finite(initial_checkpoint(config))
    if damaged is not None:
        raise CheckpointError(f"train.init_from={config.train.init_from}: its weight {damaged} holds non-finite values; "
                              f"the checkpoint is damaged, start from another")


def check_initial_curvature(folder: Path, config: Config) -> None:
    """Refuse a hyperbolic run whose checkpoint's learned c lies outside the run's clamp range [init/10, 10·init]: the
    first step would move it there silently. (A run that does not learn c keeps its own: load_initial_weights.)"""
    curvature = config.model.curvature
    log_c = stored_scalar(folder, "curvature.log_c") if get_topology(config.model.topology).curved \
        and curvature.learnable else None
    init = config.model.curvature.init
    if log_c is not None and not init / CURVATURE_RANGE <= math.exp(log_c) <= init * CURVATURE_RANGE:
        raise ConfigError(f"train.init_from={config.train.init_from}: its learned curvature c = {math.exp(log_c):.4g} "
                          f"lies outside this run's range [{init / CURVATURE_RANGE:.4g}, {init * CURVATURE_RANGE:.4g}] "
                          f"(model.curvature.init = {init:g}, and ×/÷ {CURVATURE_RANGE:g}); set "
                          f"--set model.curvature.init={math.exp(log_c):.4g} to start there")


def initial_tokenizer(config: Config) -> Path:
    """The tokenizer.json of the init_from checkpoint (the vocabulary its text embedding was trained on)."""
    folder = initial_checkpoint(config)
    if not (folder / TOKENIZER).is_file():
        raise ConfigError(f"train.init_from={config.train.init_from} has no {TOKENIZER}; give its vocabulary with "
                          f"--set data.tokenizer=FILE (or convert it again with --vocab)")
    return folder / TOKENIZER


def load_initial_weights(model: CLIP, config: Config) -> None:
    """Load the init_from checkpoint's weights into the freshly built `model` (on its device); the topology's own
    parts and the loss's (FRESH_PARTS) keep their initial values where the checkpoint has none."""
    weights = read_weights(initial_checkpoint(config), model.config, str(next(model.parameters()).device), FRESH_PARTS)
    init = config.model.curvature.init
    if "curvature.log_c" in weights and not config.model.curvature.learnable:  # the run's fixed c is its config's
        saved = math.exp(weights.pop("curvature.log_c").item())
        # 9 digits: an fp32 c exactly, so that following the note's own advice ends the note
        if not math.isclose(saved, init, rel_tol=1e-7) and launch_rank() == 0:
            print(f"topoclip: note: model.curvature.learnable=false keeps c = model.curvature.init = {init:g}, not "
                  f"train.init_from's c = {saved:.9g}; --set model.curvature.init={saved:.9g} keeps that one instead",
                  file=sys.stderr)
    bias = config.model.temperature.bias_init
    if bias is not None and "temperature.bias" not in weights and launch_rank() == 0:
        print(f"topoclip: note: train.init_from={config.train.init_from} has no sigmoid-loss bias (it was trained with "
              f"a softmax loss); the bias starts at model.temperature.bias_init = {bias:g}", file=sys.stderr)
    model.load_state_dict(weights, strict=False)  # read_weights checked every other tensor is there


def _json(value) -> str:
    import json

    return json.dumps(value) if not isinstance(value, str) else value
