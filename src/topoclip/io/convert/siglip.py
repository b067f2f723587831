"""transformers' SigLIP in: a `SiglipModel` folder (the layout of `google/siglip-base-patch16-224` and its kin on the
Hugging Face Hub) as a topoclip sphere model trained with the sigmoid loss.

SigLIP's towers differ from CLIP's in six places, each a setting of topoclip's towers (topoclip.config.schema):
the image tower has no class token, a bias in its patch embedding, no LayerNorm before its blocks, and pools the
patches with an attention head (a learned query, SiglipMultiheadAttentionPoolingHead: `model.vision.pooling=
attention`) and no projection after it (its image embedding is the head's output: topoclip's projection is the
identity, exact in fp32); the text tower reads the last position of the text padded to its 64 positions, padding
unmasked (`model.text.pooling=last`) through a biased linear head (`model.text.projection_bias`); every LayerNorm has
ε = 1e-6 and the MLPs use GELU's tanh form. The logit scale and bias are topoclip's t and sigmoid bias. The
tokenizer is SigLIP's SentencePiece file (`spiece.model`, topoclip.preprocess.sentencepiece); images are resized
whole to the model's size (`eval_resize=squash`) with the folder's pixel statistics.

SigLIP 2's fixed-resolution checkpoints (`google/siglip2-*-patch*-NNN`) have the same layout with Gemma's tokenizer:
a `tokenizer.json` of byte-level BPE, read as transformers' Siglip2Tokenizer reads it (lower case; the file's
framing; padded on the left unless tokenizer_config.json says otherwise; topoclip.preprocess.tokenizer.from_gemma).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence, Union

import torch

from topoclip.config import ConfigError
from topoclip.core.errors import CheckpointError
from topoclip.io.convert.hf_layout import (BLOCK_RENAMES, HF_CONFIG, PREPROCESSOR, TOKENIZER_JSON, read_config_json,
                                           foreign_field)

SPIECE = "spiece.model"  # SigLIP's SentencePiece tokenizer
TOKENIZER_CONFIG = "tokenizer_config.json"  # transformers' tokenizer settings (do_lower_case)
# transformers' activation names -> topoclip's; gelu_pytorch_tanh is SigLIP's (jax's gelu is the tanh form).
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "quick_gelu": "quick_gelu"}
# transformers' SiglipTextConfig / SiglipVisionConfig defaults, for a config.json that leaves a field out.
TEXT_DEFAULTS = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                 "num_attention_heads": 12, "max_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh",
                 "layer_norm_eps": 1e-6}
VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                   "layer_norm_eps": 1e-6}
SIGLIP_PIXELS = [0.5, 0.5, 0.5]  # SiglipImageProcessor's mean and std when the folder has no preprocessor_config.json

# transformers' names -> topoclip's; a block's q, k, v are joined apart (they become one in_proj).
RENAMES = [
    (r"vision_model\.embeddings\.patch_embedding\.(weight|bias)", r"visual.conv1.\1"),
    (r"vision_model\.embeddings\.position_embedding\.weight", "visual.positional_embedding"),
    (r"vision_model\.post_layernorm\.(weight|bias)", r"visual.ln_post.\1"),
    (r"vision_model\.head\.attention\.(in_proj_weight|in_proj_bias|out_proj\.weight|out_proj\.bias)",
     r"visual.head.attn.\1"),
    (r"vision_model\.head\.layernorm\.(weight|bias)", r"visual.head.layernorm.\1"),
    (r"vision_model\.head\.mlp\.fc1\.(weight|bias)", r"visual.head.mlp.c_fc.\1"),
    (r"vision_model\.head\.mlp\.fc2\.(weight|bias)", r"visual.head.mlp.c_proj.\1"),
    (r"text_model\.embeddings\.token_embedding\.weight", "text.token_embedding.weight"),
    (r"text_model\.embeddings\.position_embedding\.weight", "text.positional_embedding"),
    (r"text_model\.final_layer_norm\.(weight|bias)", r"text.ln_final.\1"),
    (r"text_model\.head\.bias", "text.text_projection_bias"),
]
IGNORED = ("position_ids",)  # buffers some versions save


def _expect(name: str, tensor: torch.Tensor, shape: tuple) -> torch.Tensor:
    """`tensor` when its shape is `shape`; CheckpointError naming both otherwise (checked before it is reshaped)."""
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"{name} is {tuple(tensor.shape)}, but the folder's config.json makes it {shape}; the "
                              f"weights do not fit their config")
    return tensor


def to_topoclip(state: dict[str, torch.Tensor], vision_width: int, text_width: int,
                embed_dim: int) -> dict[str, torch.Tensor]:
    """A SiglipModel state dict in topoclip's names and shapes (q, k, v joined, the text head transposed, the
    probe (1, 1, w) made (1, w), the logit scale and bias 0-d, the image projection the identity). Every tensor that
    is reshaped or joined is first held to the shape config.json gives it; the rest are held to the model's by its
    strict load (topoclip.io.convert.architecture.build_imported)."""
    widths = {"vision": vision_width, "text": text_width}
    out, pending = {}, {}
    for name, tensor in state.items():
        if name.endswith(IGNORED):
            continue
        block = re.fullmatch(r"(vision|text)_model\.encoder\.layers\.(\d+)\.(.+)", name)
        if block:
            prefix = f"{'visual' if block.group(1) == 'vision' else 'text'}.transformer.resblocks.{block.group(2)}"
            attention = re.fullmatch(r"self_attn\.([qkv])_proj\.(weight|bias)", block.group(3))
            if attention:
                width = widths[block.group(1)]
                shape = (width, width) if attention.group(2) == "weight" else (width,)
                pending.setdefault((prefix, attention.group(2)), {})[attention.group(1)] = _expect(name, tensor, shape)
                continue
            rest = block.group(3)
            for old, new in BLOCK_RENAMES.items():
                if rest.startswith(f"{old}."):
                    rest = new + rest[len(old):]
            if not re.fullmatch(r"(attn\.out_proj|ln_1|ln_2|mlp\.c_fc|mlp\.c_proj)\.(weight|bias)", rest):
                raise CheckpointError(f"{name} is not a weight of transformers' SiglipModel")
            out[f"{prefix}.{rest}"] = tensor
        elif name == "vision_model.head.probe":
            out["visual.head.probe"] = _expect(name, tensor, (1, 1, vision_width))[0]  # (1, 1, w) -> (1, w)
        elif name == "text_model.head.weight":
            out["text.text_projection"] = _expect(name, tensor, (embed_dim, text_width)).t().contiguous()  # (w, embed)
        elif name in ("logit_scale", "logit_bias"):
            out["temperature.t" if name == "logit_scale" else "temperature.bias"] = _expect(name, tensor, (1,))[0]
        else:
            for pattern, replacement in RENAMES:
                if re.fullmatch(pattern, name):
                    out[re.sub(pattern, replacement, name)] = tensor
                    break
            else:
                raise CheckpointError(f"{name} is not a weight of transformers' SiglipModel ({len(state)} tensors "
                                      f"read)")
    for (prefix, kind), parts in pending.items():
        if set(parts) != {"q", "k", "v"}:
            raise CheckpointError(f"{prefix}: {sorted(parts)} of q, k, v ({kind}); not transformers' SiglipModel")
        out[f"{prefix}.attn.in_proj_{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])  # (3·width, …)
    # SigLIP's image embedding is the head's output: x @ I = x exactly. The identity is made only beside a block's
    # (width, width) q, k, v the file holds: never more memory than the file's own weights.
    if ("visual.transformer.resblocks.0", "weight") in pending:
        out["visual.proj"] = torch.eye(vision_width)
    return out


def _tower(settings: dict, defaults: dict, where: str) -> tuple[dict, dict]:
    """(topoclip's tower settings, the fields read) from a tower's transformers config (defaults where a field is
    absent)."""
    read = {key: foreign_field(settings, key, str if key == "hidden_act" else (float, int) if key == "layer_norm_eps"
                               else int, default, where) for key, default in defaults.items()}
    if read["hidden_act"] not in ACTIVATIONS:
        raise ConfigError(f"{where}.hidden_act is {read['hidden_act']!r}; topoclip imports "
                          f"{', '.join(ACTIVATIONS)}")
    width, hidden = read["hidden_size"], read["intermediate_size"]
    ratio = hidden / width
    if int(width * ratio) != hidden:  # e.g. 4304 / 1152 (SO400M) rounds down when multiplied back
        ratio = (hidden + 0.5) / width
    return {"width": width, "layers": read["num_hidden_layers"], "heads": read["num_attention_heads"],
            "mlp_ratio": ratio, "activation": ACTIVATIONS[read["hidden_act"]],
            "layer_norm_eps": float(read["layer_norm_eps"]), "norm_first": True}, read


def import_siglip(folder: Union[str, Path], overrides: Sequence[str] = (), name: str = ""):
    """(model, tokenizer, config) from a transformers SiglipModel folder."""
    from topoclip.io.convert.architecture import build_imported, temperature_values
    from topoclip.io.convert.files import read_state_dict

    folder = Path(folder)
    file = folder / HF_CONFIG
    values = read_config_json(file)
    text_settings = foreign_field(values, "text_config", dict, {}, str(file)) or {}
    vision_settings = foreign_field(values, "vision_config", dict, {}, str(file)) or {}
    text, read_text = _tower(text_settings, TEXT_DEFAULTS, f"{file}: text_config")
    vision, read_vision = _tower(vision_settings, VISION_DEFAULTS, f"{file}: vision_config")
    if not foreign_field(vision_settings, "vision_use_head", bool, True, f"{file}: vision_config"):
        raise ConfigError(f"{file}: vision_config.vision_use_head is false: the image tower has no pooled output "
                          f"(a SigLIP vision backbone alone); topoclip imports the whole SiglipModel")
    if read_vision["num_channels"] != 3:
        raise ConfigError(f"{file}: vision_config.num_channels is {read_vision['num_channels']}; topoclip's image "
                          f"tower takes RGB (3)")
    embed_dim = foreign_field(text_settings, "projection_size", int, text["width"], f"{file}: text_config")
    if embed_dim != vision["width"]:
        raise CheckpointError(f"{file}: the text head gives {embed_dim} dimensions but the image tower {vision['width']}; "
                              f"SigLIP's embeddings must match")
    state = to_topoclip(read_state_dict(folder), vision["width"], text["width"], embed_dim)
    mean, std = SIGLIP_PIXELS, SIGLIP_PIXELS
    if (folder / PREPROCESSOR).exists():
        pixels = read_config_json(folder / PREPROCESSOR)
        mean = foreign_field(pixels, "image_mean", list, mean, str(folder / PREPROCESSOR))
        std = foreign_field(pixels, "image_std", list, std, str(folder / PREPROCESSOR))
    model = {
        "vision": {**vision, "image_size": read_vision["image_size"], "patch_size": read_vision["patch_size"],
                   "pooling": "attention", "patch_bias": True, "pre_norm": False, "mean": mean, "std": std,
                   "eval_resize": "squash"},
        # cls_token_id: unread by pooling=last (it must only name a token of the vocabulary)
        "text": {**text, "vocab_size": read_text["vocab_size"], "context_length": read_text["max_position_embeddings"],
                 "embedding_norm": False, "attention": "bidirectional", "pooling": "last", "projection_bias": True,
                 "cls_token_id": 0},
        "class_tokens": 1, "embed_dim": embed_dim, "topology": "sphere",
    }
    if "temperature.t" not in state or "temperature.bias" not in state:
        raise CheckpointError(f"{folder}: no logit_scale and logit_bias; not transformers' SiglipModel")
    model["temperature"] = temperature_values(float(state["temperature.t"]), float(state["temperature.bias"]))
    model_out, config = build_imported(state, model, overrides, name or folder.name)
    if config.model.text.pooling != "last":  # its tokenizer frames a text without the start token others read
        raise ConfigError(f"model.text.pooling={config.model.text.pooling}: SigLIP's tokenizer frames a text as "
                          f"`pieces… </s>` padded with </s>, which its tower reads at the last position; a SigLIP model "
                          f"keeps model.text.pooling=last")
    tokenizer = siglip_tokenizer(folder, config.model.text.context_length)
    if tokenizer.id_bound > config.model.text.vocab_size:
        raise CheckpointError(f"{folder}: its tokenizer gives ids up to {tokenizer.id_bound - 1}, past the text embedding's "
                              f"{config.model.text.vocab_size} rows: not this model's tokenizer")
    return model_out, tokenizer, config


def siglip_tokenizer(folder: Path, context_length: int):
    """The folder's tokenizer: SigLIP's spiece.model (lower-cased unless tokenizer_config.json says do_lower_case
    false), else SigLIP 2's Gemma tokenizer.json (padded as tokenizer_config.json says); CheckpointError naming the
    file when there is none topoclip reads."""
    from topoclip.preprocess.tokenizer import PADDING_SIDES, Tokenizer

    settings = read_config_json(folder / TOKENIZER_CONFIG) if (folder / TOKENIZER_CONFIG).exists() else {}
    where = str(folder / TOKENIZER_CONFIG)
    try:
        if (folder / SPIECE).exists():
            lowercase = foreign_field(settings, "do_lower_case", bool, True, where)
            return Tokenizer.from_sentencepiece(folder / SPIECE, context_length=context_length, lowercase=lowercase,
                                                root=folder)
        if (folder / TOKENIZER_JSON).exists():  # SigLIP 2: transformers pads on the left unless the file says not
            side = foreign_field(settings, "padding_side", str, "left", where) if "padding_side" in settings else None
            if side not in (None, *PADDING_SIDES):
                raise CheckpointError(f"{where}: padding_side {side!r}; transformers pads on the left or the right")
            if foreign_field(settings, "truncation_side", str, "right", where) != "right":
                raise CheckpointError(f"{where}: truncation_side {settings['truncation_side']!r}; topoclip cuts the end "
                                      f"of a long text, as SigLIP 2 was trained (truncation_side right)")
            pad = settings.get("pad_token", "<pad>")  # (Siglip2Tokenizer's)
            pad = pad.get("content") if isinstance(pad, dict) else pad  # (transformers may save an AddedToken's fields)
            if not isinstance(pad, str) or not pad:
                raise CheckpointError(f"{where}: pad_token is {json.dumps(pad)[:60]}; SigLIP 2 pads with a token of its "
                                      f"vocabulary (<pad>)")
            return Tokenizer.from_gemma(folder / TOKENIZER_JSON, context_length=context_length, padding_side=side,
                                        pad_token=pad, root=folder, added_tokens=settings.get("added_tokens_decoder"))
    except ValueError as error:  # (its messages name the file)
        raise CheckpointError(str(error)) from None
    raise CheckpointError(f"{folder}: no tokenizer: neither {SPIECE} (SigLIP's SentencePiece tokenizer) nor "
                          f"{TOKENIZER_JSON} (SigLIP 2's Gemma tokenizer); give the folder its tokenizer's file")
