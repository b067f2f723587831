"""Import the paper authors' release: Multi(32, 16) and its sphere baseline, ViT-B/16.

Their image tower already uses topoclip's keys (``visual.*``, ``class_embedding`` (m, width)).
Their text tower is torch's ``nn.TransformerEncoder`` — post-norm, exact GELU, key-padding mask —
under ``transformer.encoder.layers.{i}`` with ``self_attn``, ``linear1``/``linear2``,
``norm1``/``norm2``; it maps one to one onto topoclip's post-norm blocks (``attn``,
``mlp.c_fc``/``mlp.c_proj``, ``ln_1``/``ln_2``), with the embedding LayerNorm ``ln_embedding``
and the m text class tokens being [CLS] repeated m times, as in topoclip.

Their similarity is Σ_k of the m per-token cosines; ``logit_scale`` is stored but not applied.
topoclip's ``model.similarity`` (ps-inner, or sphere for m = 1) does not apply τ either, so the
similarities are theirs; τ is kept as ``temperature.t`` for fine-tuning.
Their tokenizer is BERT WordPiece (lower case) over ERNIE 2.0's 30,522-token ``vocab.txt``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union


from topoclip.config import Config, ConfigError
from topoclip.io.convert.architecture import build_imported, model_values, rename_keys
from topoclip.io.convert.files import read_state_dict, source_name
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import Tokenizer

BERT_CLS_ID = 101  # [CLS] in BERT/ERNIE vocabularies, used when no vocab.txt is given

_BLOCK = r"transformer\.encoder\.layers\.(\d+)\."
RULES = [
    (r"visual\.(.+)", r"visual.\1"),
    (_BLOCK + r"self_attn\.(.+)", r"text.transformer.resblocks.\1.attn.\2"),
    (_BLOCK + r"linear1\.(weight|bias)", r"text.transformer.resblocks.\1.mlp.c_fc.\2"),
    (_BLOCK + r"linear2\.(weight|bias)", r"text.transformer.resblocks.\1.mlp.c_proj.\2"),
    (_BLOCK + r"norm1\.(weight|bias)", r"text.transformer.resblocks.\1.ln_1.\2"),
    (_BLOCK + r"norm2\.(weight|bias)", r"text.transformer.resblocks.\1.ln_2.\2"),
    (r"(token_embedding\.weight|positional_embedding|ln_embedding\.(?:weight|bias)|ln_final\.(?:weight|bias)"
     r"|text_projection)", r"text.\1"),
    (r"logit_scale", "temperature.t"),
]
TEXT_LAYOUT = {"norm_first": False, "embedding_norm": True, "attention": "bidirectional", "pooling": "class_tokens"}


def import_mtob(source: Union[str, Path, dict], vocab: Optional[Union[str, Path]] = None,
                overrides: Sequence[str] = (), name: str = "") -> tuple[CLIP, Optional[Tokenizer], Config]:
    """(model, tokenizer or None, config) from the authors' checkpoint (a file, or its state dict).

    vocab: their BERT vocab.txt (gives the tokenizer and the [CLS] id); overrides: "key=value"
    settings applied to the config read off the weights (e.g. "model.text.heads=8").
    """
    state = source if isinstance(source, dict) else read_state_dict(source)
    state = rename_keys(state, RULES, source="the authors' checkpoint")
    tokenizer = Tokenizer.from_vocab(vocab) if vocab is not None else None
    layout = {**TEXT_LAYOUT, "cls_token_id": tokenizer.cls_id if tokenizer else BERT_CLS_ID}
    values = model_values(state, "gelu", layout)
    model, config = build_imported(state, values, overrides, name or source_name(source, "mtob"))
    if tokenizer is not None:
        tokenizer = Tokenizer.from_vocab(vocab, context_length=config.model.text.context_length)
        if tokenizer.vocab_size > config.model.text.vocab_size:
            raise ConfigError(f"{vocab} has {tokenizer.vocab_size} tokens but the checkpoint's text embedding "
                              f"{config.model.text.vocab_size}: not this model's vocabulary")
    return model, tokenizer, config

