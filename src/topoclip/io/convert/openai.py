"""Import OpenAI CLIP and OpenCLIP ViT checkpoints, and build their byte-level BPE tokenizer.

Their layout: the image tower has topoclip's keys with one class token
(``visual.class_embedding`` of shape (width,), reshaped to (1, width)); the text tower is
``token_embedding``, ``positional_embedding``, pre-norm ``transformer.resblocks.*`` with a causal
mask, ``ln_final``, ``text_projection``, pooled at the end-of-text token (``argmax`` of the ids);
``logit_scale`` (and SigLIP-style ``logit_bias``). In topoclip that is the text config
``attention="causal"``, ``pooling="end_of_text"``, ``norm_first=true``, ``embedding_norm=false``.

Activation: OpenAI's weights were trained with QuickGELU. OpenCLIP's were trained with either
(``ViT-B-16`` with GELU, ``ViT-B-16-quickgelu`` and OpenAI's own with QuickGELU), and the weights
do not say which: it is read from ``open_clip_config.json`` next to the weights, or must be given.
The wrong one changes every output, so a mismatch is refused, never warned about.

Tokenizer: OpenAI's ``bpe_simple_vocab_16e6.txt.gz`` (a header line, then one merge "a b" per
line) gives the vocabulary: the 256 byte characters, the same with "</w>", the first
vocab_size − 514 merges, then ``<|startoftext|>`` and ``<|endoftext|>`` (the largest id). It is
built with the `tokenizers` library like Hugging Face's CLIP tokenizer: NFC, whitespace runs to
one space, lower case, OpenAI's split pattern, byte-level BPE. Unlike OpenAI's code it does not
HTML-unescape or ftfy-fix the text, and "<|endoftext|>" typed in a caption is ordinary text.
"""
from __future__ import annotations

import gzip
from pathlib import Path
from typing import Optional, Sequence, Union

from tokenizers import Regex
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from topoclip.config import Config, ConfigError
from topoclip.io.convert.architecture import build_imported, model_values, rename_keys, set_image_size
from topoclip.io.convert.files import read_state_dict, source_name, weights_file
from topoclip.core.door import check_inside, open_regular, read_json
from topoclip.core.errors import CheckpointError
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import OPENAI_END, OPENAI_SPLIT_PATTERN, OPENAI_START, SAVED_FILE_NAME, Tokenizer

FORMATS = ("openai", "openclip")
ACTIVATIONS = ("gelu", "quick_gelu")
OPENCLIP_CONFIG = "open_clip_config.json"  # written next to the weights on the Hugging Face Hub

RULES = [
    (r"visual\.(.+)", r"visual.\1"),
    (r"transformer\.resblocks\.(.+)", r"text.transformer.resblocks.\1"),
    (r"(token_embedding\.weight|positional_embedding|ln_final\.(?:weight|bias)|text_projection)", r"text.\1"),
    (r"logit_scale", "temperature.t"),
    (r"logit_bias", "temperature.bias"),
]
# Sizes and the causal mask that some versions store as tensors; topoclip rebuilds them.
IGNORED = ("input_resolution", "context_length", "vocab_size", "attn_mask")
TEXT_LAYOUT = {"norm_first": True, "embedding_norm": False, "attention": "causal", "pooling": "end_of_text"}

END_OF_WORD = "</w>"
# The most bytes a merges file may hold once decompressed: OpenAI's bpe_simple_vocab_16e6.txt is 1.6 MB.
MAX_MERGES_BYTES = 64 << 20
BYTE_TOKENS = 256


# --------------------------------------------------------------------------- tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """OpenAI's (GPT-2's) map of the 256 byte values to printable characters, in vocabulary order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, codes)}


