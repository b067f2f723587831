"""Bring checkpoints in and out: foreign formats -> a topoclip folder, upcycling, re-export.

A converted model is written as a topoclip checkpoint folder (``model.safetensors``,
``topoclip_config.json``, ``tokenizer.json`` when a vocabulary was given) that ``topoclip.load``,
``topoclip eval``/``predict`` and ``topoclip train --init-from`` read. Nothing here unpickles:
foreign ``.pt``/``.bin`` files go through ``torch.load(weights_only=True)`` (see ``files.py``).

Formats (``topoclip convert --from``):
- ``topoclip``: a topoclip checkpoint or run folder (to upcycle, or to strip the training state);
- ``mtob``: the paper authors' release (``mtob.py``);
- ``openai`` / ``openclip``: OpenAI CLIP / OpenCLIP ViT weights (``openai.py``);
- ``hf``: a transformers ``CLIPModel`` folder (``hf.py``), the layout of most CLIPs on the Hugging Face Hub.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

from topoclip.config import Config, ConfigError
from topoclip.io.convert.files import check_destination
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import Tokenizer

FORMATS = ("topoclip", "mtob", "openai", "openclip", "hf")


def read_model(format: str, source: Union[str, Path], vocab: Optional[Union[str, Path]] = None,
               activation: Optional[str] = None,
               overrides: Sequence[str] = ()) -> tuple[CLIP, Optional[Tokenizer], Config]:
    """(model, tokenizer or None, config) from `source` in `format` (see FORMATS).

    vocab: the tokenizer file of the format (BERT vocab.txt, OpenAI's bpe_simple_vocab_16e6.txt.gz,
    or a tokenizer.json); activation: OpenCLIP only, when no open_clip_config.json says it;
    overrides: "key=value" settings for what the weights do not store (e.g. attention heads).
    """
    if format == "topoclip":
        from topoclip.io.checkpoint import load_checkpoint

        from topoclip.config import with_overrides

        if activation:
            raise ConfigError("a topoclip checkpoint's model settings are its own (activation); only train, data and "
                              "evaluate settings can be changed")
        model, tokenizer, config = load_checkpoint(source)
        config = with_overrides(config, overrides, "convert")
        if vocab is not None:
            tokenizer = Tokenizer.from_vocab(vocab, context_length=config.model.text.context_length)
        return model, tokenizer, config
    if format == "mtob":
        from topoclip.io.convert.mtob import import_mtob

        if activation:
            raise ConfigError("the authors' release uses exact GELU; --activation applies to --from openclip")
        return import_mtob(source, vocab, overrides)
    if format == "hf":
        from topoclip.io.convert.hf import import_hf

        if activation or vocab is not None:
            raise ConfigError("a transformers CLIPModel folder says its activation (config.json) and holds its "
                              "tokenizer (merges.txt); --activation and --vocab do not apply")
        return import_hf(source, overrides)
    if format in ("openai", "openclip"):
        from topoclip.io.convert.openai import import_openai

        return import_openai(source, format, vocab, activation, overrides)
    raise ConfigError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")


def convert(format: str, source: Union[str, Path], destination: Union[str, Path],
            vocab: Optional[Union[str, Path]] = None, activation: Optional[str] = None,
            overrides: Sequence[str] = (), class_tokens: Optional[int] = None, embed_dim: Optional[int] = None,
            noise: Optional[float] = None, seed: int = 0) -> Path:
    """Read `source` (see read_model), optionally upcycle it to Multi(embed_dim, class_tokens), and
    write a topoclip checkpoint folder at `destination` (new or empty). Returns the folder."""
    from topoclip.io.checkpoint import save_checkpoint

    destination = check_destination(destination)
    model, tokenizer, config = read_model(format, source, vocab, activation, overrides)
    if class_tokens is not None or embed_dim is not None:
        from topoclip.io.convert.upcycle import DEFAULT_NOISE, upcycle

        model, config = upcycle(model, config, class_tokens or config.model.class_tokens, embed_dim,
                                DEFAULT_NOISE if noise is None else noise, seed=seed)
    elif noise is not None:
        raise ConfigError("noise applies to upcycling: give --class-tokens (and --embed-dim)")
    return save_checkpoint(destination, model, config, tokenizer)
