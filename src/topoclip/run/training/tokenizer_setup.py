"""A run's tokenizer: a resumed run's own, the given vocabulary (data.tokenizer), the starting checkpoint's
(train.init_from), or one trained on the training captions; and the checks that it fits the text tower."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from topoclip.config import Config, ConfigError
from topoclip.data.sources import get_source
from topoclip.core.errors import UserError
from topoclip.model.pooling import end_of_text_id
from topoclip.preprocess.tokenizer import Tokenizer

# Captions read to train a vocabulary when the config names none.
TOKENIZER_TRAINING_CAPTIONS = 20_000


def build_tokenizer(config: Config, saved: Optional[Path] = None) -> Tokenizer:
    """The run's tokenizer: `saved` (a resumed run's), else data.tokenizer, else trained on the captions.

    A malformed vocabulary or tokenizer file is a UserError naming the file.
    """
    context = config.model.text.context_length
    try:
        if saved is not None:
            return Tokenizer.load(saved, context_length=context)
        if config.train.init_from and not config.data.tokenizer:  # the starting checkpoint's vocabulary
            from topoclip.run.training.init_from import initial_tokenizer

            return Tokenizer.load(initial_tokenizer(config), context_length=context)
        if config.data.tokenizer:
            return Tokenizer.from_vocab(config.data.tokenizer, context_length=context)
        return Tokenizer.train(training_captions(config), vocab_size=config.model.text.vocab_size, context_length=context)
    except ValueError as error:  # the tokenizer's messages name the file or the captions and the fix
        where = "the run's tokenizer" if saved is not None else ("data.tokenizer" if config.data.tokenizer else "tokenizer")
        raise UserError(f"{where}: {error}") from None


def training_captions(config: Config) -> list[str]:
    """Up to TOKENIZER_TRAINING_CAPTIONS captions of the training data (for a new vocabulary)."""
    return get_source(config.data.source).captions(config.data, TOKENIZER_TRAINING_CAPTIONS)


def check_tokenizer(tokenizer: Tokenizer, config: Config) -> None:
    """The tokenizer must fit the text tower; refused before training starts."""
    text = config.model.text
    if tokenizer.id_bound > text.vocab_size:
        raise ConfigError(f"the tokenizer gives ids up to {tokenizer.id_bound - 1} but model.text.vocab_size="
                          f"{text.vocab_size}; set model.text.vocab_size={tokenizer.id_bound}")
    if tokenizer.cls_id is None:  # SigLIP's framing: no start token, so only a tower that reads none takes it
        if text.pooling != "last":
            raise ConfigError(f"this tokenizer (SigLIP's or SigLIP 2's) frames a text without a start token, which "
                              f"model.text.pooling={text.pooling} needs; set model.text.pooling=last (SigLIP's)")
    elif tokenizer.cls_id != text.cls_token_id:
        raise ConfigError(f"the tokenizer's [CLS] id is {tokenizer.cls_id} but model.text.cls_token_id={text.cls_token_id}; "
                          f"set model.text.cls_token_id={tokenizer.cls_id}")
    pooled = end_of_text_id(text, tokenizer.id_bound)
    if pooled is not None and pooled != tokenizer.sep_id:
        raise ConfigError(f"model.text.pooling=end_of_text reads the token of id {pooled}, but this tokenizer ends a text "
                          f"with id {tokenizer.sep_id}; set model.text.end_token_id={tokenizer.sep_id}")


def fit_to_trained_tokenizer(config: Config, tokenizer: Tokenizer) -> Config:
    """A vocabulary topoclip trains (data.tokenizer "") sets model.text.cls_token_id to its own [CLS] id (and, for
    end_of_text pooling, model.text.end_token_id to its [SEP] id).

    So a paper preset (cls_token_id 101, BERT's) runs on one's own captions as it is; the resolved
    config (config.json) records the id used. model.text.vocab_size stays: the trained vocabulary has
    at most that many tokens, the text tower keeps that many rows (unused ones cost only memory) and
    the model's shape stays the preset's. A given vocabulary (data.tokenizer set) is checked instead.
    """
    text = config.model.text
    end = tokenizer.sep_id if text.pooling == "end_of_text" else text.end_token_id  # pooled where the text ends
    if config.data.tokenizer or tokenizer.cls_id is None or (tokenizer.cls_id, end) == (text.cls_token_id,
                                                                                        text.end_token_id):
        return config
    text = dataclasses.replace(text, cls_token_id=tokenizer.cls_id, end_token_id=end)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, text=text))
