"""A topoclip model out to OpenCLIP's files: `open_clip_config.json` + `open_clip_model.safetensors`.

What `open_clip.create_model_and_transforms("local-dir:FOLDER")` (or "hf-hub:org/name" once pushed)
loads. OpenCLIP's CLIP is one class token per tower on a sphere (cosine), a pre-norm ViT, and a
causal text tower pooled at its end-of-text token: an imported OpenAI / OpenCLIP model, or one trained
here with that text layout (topology=sphere, class_tokens=1, model.text.attention=causal,
pooling=end_of_text, norm_first=true, embedding_norm=false). Anything else is refused in one line
saying what OpenCLIP cannot express. The keys are the inverse of the import's (convert.openai.RULES).

The model's own tokenizer goes with it, so `open_clip.get_tokenizer("local-dir:FOLDER")` gives topoclip's ids
for any vocabulary (a WordPiece one trained here, or OpenAI's BPE): OpenCLIP's `hf_tokenizer_name` route, which
loads `tokenizer.json` + `tokenizer_config.json` with transformers' AutoTokenizer. A model pooled at the first
token of `model.text.end_token_id` (a WordPiece [SEP]) is OpenCLIP's `pool_type="eos"`; one pooled at the
largest id (OpenAI's) its default "argmax". OpenCLIP cleans a text first (ftfy, HTML entities, whitespace):
for ordinary text the ids are topoclip's.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Union

from safetensors.torch import save_file

from topoclip.config import Config, ConfigError
from topoclip.core.geometry import get_topology
from topoclip.io.convert.architecture import rename_keys
from topoclip.model.pooling import end_of_text_id

OPENCLIP_CONFIG = "open_clip_config.json"
OPENCLIP_WEIGHTS = "open_clip_model.safetensors"
TOKENIZER_CONFIG = "tokenizer_config.json"  # transformers' AutoTokenizer: which class reads tokenizer.json
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
    if get_topology(model.topology).curved:
        return (f"OpenCLIP's CLIP scores by the cosine on one sphere; this model's embeddings are points of hyperbolic "
                f"space ({model.topology}), scored by their distance under a learned curvature")
    if model.class_tokens != 1 or model.topology != "sphere":
        return (f"OpenCLIP's CLIP has one class token per tower on one sphere; this model is {model.topology} with "
                f"{model.class_tokens} class token{'s' * (model.class_tokens != 1)}")
    # SigLIP's settings (topoclip.io.convert.siglip), none of which OpenCLIP's CLIP class has
    siglip = [f"model.{name}={json.dumps(value)}" for name, value, differs in (
        ("vision.pooling", vision.pooling, vision.pooling != "class_tokens"),
        ("vision.patch_bias", vision.patch_bias, vision.patch_bias), ("vision.pre_norm", vision.pre_norm, not vision.pre_norm),
        ("text.pooling", text.pooling, text.pooling == "last"),
        ("text.projection_bias", text.projection_bias, text.projection_bias),
        ("vision.layer_norm_eps", vision.layer_norm_eps, vision.layer_norm_eps != 1e-5),
        ("text.layer_norm_eps", text.layer_norm_eps, text.layer_norm_eps != 1e-5),
        ("vision.activation", vision.activation, vision.activation == "gelu_tanh")) if differs]
    if siglip:
        return (f"it has SigLIP's layout or part of it ({', '.join(siglip)}), which OpenCLIP builds from timm's ViT "
                f"and its own text settings, not the CLIP class topoclip exports to")
    layout = {"attention": "causal", "pooling": "end_of_text", "norm_first": True, "embedding_norm": False}
    differing = {key: getattr(text, key) for key, value in layout.items() if getattr(text, key) != value}
    if differing:
        return f"its text tower is BERT-style ({differing}); OpenCLIP's is causal, pre-norm, pooled at end-of-text"
    if not vision.norm_first:
        return "its image tower is post-norm; OpenCLIP's ViT is pre-norm"
    if vision.activation != text.activation:
        return f"its towers use {vision.activation} and {text.activation}; OpenCLIP has one quick_gelu setting"
    return ""


def tokenizer_refusal(config: Config, tokenizer) -> str:
    """Why OpenCLIP could not tokenize for this model with its tokenizer ("" when it can)."""
    if tokenizer is None:
        return ("the checkpoint has no tokenizer.json, and OpenCLIP's own BPE would give other ids than the model was "
                "trained on; export from the run folder, or convert with --vocab")
    if tokenizer.id_bound > config.model.text.vocab_size:
        return f"its tokenizer gives ids up to {tokenizer.id_bound - 1}, past the text embedding's {config.model.text.vocab_size} rows"
    if end_of_text_id(config.model.text, tokenizer.id_bound) != tokenizer.sep_id:
        return (f"the text tower pools the largest id ({tokenizer.id_bound - 1}), which is not its tokenizer's end "
                f"token ({tokenizer.sep_id}); train it with model.text.end_token_id={tokenizer.sep_id}")
    return ""


def openclip_config(config: Config, tokenizer_name: str = "") -> dict:
    """open_clip_config.json: model_cfg (OpenCLIP's CLIP arguments) and preprocess_cfg. `tokenizer_name`, the
    Hub repo id the folder goes to (or any name for a local folder), routes get_tokenizer to the folder's own
    tokenizer (OpenCLIP's hf_tokenizer_name)."""
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
    if text.end_token_id is not None:  # OpenCLIP's pooling at the first token of that id
        model_cfg["text_cfg"].update(pool_type="eos", eos_id=text.end_token_id)
    if tokenizer_name:
        model_cfg["text_cfg"]["hf_tokenizer_name"] = tokenizer_name
    if model.temperature.bias_init is not None:
        model_cfg["init_logit_bias"] = model.temperature.bias_init
    preprocess_cfg = {"mean": list(vision.mean), "std": list(vision.std), "interpolation": "bicubic",
                      "resize_mode": "shortest"}
    return {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}


def export_openclip(model, config: Config, destination: Union[str, Path], tokenizer,
                    tokenizer_name: str = "") -> Path:
    """Write OpenCLIP's files for `model` and its `tokenizer` into `destination` (new or empty): the config, the
    weights, tokenizer.json and tokenizer_config.json. `tokenizer_name`: see `openclip_config` (default: the
    folder's name). ConfigError when OpenCLIP cannot load the model or tokenize for it."""
    from topoclip.io.convert.files import new_folder

    reason = openclip_refusal(config) or tokenizer_refusal(config, tokenizer)
    if reason:
        raise ConfigError(f"OpenCLIP cannot load this model: {reason}")
    state = {key: tensor.detach().float().cpu().contiguous() for key, tensor in model.state_dict().items()}
    state = rename_keys(state, EXPORT_RULES, source="the topoclip model")
    state["visual.class_embedding"] = state["visual.class_embedding"][0]  # (1, width) -> OpenCLIP's (width,)
    name = tokenizer_name or Path(destination).resolve().name
    with new_folder(destination, "OpenCLIP's files") as folder:
        save_file(state, str(folder / OPENCLIP_WEIGHTS))
        tokenizer.save(folder)
        (folder / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer.transformers_config(), indent=2))
        (folder / OPENCLIP_CONFIG).write_text(json.dumps(openclip_config(config, name), indent=2))
    return Path(destination)

