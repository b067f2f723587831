"""transformers' CLIP both ways: a `CLIPModel` folder (the layout of `openai/clip-vit-base-patch32` and of most CLIPs on
the Hugging Face Hub) in, and a sphere model out as one.

The folder: `config.json` (`"architectures": ["CLIPModel"]`, `text_config`, `vision_config`), `model.safetensors` (or
`pytorch_model.bin`, read without unpickling), the tokenizer (`merges.txt` + `vocab.json`, OpenAI's BPE, or a
`tokenizer.json` topoclip wrote) and `preprocessor_config.json` (pixel statistics). Its weights are OpenAI's
under other names — the attention's q, k, v apart rather than one `in_proj`, the projections transposed — so the
import renames them into OpenAI's layout and reads that as `convert --from openai` does; the export is the
inverse. The text tower pools as transformers' does: at the largest id where `eos_token_id` is 2 (the configs
written before transformers#24773, OpenAI's own among them), else at the first token of `eos_token_id`
(topoclip's `model.text.end_token_id`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from safetensors.torch import save_file

from topoclip.config import Config, ConfigError
from topoclip.core.errors import CheckpointError
from topoclip.io.convert.hf_layout import (BLOCK_RENAMES, HF_CONFIG, MERGES, PREPROCESSOR, TOKENIZER_JSON, read_config_json,
                                           foreign_field, hf_model_type)

LEGACY_EOS = 2  # transformers' CLIPTextTransformer pools at argmax(ids) for this eos_token_id
TRANSFORMERS_EOS = 49407  # CLIPTextConfig's default eos_token_id (OpenAI's <|endoftext|>)
LAYER_NORM_EPSILON = 1e-5  # OpenAI's, and topoclip's towers'

# transformers' names -> OpenAI's (the layout convert.openai reads); q, k, v and the projections are handled apart.
RENAMES = [
    (r"vision_model\.embeddings\.class_embedding", "visual.class_embedding"),
    (r"vision_model\.embeddings\.patch_embedding\.weight", "visual.conv1.weight"),
    (r"vision_model\.embeddings\.position_embedding\.weight", "visual.positional_embedding"),
    (r"vision_model\.pre_layrnorm\.(weight|bias)", r"visual.ln_pre.\1"),
    (r"vision_model\.post_layernorm\.(weight|bias)", r"visual.ln_post.\1"),
    (r"vision_model\.encoder\.layers\.(\d+)\.(.+)", r"visual.transformer.resblocks.\1.\2"),
    (r"text_model\.embeddings\.token_embedding\.weight", "token_embedding.weight"),
    (r"text_model\.embeddings\.position_embedding\.weight", "positional_embedding"),
    (r"text_model\.final_layer_norm\.(weight|bias)", r"ln_final.\1"),
    (r"text_model\.encoder\.layers\.(\d+)\.(.+)", r"transformer.resblocks.\1.\2"),
    (r"logit_scale", "logit_scale"),
]
IGNORED = ("position_ids",)  # buffers some versions save


def to_openai(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CLIPModel state dict in OpenAI's names and shapes (q, k, v joined into in_proj, projections transposed)."""
    out, pending = {}, {}
    for name, tensor in state.items():
        if name.endswith(IGNORED):
            continue
        if name in ("visual_projection.weight", "text_projection.weight"):
            out["visual.proj" if name.startswith("visual") else "text_projection"] = tensor.t().contiguous()
            continue
        attention = re.match(r"(.+)\.self_attn\.([qkv])_proj\.(weight|bias)$", name)
        if attention:
            pending.setdefault((attention.group(1), attention.group(3)), {})[attention.group(2)] = tensor
            continue
        for pattern, replacement in RENAMES:
            if re.fullmatch(pattern, name):
                renamed = re.sub(pattern, replacement, name)
                for old, new in BLOCK_RENAMES.items():
                    renamed = renamed.replace(f".{old}.", f".{new}.")
                out[renamed] = tensor
                break
        else:
            raise CheckpointError(f"{name} is not a weight of transformers' CLIPModel ({len(state)} tensors read)")
    for (block, kind), parts in pending.items():
        tower = re.fullmatch(r"(vision|text)_model\.encoder\.layers\.(\d+)", block)
        if set(parts) != {"q", "k", "v"} or not tower:
            raise CheckpointError(f"{block}.self_attn: {sorted(parts)} of q, k, v ({kind}); not transformers' CLIPModel")
        prefix = ("visual." if tower.group(1) == "vision" else "") + f"transformer.resblocks.{tower.group(2)}"
        out[f"{prefix}.attn.in_proj_{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])  # (3·width, …)
    return out


def from_openai(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `to_openai`: OpenAI's names and shapes -> transformers' CLIPModel."""
    inverse = {new: old for old, new in BLOCK_RENAMES.items()}
    out = {}
    for name, tensor in state.items():
        if name in ("visual.proj", "text_projection"):
            out["visual_projection.weight" if name == "visual.proj" else "text_projection.weight"] = tensor.t().contiguous()
            continue
        block = re.match(r"(visual\.)?transformer\.resblocks\.(\d+)\.(.+)$", name)
        if block:
            tower = "vision_model" if block.group(1) else "text_model"
            prefix, rest = f"{tower}.encoder.layers.{block.group(2)}", block.group(3)
            joined = re.fullmatch(r"attn\.in_proj_(weight|bias)", rest)
            if joined:
                for letter, part in zip("qkv", tensor.chunk(3)):
                    out[f"{prefix}.self_attn.{letter}_proj.{joined.group(1)}"] = part.contiguous()
                continue
            for new, old in inverse.items():
                rest = rest.replace(f"{new}.", f"{old}.") if rest.startswith(f"{new}.") else rest
            out[f"{prefix}.{rest}"] = tensor
            continue
        simple = {"visual.class_embedding": "vision_model.embeddings.class_embedding",
                  "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
                  "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
                  "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
                  "positional_embedding": "text_model.embeddings.position_embedding.weight",
                  "logit_scale": "logit_scale"}
        layer_norm = re.fullmatch(r"(visual\.ln_pre|visual\.ln_post|ln_final)\.(weight|bias)", name)
        if layer_norm:
            where = {"visual.ln_pre": "vision_model.pre_layrnorm", "visual.ln_post": "vision_model.post_layernorm",
                     "ln_final": "text_model.final_layer_norm"}[layer_norm.group(1)]
            out[f"{where}.{layer_norm.group(2)}"] = tensor
        elif name in simple:
            out[simple[name]] = tensor
        else:
            raise CheckpointError(f"{name}: transformers' CLIPModel has no place for it")
    return out


def import_hf(folder: Union[str, Path], overrides: Sequence[str] = (), name: str = ""):
    """(model, tokenizer or None, config) from a transformers CLIPModel (or SiglipModel: topoclip.io.convert.siglip)
    folder."""
    from topoclip.io.convert.files import read_state_dict
    from topoclip.io.convert.openai import bpe_tokenizer, import_openai
    from topoclip.preprocess.tokenizer import Tokenizer

    folder = Path(folder)
    kind = hf_model_type(folder)
    if kind is None:
        raise ConfigError(f"{folder} is not a transformers CLIPModel or SiglipModel folder (its {HF_CONFIG} names "
                          f"neither)")
    if kind == "siglip":
        from topoclip.io.convert.siglip import import_siglip

        return import_siglip(folder, overrides, name)
    file = folder / HF_CONFIG
    values = read_config_json(file)
    text = foreign_field(values, "text_config", dict, {}, str(file)) or {}
    vision = foreign_field(values, "vision_config", dict, {}, str(file)) or {}
    activations = {foreign_field(text, "hidden_act", str, "quick_gelu", f"{file}: text_config"),
                   foreign_field(vision, "hidden_act", str, "quick_gelu", f"{file}: vision_config")}
    if len(activations) != 1 or not activations <= {"quick_gelu", "gelu"}:
        raise ConfigError(f"{folder / HF_CONFIG}: hidden_act {sorted(activations)}; topoclip imports one of quick_gelu "
                          f"and gelu for both towers")
    for tower, settings in (("text", text), ("vision", vision)):
        if foreign_field(settings, "layer_norm_eps", (int, float), LAYER_NORM_EPSILON, f"{file}: {tower}_config") \
                != LAYER_NORM_EPSILON:
            raise ConfigError(f"{folder / HF_CONFIG}: {tower}_config.layer_norm_eps is {settings['layer_norm_eps']}; "
                              f"topoclip's towers use {LAYER_NORM_EPSILON} (OpenAI's)")
    settings = [f"model.text.heads={foreign_field(text, 'num_attention_heads', int, 8, f'{file}: text_config')}",
                f"model.vision.heads={foreign_field(vision, 'num_attention_heads', int, 12, f'{file}: vision_config')}"]
    # past a multiple of the patch size the weights cannot say the image size (import_openai holds it to their grid)
    size = foreign_field(vision, "image_size", int, None, f"{file}: vision_config") if "image_size" in vision else None
    eos = text.get("eos_token_id", TRANSFORMERS_EOS)  # a config without it takes transformers' default
    if not isinstance(eos, int) or isinstance(eos, bool) or eos < 0:
        raise ConfigError(f"{folder / HF_CONFIG}: text_config.eos_token_id must be a token id, not {eos!r:.40}")
    if eos != LEGACY_EOS:
        settings.append(f"model.text.end_token_id={eos}")
    preprocessor = folder / PREPROCESSOR
    if preprocessor.exists():
        pixels = read_config_json(preprocessor)
        for key, setting in (("image_mean", "mean"), ("image_std", "std")):
            if key in pixels:
                value = foreign_field(pixels, key, list, None, str(preprocessor))
                settings.append(f"model.vision.{setting}={json.dumps(value)}")
    state = to_openai(read_state_dict(folder))
    model, _, config = import_openai(state, "openclip", activation=activations.pop(),
                                     overrides=[*settings, *overrides], name=name or folder.name, image_size=size)
    context, vocab_size = config.model.text.context_length, config.model.text.vocab_size
    tokenizer = None
    try:
        if (folder / MERGES).exists():
            tokenizer = bpe_tokenizer(folder / MERGES, vocab_size, context)
        elif (folder / TOKENIZER_JSON).exists():
            tokenizer = Tokenizer.load(folder / TOKENIZER_JSON, context_length=context)
    except ValueError as error:
        if not (folder / MERGES).exists():  # transformers' own tokenizer.json: topoclip reads OpenAI's BPE from merges
            raise CheckpointError(f"{folder}: no {MERGES} (OpenAI's BPE, which topoclip reads), and its "
                                  f"{TOKENIZER_JSON} is not one topoclip wrote ({str(error)[:120]}); give the folder "
                                  f"its {MERGES}") from None
        raise CheckpointError(f"{folder}: its tokenizer cannot be read ({error})") from None
    return model, tokenizer, config


def hf_config(config: Config, tokenizer) -> dict:
    """config.json of transformers' CLIPModel for a topoclip model OpenCLIP's layout can hold."""
    model, vision, text = config.model, config.model.vision, config.model.text
    activation = vision.activation
    eos = text.end_token_id if text.end_token_id is not None else LEGACY_EOS
    return {
        "architectures": ["CLIPModel"], "model_type": "clip", "projection_dim": model.embed_dim,
        "logit_scale_init_value": model.temperature.init,
        "text_config": {"vocab_size": text.vocab_size, "hidden_size": text.width,
                        "intermediate_size": round(text.width * text.mlp_ratio), "num_hidden_layers": text.layers,
                        "num_attention_heads": text.heads, "max_position_embeddings": text.context_length,
                        "hidden_act": activation, "layer_norm_eps": LAYER_NORM_EPSILON, "projection_dim": model.embed_dim,
                        "eos_token_id": eos, "bos_token_id": tokenizer.cls_id, "pad_token_id": tokenizer.pad_id},
        "vision_config": {"hidden_size": vision.width, "intermediate_size": round(vision.width * vision.mlp_ratio),
                          "num_hidden_layers": vision.layers, "num_attention_heads": vision.heads,
                          "image_size": vision.image_size, "patch_size": vision.patch_size, "hidden_act": activation,
                          "layer_norm_eps": LAYER_NORM_EPSILON, "projection_dim": model.embed_dim},
    }


def hf_refusal(config: Config, tokenizer) -> Optional[str]:
    """Why transformers' CLIPModel cannot hold the model (the same rules as OpenCLIP's, and two of its own), or None."""
    from topoclip.io.convert.openclip_export import openclip_refusal, tokenizer_refusal

    reason = openclip_refusal(config) or tokenizer_refusal(config, tokenizer)
    if reason:
        return f"transformers' CLIPModel cannot hold this model: {reason}"
    if config.model.temperature.bias_init is not None:
        return "transformers' CLIPModel has no logit bias: this model is trained with the sigmoid loss's"
    if config.model.text.end_token_id == LEGACY_EOS:
        return (f"transformers reads eos_token_id {LEGACY_EOS} as 'pool at the largest id' (its configs before "
                f"transformers#24773), but this model pools at the first token of id {LEGACY_EOS}: its vocabulary "
                f"would need another end-token id")
    return None


def tokenizer_classes(tokenizer) -> str:
    """Which of transformers' tokenizer classes give the exported model its own ids, for the line `export --hf` prints.

    transformers 5's CLIPTokenizer (and CLIPTokenizerFast, its alias) rebuilds OpenAI's BPE from the vocabulary
    of tokenizer.json with no questions asked: on a WordPiece vocabulary it has no merges, so every caption becomes
    character ids, and a caption longer than the context then fails inside the model. The classes that read
    tokenizer.json as written (AutoTokenizer, AutoProcessor and CLIPProcessor, which take tokenizer_config.json's
    class; PreTrainedTokenizerFast) give topoclip's ids for either vocabulary (tests/convert/test_convert_hf.py)."""
    if tokenizer.is_wordpiece:
        return ("AutoTokenizer.from_pretrained(...) or AutoProcessor / CLIPProcessor (its WordPiece vocabulary is "
                "not CLIPTokenizer's: that class would read it as BPE without merges, one id a character)")
    return "AutoTokenizer.from_pretrained(...), AutoProcessor / CLIPProcessor or CLIPTokenizer"


def export_hf(model, config: Config, destination: Union[str, Path], tokenizer) -> Path:
    """Write `model` and its `tokenizer` as transformers' CLIPModel into `destination` (new or empty): config.json,
    model.safetensors, tokenizer.json + tokenizer_config.json, preprocessor_config.json. ConfigError when
    transformers' CLIP cannot hold the model (the same rules as OpenCLIP's)."""
    from topoclip.io.convert.architecture import rename_keys
    from topoclip.io.convert.files import new_folder
    from topoclip.io.convert.openclip_export import EXPORT_RULES

    refusal = hf_refusal(config, tokenizer)
    if refusal:
        raise ConfigError(refusal)
    state = {key: tensor.detach().float().cpu().contiguous() for key, tensor in model.state_dict().items()}
    state = rename_keys(state, EXPORT_RULES, source="the topoclip model")  # OpenAI's names, as OpenCLIP's export
    state["visual.class_embedding"] = state["visual.class_embedding"][0]  # (1, width) -> (width,)
    with new_folder(destination, "transformers' CLIPModel") as folder:
        save_file(from_openai(state), str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / HF_CONFIG).write_text(json.dumps(hf_config(config, tokenizer), indent=2))
        tokenizer.save(folder)
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer.transformers_config(), indent=2))
        vision = config.model.vision
        (folder / PREPROCESSOR).write_text(json.dumps({
            "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": vision.image_size},
            "resample": 3, "do_center_crop": True, "crop_size": {"height": vision.image_size, "width": vision.image_size},
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(vision.mean),
            "image_std": list(vision.std), "do_convert_rgb": True}, indent=2))
    return Path(destination)
