"""A topoclip model from weights already renamed to topoclip's keys: read the sizes off the tensors.

Shapes give everything but the number of attention heads, which no tensor stores: it defaults to
width / 64 (OpenAI's, OpenCLIP's and the authors' convention for every ViT-B/L and text tower),
and ``--set model.vision.heads=…`` (``model.text.heads``) overrides it. The activation and the
text tower's layout come from the caller, which knows the source format.
"""
from __future__ import annotations

import math
import re
from typing import Optional, Sequence

import torch

from topoclip.config import Config, apply_overrides, from_dict, validate
from topoclip.core.errors import CheckpointError
from topoclip.core.geometry import implied_topology
from topoclip.model.clip import CLIP

HEAD_WIDTH = 64  # width per attention head in every released CLIP
FORMAT_HINT = "; is --from the right format?"  # rename_keys' fix, which a caller that chose the format itself drops


def rename_keys(state: dict[str, torch.Tensor], rules: Sequence[tuple[str, str]], ignored: Sequence[str] = (),
                source: str = "the checkpoint") -> dict[str, torch.Tensor]:
    """{foreign key: tensor} -> {topoclip key: tensor}.

    Each key is renamed by the first rule (regex, replacement) whose regex matches the whole key;
    keys in `ignored` are dropped; any other key is refused (it would be silently lost).
    """
    renamed, unknown = {}, []
    for key, tensor in state.items():
        if key in ignored:
            continue
        for pattern, replacement in rules:
            match = re.fullmatch(pattern, key)
            if match:
                renamed[match.expand(replacement)] = tensor
                break
        else:
            unknown.append(key)
    if unknown:
        raise CheckpointError(f"{source} has tensors this format does not have: {', '.join(unknown[:8])}"
                              + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
                              + FORMAT_HINT)
    return renamed


def count_blocks(state: dict[str, torch.Tensor], prefix: str) -> int:
    """Number of residual blocks `prefix`.{i}.* in `state`."""
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    indices = {int(match.group(1)) for key in state if (match := pattern.match(key))}
    if indices != set(range(len(indices))):
        raise CheckpointError(f"blocks {prefix}.* are not numbered 0 … {len(indices) - 1}: {sorted(indices)}")
    return len(indices)