def read_merges(path: Union[str, Path]) -> list[tuple[str, str]]:
    """Merges ("a", "b") of a bpe_simple_vocab file (gzip or plain text; a "#version" header is skipped)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no BPE vocabulary file at {path} (OpenAI's bpe_simple_vocab_16e6.txt.gz)")
    try:
        with open_regular(path, "BPE merges file", limit=None, error=ConfigError) as file:
            compressed = file.read(2) == b"\x1f\x8b"
            file.seek(0)
            with (gzip.GzipFile(fileobj=file, mode="rb") if compressed else file) as reader:
                raw = reader.read(MAX_MERGES_BYTES + 1)  # a gzip bomb is read no further than this
        if len(raw) > MAX_MERGES_BYTES:
            raise ConfigError(f"{path} holds more than {MAX_MERGES_BYTES >> 20} MB of merges; OpenAI's has 1.6 MB: not "
                              f"a BPE vocabulary")
        text = raw.decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} is not a BPE merges file (gzip or UTF-8 text): {error}") from None
    lines = text.split("\n")
    if lines and lines[0].startswith("#"):
        lines = lines[1:]
    merges = []
    for number, line in enumerate(lines, start=2):
        if not line:
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ConfigError(f"{path} line {number} is {line!r}, not a merge 'a b'; expected OpenAI's "
                              f"bpe_simple_vocab_16e6.txt.gz format")
        merges.append((parts[0], parts[1]))
    return merges


def bpe_tokenizer(path: Union[str, Path], vocab_size: int = 49408, context_length: int = 77) -> Tokenizer:
    """OpenAI's tokenizer from its merges file, for a text embedding of `vocab_size` rows."""
    merges = read_merges(path)
    wanted = vocab_size - 2 * BYTE_TOKENS - 2
    if wanted < 0 or len(merges) < wanted:
        raise ConfigError(f"{path} has {len(merges)} merges; a vocabulary of {vocab_size} tokens needs {max(wanted, 0)} "
                          f"(vocab_size = 512 byte tokens + merges + 2)")
    merges = merges[:wanted]
    characters = list(bytes_to_unicode().values())
    tokens = characters + [c + END_OF_WORD for c in characters] + ["".join(pair) for pair in merges]
    tokens += [OPENAI_START, OPENAI_END]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ConfigError(f"{path} has repeated merges; not an OpenAI BPE vocabulary")
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, end_of_word_suffix=END_OF_WORD,
                                          continuing_subword_prefix=""))
    backend.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                               normalizers.Lowercase()])
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(OPENAI_SPLIT_PATTERN), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.Sequence([decoders.BPEDecoder(suffix=END_OF_WORD), decoders.ByteLevel()])
    return Tokenizer(backend, context_length)


# --------------------------------------------------------------------------- weights


def openclip_settings(folder: Path) -> dict:
    """What open_clip_config.json in `folder` says that the weights do not: activation, pixel statistics.

    Returns {} without the file; refuses text towers topoclip does not have.
    """
    path = folder / OPENCLIP_CONFIG
    if not path.exists():
        return {}
    data = read_json(path, "OpenCLIP config", folder, error=ConfigError)
    model = data.get("model_cfg", {}) if isinstance(data, dict) else None
    text = model.get("text_cfg", {}) if isinstance(model, dict) else None
    preprocess = data.get("preprocess_cfg", {}) if isinstance(data, dict) else None
    if not (isinstance(text, dict) and isinstance(preprocess, dict)):
        raise ConfigError(f"{path} is not OpenCLIP's config (an object with model_cfg.text_cfg and preprocess_cfg "
                          f"objects)")
    unsupported = {key: text[key] for key in ("hf_model_name", "no_causal_mask", "proj_bias") if text.get(key)}
    if text.get("pool_type", "argmax") not in ("argmax", "eos"):
        unsupported["pool_type"] = text["pool_type"]
    if unsupported:
        raise CheckpointError(f"{path}: this OpenCLIP text tower ({unsupported}) is not the CLIP layout topoclip imports "
                              f"(causal, pooled at the end-of-text token)")
    settings = {"activation": "quick_gelu" if model.get("quick_gelu") else "gelu"}
    # The heads no tensor stores, with OpenCLIP's own defaults where the file leaves them out (CLIPVisionCfg's
    # head_width 64, CLIPTextCfg's heads 8): what open_clip.create_model builds from the same file.
    vision = model.get("vision_cfg", {})
    if not isinstance(vision, dict):
        raise ConfigError(f"{path}: model_cfg.vision_cfg must be an object, not {vision!r:.40}")
    for key, section, default in (("head_width", vision, 64), ("heads", text, 8)):
        value = section.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            where = "vision_cfg" if section is vision else "text_cfg"
            raise ConfigError(f"{path}: model_cfg.{where}.{key} must be a whole number ≥ 1, not {value!r:.40}")
    settings["vision_head_width"], settings["text_heads"] = vision.get("head_width", 64), text.get("heads", 8)
    settings["image_size"] = vision.get("image_size")  # (past a multiple of the patch, the weights cannot say it)
    if text.get("pool_type") == "eos":  # pooled at the first token of this id (OpenCLIP's default eos_id is 2)
        eos = text.get("eos_id", 2)
        if not isinstance(eos, int) or isinstance(eos, bool) or eos < 0:
            raise ConfigError(f"{path}: text_cfg.eos_id must be a token id (a whole number ≥ 0), not {eos!r:.40}")
        settings["end_token_id"] = eos
    if "mean" in preprocess and "std" in preprocess:
        statistics = [preprocess["mean"], preprocess["std"]]
        if not all(isinstance(values, list) and len(values) == 3 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) for values in statistics):
            raise ConfigError(f"{path}: preprocess_cfg mean and std must be three numbers each")
        settings["pixels"] = {"mean": list(preprocess["mean"]), "std": list(preprocess["std"])}
    return settings


