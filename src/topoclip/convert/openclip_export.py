"""A topoclip model out to OpenCLIP's files: `open_clip_config.json` + `open_clip_model.safetensors`.

What `open_clip.create_model_and_transforms("local-dir:FOLDER")` (or "hf-hub:org/name" once pushed)
loads. OpenCLIP's CLIP is one class token per tower on a sphere (cosine), a pre-norm ViT, and a
causal text tower pooled at its end-of-text token (the largest id): an imported OpenAI / OpenCLIP model,
or one trained here with that text layout (topology=sphere, class_tokens=1, model.text.attention=causal,
pooling=end_of_text, norm_first=true, embedding_norm=false). Anything else is refused in one line
saying what OpenCLIP cannot express. The keys are the inverse of the import's (convert.openai.RULES).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Union

from safetensors.torch import save_file

from topoclip.config import Config, ConfigError
from topoclip.convert.architecture import rename_keys

OPENCLIP_CONFIG = "open_clip_config.json"
OPENCLIP_WEIGHTS = "open_clip_model.safetensors"
EXPORT_RULES = [
    (r"text\.transformer\.resblocks\.(.+)", r"transformer.resblocks.\1"),
    (r"text\.(token_embedding\.weight|positional_embedding|ln_final\.(?:weight|bias)|text_projection)", r"\1"),
    (r"temperature\.t", "logit_scale"),
    (r"temperature\.bias", "logit_bias"),
    (r"(visual\..+)", r"\1"),
]


def openclip_refusal(config: Config) -> str:
    """Why OpenCLIP cannot express this model ("" when it can)."""
    model, text, vision = config.model, config.model.text, config.model.vision
    if model.class_tokens != 1 or model.topology != "sphere":
        return (f"OpenCLIP's CLIP has one class token per tower on one sphere; this model is {model.topology} with "
                f"{model.class_tokens} class tokens")
    layout = {"attention": "causal", "pooling": "end_of_text", "norm_first": True, "embedding_norm": False}
    differing = {key: getattr(text, key) for key, value in layout.items() if getattr(text, key) != value}
    if differing:
        return f"its text tower is BERT-style ({differing}); OpenCLIP's is causal, pre-norm, pooled at end-of-text"
    if not vision.norm_first:
        return "its image tower is post-norm; OpenCLIP's ViT is pre-norm"
    if vision.activation != text.activation:
        return f"its towers use {vision.activation} and {text.activation}; OpenCLIP has one quick_gelu setting"
    return ""


def openclip_config(config: Config) -> dict:
    """open_clip_config.json: model_cfg (OpenCLIP's CLIP arguments) and preprocess_cfg."""
    model, vision, text = config.model, config.model.vision, config.model.text
    model_cfg = {
        "embed_dim": model.embed_dim,
        "quick_gelu": vision.activation == "quick_gelu",
        "vision_cfg": {"image_size": vision.image_size, "layers": vision.layers, "width": vision.width,
                       "patch_size": vision.patch_size, "head_width": vision.width // vision.heads,
                       "mlp_ratio": vision.mlp_ratio},
        "text_cfg": {"context_length": text.context_length, "vocab_size": text.vocab_size, "width": text.width,
                     "heads": text.heads, "layers": text.layers, "mlp_ratio": text.mlp_ratio},
    }
    if model.temperature.bias_init is not None:
        model_cfg["init_logit_bias"] = model.temperature.bias_init
    preprocess_cfg = {"mean": list(vision.mean), "std": list(vision.std), "interpolation": "bicubic",
                      "resize_mode": "shortest"}
    return {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}


def export_openclip(model, config: Config, destination: Union[str, Path]) -> Path:
    """Write OpenCLIP's two files for `model` into `destination` (new or empty); ConfigError when it cannot."""
    from topoclip.convert import check_destination

    reason = openclip_refusal(config)
    if reason:
        raise ConfigError(f"OpenCLIP cannot load this model: {reason}")
    destination = check_destination(destination)
    state = {key: tensor.detach().float().cpu().contiguous() for key, tensor in model.state_dict().items()}
    state = rename_keys(state, EXPORT_RULES, source="the topoclip model")
    state["visual.class_embedding"] = state["visual.class_embedding"][0]  # (1, width) -> OpenCLIP's (width,)
    destination.mkdir(parents=True, exist_ok=True)
    save_file(state, str(destination / OPENCLIP_WEIGHTS))
    (destination / OPENCLIP_CONFIG).write_text(json.dumps(openclip_config(config), indent=2))
    return destination