def _tower(state: dict, prefix: str, width: int, activation: str) -> dict:
    """layers, heads, mlp_ratio, activation of the transformer under `prefix`."""
    layers = count_blocks(state, f"{prefix}.transformer.resblocks")
    if not layers:
        raise CheckpointError(f"no {prefix}.transformer.resblocks.* weights: not a ViT CLIP checkpoint")
    hidden = state[f"{prefix}.transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
    ratio = hidden / width
    if int(width * ratio) != hidden:  # e.g. 8192 / 1664 (ViT-bigG) rounds down to 8191 when multiplied back
        ratio = (hidden + 0.5) / width
    return {"width": width, "layers": layers, "heads": max(1, width // HEAD_WIDTH), "mlp_ratio": ratio,
            "activation": activation}


def model_values(state: dict[str, torch.Tensor], activation: str, text_layout: dict) -> dict:
    """The `model` section of a config (a dict) that fits `state` (topoclip key names).

    text_layout: the text tower's non-shape settings (norm_first, embedding_norm, attention,
    pooling, cls_token_id).
    """
    try:
        conv = state["visual.conv1.weight"]  # (width, 3, p, p)
        class_tokens = state["visual.class_embedding"].shape[0]  # (m, width)
        positions = state["visual.positional_embedding"].shape[0]  # grid² + m
        vocab_size, text_width = state["text.token_embedding.weight"].shape
        text_positions = state["text.positional_embedding"].shape[0]  # context + m − 1
        embed_dim = state["visual.proj"].shape[1]
        text_embed_dim = state["text.text_projection"].shape[1]
    except KeyError as error:
        raise CheckpointError(f"the checkpoint has no {error.args[0]} tensor (under its own name): not a ViT CLIP "
                              f"in the expected layout") from None
    grid = math.isqrt(positions - class_tokens)
    if grid * grid != positions - class_tokens:
        raise CheckpointError(f"visual.positional_embedding has {positions} rows: not a square grid plus "
                              f"{class_tokens} class token(s)")
    if embed_dim != text_embed_dim:
        raise CheckpointError(f"the image projection gives {embed_dim} dimensions but the text projection "
                              f"{text_embed_dim}; they must match")
    width, patch = conv.shape[0], conv.shape[-1]
    vision = {"image_size": grid * patch, "patch_size": patch, **_tower(state, "visual", width, activation)}
    text = {"vocab_size": vocab_size, "context_length": text_positions - class_tokens + 1,
            **_tower(state, "text", text_width, activation), **text_layout}
    values = {"vision": vision, "text": text, "class_tokens": class_tokens, "embed_dim": embed_dim,
              "topology": implied_topology(class_tokens)}
    if "temperature.t" in state:
        bias = state.get("temperature.bias")
        values["temperature"] = temperature_values(float(state["temperature.t"]), None if bias is None else float(bias))
    return values


# The largest |t| a checkpoint's logit scale τ = e^t may have: e^t must stay a finite fp32 number (fp32 overflows past
# e^88.7). Trained models sit near 4.6 (τ = 100, CLIP's clamp).
MAX_LOG_SCALE = 80.0


def temperature_values(t: float, bias: Optional[float] = None) -> dict:
    """The `temperature` section for a checkpoint's log scale `t` (and SigLIP's bias); CheckpointError when either is
    not a finite number a model can hold."""
    if not (math.isfinite(t) and abs(t) <= MAX_LOG_SCALE) or (bias is not None and not math.isfinite(bias)):
        raise CheckpointError(f"the checkpoint's logit scale is e^{t:.4g}" + (f" and its bias {bias:.4g}" if bias is not None
                              else "") + f"; a model holds |t| ≤ {MAX_LOG_SCALE:g} and a finite bias: not a trained model")
    values = {"init": t, "max_scale": max(100.0, math.exp(t))}
    if bias is not None:
        values["bias_init"] = bias
    return values


def set_image_size(values: dict, size, where: str) -> None:
    """Take the image size a foreign config gives (`size`: a whole number, else ignored as absent) over the one read
    off the weights (patches × patch size): a size past a multiple of the patch leaves pixels unread, which no tensor
    stores. CheckpointError when it does not make the weights' grid of patches."""
    if not isinstance(size, int) or isinstance(size, bool):
        return
    vision = values["vision"]
    if size // vision["patch_size"] != vision["image_size"] // vision["patch_size"]:
        raise CheckpointError(f"{where} gives image_size {size}, but the weights hold a grid of "
                              f"{vision['image_size'] // vision['patch_size']} patches of {vision['patch_size']} px: the "
                              f"file belongs to other weights")
    vision["image_size"] = size


def build_imported(state: dict[str, torch.Tensor], values: dict, overrides: Sequence[str] = (),
                   name: str = "imported") -> tuple[CLIP, Config]:
    """(model with `state` loaded strictly, its Config) from the inferred `model` values plus overrides."""
    config_values = {"model": values, "name": name}
    if "bias_init" in values.get("temperature", {}):
        config_values["train"] = {"loss": "sigmoid"}  # a SigLIP checkpoint's bias belongs to the sigmoid loss
    config = from_dict(Config, apply_overrides(config_values, list(overrides)))
    validate(config)
    with torch.device("meta"):  # no random init of weights that are replaced right away
        model = CLIP(config.model)
    if "temperature.t" not in state:  # some exports drop the scale; keep the config's
        state = {**state, "temperature.t": torch.tensor(config.model.temperature.init)}
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as error:
        detail = " ".join(str(error).split())
        raise CheckpointError(f"the weights do not fit the model read off them ({detail[:400]}); if a size is "
                              f"not stored in the weights (attention heads), set it with --set") from None
    return model.float(), config