def import_openai(source: Union[str, Path, dict], format: str = "openai", vocab: Optional[Union[str, Path]] = None,
                  activation: Optional[str] = None, overrides: Sequence[str] = (),
                  name: str = "", quick_gelu: bool = False,
                  image_size: Optional[int] = None) -> tuple[CLIP, Optional[Tokenizer], Config]:
    """(model, tokenizer or None, config) from an OpenAI / OpenCLIP ViT checkpoint (file, folder or state dict).

    format: "openai" (QuickGELU) or "openclip" (activation from open_clip_config.json beside the
    weights, or `activation`); vocab: bpe_simple_vocab_16e6.txt.gz or merges.txt (or a tokenizer.json);
    overrides: "key=value"; quick_gelu: QuickGELU whatever open_clip_config.json says, as open_clip.create_model
    sets it for a pretrained tag its table marks quick_gelu (DFN's, MetaCLIP's); image_size: the size a foreign
    config gives weights passed as a state dict (open_clip_config.json's is read beside a file).
    """
    if format not in FORMATS:
        raise ConfigError(f"unknown format {format!r}; choose one of {FORMATS}")
    if activation is not None and activation not in ACTIVATIONS:
        raise ConfigError(f"activation={activation!r}; choose one of {ACTIVATIONS}")
    settings = {"image_size": image_size}
    if not isinstance(source, dict):
        settings = openclip_settings(weights_file(source).parent)
        state = read_state_dict(source)
    else:
        state = source
    if quick_gelu:
        settings["activation"] = "quick_gelu"
    if format == "openai" and settings.get("activation") == "gelu":
        raise ConfigError(f"{OPENCLIP_CONFIG} beside the weights says GELU, but OpenAI's weights use QuickGELU: these "
                          f"are OpenCLIP-trained weights; use --from openclip")
    expected = "quick_gelu" if format == "openai" else settings.get("activation")
    if expected and activation and activation != expected:
        origin = "OpenAI's weights were trained with" if format == "openai" else f"{OPENCLIP_CONFIG} says"
        raise ConfigError(f"activation {activation} does not match the checkpoint: {origin} {expected}; "
                          f"drop the setting or use {expected}")
    activation = expected or activation
    if activation is None:
        raise ConfigError(f"OpenCLIP weights do not store their activation and there is no {OPENCLIP_CONFIG} beside "
                          f"them: give it (--activation quick_gelu for OpenAI-trained and '-quickgelu' models, "
                          f"--activation gelu for the others)")

    state = rename_keys(state, RULES, IGNORED, source=f"the {format} checkpoint")
    if "visual.class_embedding" in state and state["visual.class_embedding"].dim() == 1:
        state["visual.class_embedding"] = state["visual.class_embedding"][None]  # (width,) -> (1, width)
    vocab_size = state["text.token_embedding.weight"].shape[0] if "text.token_embedding.weight" in state else 0
    layout = {**TEXT_LAYOUT, "cls_token_id": max(vocab_size - 2, 0),  # <|startoftext|>; unused by this pooling
              "end_token_id": settings.get("end_token_id")}
    values = model_values(state, activation, layout)
    if "vision_head_width" in settings:  # the heads open_clip_config.json gives (the weights' width / 64 without it)
        heads = {"vision": values["vision"]["width"] // settings["vision_head_width"], "text": settings["text_heads"]}
        for tower, count in heads.items():
            if count < 1 or values[tower]["width"] % count:
                raise CheckpointError(f"{OPENCLIP_CONFIG} beside the weights gives the {tower} tower {count!r:.40} heads, "
                                      f"which do not divide its width {values[tower]['width']} in the weights: the "
                                      f"file belongs to other weights")
            values[tower]["heads"] = count
    set_image_size(values, settings.get("image_size"), "the model's config")
    values["vision"]["eval_resize"] = "shortest"  # OpenAI's and OpenCLIP's evaluation geometry
    if "pixels" in settings:
        values["vision"].update(settings["pixels"])
    model, config = build_imported(state, values, overrides, name or source_name(source, format))
    for tower in ("vision", "text"):
        chosen = getattr(config.model, tower).activation
        if chosen != activation:
            raise ConfigError(f"model.{tower}.activation={chosen} but this {format} checkpoint was trained with "
                              f"{activation}; every output would change. Drop the setting (or use {activation})")
    tokenizer = None
    beside = None if isinstance(source, dict) else weights_file(source).parent / SAVED_FILE_NAME
    if vocab is None and beside is not None and beside.exists():  # a topoclip export carries its own
        vocab = check_inside(beside, beside.parent, "the folder's tokenizer", CheckpointError)
    try:
        if vocab is not None and Path(vocab).suffix == ".json":  # a tokenizer.json saved by topoclip
            tokenizer = Tokenizer.from_vocab(vocab, context_length=config.model.text.context_length)
        elif vocab is not None:
            tokenizer = bpe_tokenizer(vocab, config.model.text.vocab_size, config.model.text.context_length)
    except ValueError as error:  # the tokenizer's messages name the file and what is wrong
        raise CheckpointError(str(error)) from None
    return model, tokenizer, config

