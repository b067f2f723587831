"""Text tokenizer: BERT-style lower-case WordPiece (HF `tokenizers`) that returns fixed-length tensors.

Every caption becomes `[CLS] pieces... [SEP] [PAD]...`, exactly `context_length` ids long; captions
that are too long lose their last pieces, never the final [SEP]. The text encoder reads `input_ids`
and `attention_mask`; it builds its m class tokens from `cls_id` itself.

Imported models bring their own framing instead: OpenAI's BPE `<|startoftext|> pieces… <|endoftext|>` padded with
id 0, SigLIP's SentencePiece `pieces… </s>` padded with </s>, SigLIP 2's Gemma tokenizer what its tokenizer.json
says (`from_gemma`), padded on the left.

Three ways to get one:
- `Tokenizer.from_vocab(path)`: a BERT `vocab.txt` (one token per line, id = line number) or a
  `tokenizer.json` — e.g. the paper's ERNIE-2.0-en vocabulary (30,522 tokens).
- `Tokenizer.train(captions, vocab_size)`: learn a lower-case WordPiece vocabulary from captions.
  Trained vocabularies put the special tokens first: [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4.
- `Tokenizer.load(path)`: a file written by `save`, with its context length.

Special-token strings typed inside a caption (e.g. the text "[SEP]") are tokenized as ordinary text,
so a caption can never inject control tokens.
"""
from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from topoclip.core.errors import UserError
from topoclip.preprocess.sentencepiece import PATTERNS as SIGLIP_PATTERNS
from topoclip.preprocess.sentencepiece import (PUNCTUATION_PATTERN, SPIECE_END, CharacterMap, canonicalize,
                                               runs_in_python)

DEFAULT_CONTEXT_LENGTH = 77  # the paper's text context
SIGLIP_CONTEXT_LENGTH = 64  # SigLIP's (its text tower's positions)
CONTINUATION_PREFIX = "##"  # WordPiece marker for a piece that continues a word
# Trained vocabularies start with these, in this order: [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
REQUIRED_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")  # a loaded vocabulary must have these
SAVED_FILE_NAME = "tokenizer.json"  # `save(directory)` writes this file inside the directory
# OpenAI CLIP's byte-level BPE vocabulary (topoclip.io.convert.openai) frames a text with these instead
# of [CLS]/[SEP], pads with id 0 and has no unknown token (every byte is a token).
OPENAI_START, OPENAI_END = "<|startoftext|>", "<|endoftext|>"
# OpenAI's pre-tokenization (topoclip.io.convert.openai): contractions, letter runs, single digits, runs of other symbols.
OPENAI_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
# The regular expressions a tokenizer.json may hold: those topoclip's own tokenizers use. Any other is refused on
# loading, since a pattern can backtrack catastrophically on a caption (the library then panics at its retry limit).
KNOWN_PATTERNS = frozenset({r"\s+", OPENAI_SPLIT_PATTERN, *SIGLIP_PATTERNS})
# The longest context a tokenizer.json may set: model.text.context_length's bound in topoclip.config.
MAX_CONTEXT_LENGTH = 65536
# The most characters of one text the tokenizer reads (see __call__); a caption longer than this is no caption
# (topoclip.data.images.MAX_CAPTION_CHARS skips it in the training data).
MAX_TEXT_CHARS = 65_536
# SigLIP 2's Gemma vocabulary (`from_gemma`): byte-level BPE whose specials are <pad>=0, <eos>=1, <bos>=2, <unk>=3.
GEMMA_EOS, GEMMA_PAD, GEMMA_UNK = "<eos>", "<pad>", "<unk>"
GEMMA_SPACE = "▁"  # Gemma writes a space as this, and merges across it (no pre-tokenization)
PADDING_SIDES = ("right", "left")
# The longest string a tokenizer.json's normalizer or pre-tokenizer may insert (a Replace's content, a Prepend):
# topoclip's own insert one character; a 3 MB one multiplies every text's memory by millions.
MAX_INSERTED_CHARS = 16


@dataclass
class TextBatch:
    """A batch of tokenized captions, padded to one length L (the context length).

    input_ids: (B, L) int64 — [CLS] pieces... [SEP] then [PAD] ids.
    attention_mask: (B, L) bool — True on real tokens ([CLS], pieces, [SEP]), False on padding.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    def __post_init__(self):
        if self.input_ids.dim() != 2 or self.input_ids.shape != self.attention_mask.shape:
            raise ValueError(
                f"TextBatch needs input_ids and attention_mask of the same shape (B, L); got "
                f"{tuple(self.input_ids.shape)} and {tuple(self.attention_mask.shape)}"
            )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index) -> "TextBatch":
        """Select captions; an integer index keeps the batch dimension: (1, L)."""
        if isinstance(index, int):
            return TextBatch(self.input_ids[index].unsqueeze(0), self.attention_mask[index].unsqueeze(0))
        return TextBatch(self.input_ids[index], self.attention_mask[index])

    def to(self, device, non_blocking: bool = False) -> "TextBatch":
        """The same batch on `device`."""
        return TextBatch(
            self.input_ids.to(device, non_blocking=non_blocking),
            self.attention_mask.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> "TextBatch":
        """Page-locked copy, so a DataLoader with pin_memory=True can hand TextBatch over."""
        return TextBatch(self.input_ids.pin_memory(), self.attention_mask.pin_memory())


class Tokenizer:
    """Lower-case WordPiece tokenizer: list of captions -> TextBatch of (B, context_length) tensors."""

    def __init__(self, backend: BackendTokenizer, context_length: int = DEFAULT_CONTEXT_LENGTH):
        """Wrap an HF `tokenizers.Tokenizer` whose vocabulary has [PAD], [UNK], [CLS] and [SEP].

        Sets its post-processor to "[CLS] $A [SEP]" and its truncation and padding to
        `context_length`; prefer the constructors `from_vocab`, `train` and `load`.
        """
        self.context_length = _check_context_length(context_length)
        self._siglip_lowercase = None  # SigLIP's tokenizer: whether its canonicalisation lower-cases (see below)
        self._charsmap = None  # and its SentencePiece character map
        self.padding_side = "right"
        start, end = "[CLS]", "[SEP]"
        template = None  # SigLIP 2's: the tokenizer.json's own framing, kept
        if _is_gemma(backend):
            # SigLIP 2's Gemma framing (from_gemma): the special tokens its tokenizer.json's post-processor puts around
            # the text, padded as its padding says; no start token the tower reads (it reads the last position).
            template = _template(json.loads(backend.to_str()).get("post_processor"), backend, "the tokenizer")
            padding = backend.padding or {}
            self.pad_id = padding.get("pad_id", backend.token_to_id(GEMMA_PAD))
            self.padding_side = padding.get("direction", "left")
            self.unk_id = backend.token_to_id(GEMMA_UNK)
            start, end = None, template[1]
            if self.pad_id is None or backend.id_to_token(self.pad_id) is None:
                raise ValueError(f"the tokenizer pads with id {self.pad_id}, which is not in its vocabulary")
        elif backend.token_to_id(OPENAI_START) is not None and backend.token_to_id(start) is None:
            start, end = OPENAI_START, OPENAI_END
            self.pad_id, self.unk_id = 0, None
        elif isinstance(backend.model, models.Unigram) and backend.token_to_id(SPIECE_END) is not None:
            # SigLIP's SentencePiece framing (topoclip.preprocess.sentencepiece): no start token, `pieces… </s>`,
            # padded with </s>; its tower reads the last position, never a start token.
            start, end = None, SPIECE_END
            self.pad_id, self.unk_id = backend.token_to_id(end), backend.token_to_id("<unk>")
            # SigLIP's canonicalisation (its normalizer removes the punctuation: siglip_backend wrote it) and
            # SentencePiece's character map run in Python, as transformers and sentencepiece run them (Python's lower
            # case and whitespace; the map's longest rule across graphemes); the Rust normalizer keeps the rest.
            steps = list(_objects(json.loads(backend.to_str()).get("normalizer")))
            if any(step.get("pattern") == {"Regex": PUNCTUATION_PATTERN} for step in steps):
                self._siglip_lowercase = any(step.get("type") == "Lowercase" for step in steps)
                charsmap = [step["precompiled_charsmap"] for step in steps if step.get("type") == "Precompiled"]
                if charsmap:
                    import base64

                    self._charsmap = CharacterMap(base64.b64decode(charsmap[0]), "the tokenizer's character map")
        else:
            missing = [token for token in REQUIRED_TOKENS if backend.token_to_id(token) is None]
            if missing:
                raise ValueError(
                    f"the vocabulary has no {', '.join(missing)} token(s); a BERT-style vocabulary needs "
                    f"{', '.join(REQUIRED_TOKENS)} (add them as lines of vocab.txt)"
                )
            self.pad_id = backend.token_to_id("[PAD]")
            self.unk_id = backend.token_to_id("[UNK]")
        self.cls_id = None if start is None else backend.token_to_id(start)  # None: SigLIP's framing has none
        self.sep_id = None if end is None else backend.token_to_id(end)  # None: a SigLIP 2 framing without an end
        mask_id = backend.token_to_id("[MASK]")
        # Ids that `decode` drops; [UNK] stays visible because it says something was lost.
        framed = [backend.token_to_id(name) for name in template or () if name is not None]
        self._control_ids = {self.pad_id, self.cls_id, self.sep_id, mask_id, *framed} - {None}
        if template is None:
            framing = [(start, self.cls_id), (end, self.sep_id)] if start is not None else [(end, self.sep_id)]
            backend.post_processor = processors.TemplateProcessing(
                single=" ".join([start, "$A", end] if start is not None else ["$A", end]), special_tokens=framing
            )
        if backend.decoder is None:
            backend.decoder = decoders.WordPiece(prefix=CONTINUATION_PREFIX)
        _set_length(backend, self.context_length, self.pad_id, self.padding_side)
        self._backend = backend  # what `save` writes
        encoder = backend  # what encodes: SigLIP's without the steps Python runs first
        if self._siglip_lowercase is not None:
            data = json.loads(backend.to_str())
            data["normalizer"] = {"type": "Sequence", "normalizers": [
                step for step in data["normalizer"].get("normalizers", []) if not runs_in_python(step)]}
            encoder = BackendTokenizer.from_str(json.dumps(data))
        self._backends_by_length = {self.context_length: _text_only(encoder)}  # clones for per-call overrides

    # ----- constructors -----

    @classmethod
    def from_vocab(cls, path: Union[str, Path], context_length: Optional[int] = None) -> "Tokenizer":
        """Load a BERT `vocab.txt` (one token per line, id = line number) or a `tokenizer.json`.

        context_length: None means the length stored in a tokenizer.json written by `save`, else 77.
        vocab.txt gets bert-base-uncased processing: BertNormalizer (lower-case, strip accents,
        split Chinese characters), BertPreTokenizer, WordPiece with "##" continuations.
        """
        from topoclip.core.door import JSON_BYTES, read_bytes

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer vocabulary file at {str(path)!r} (expected vocab.txt or tokenizer.json)")
        if path.suffix == ".model":
            return cls.from_sentencepiece(path, context_length)
        try:
            text = read_bytes(path, "tokenizer vocabulary", limit=JSON_BYTES, error=ValueError).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(
                f"{str(path)!r} is not UTF-8 text; expected a BERT vocab.txt (one token per line) "
                f"or a tokenizer.json"
            ) from None
        if path.suffix == ".json" or text.lstrip().startswith("{"):
            return cls._from_tokenizer_json(text, path, context_length)
        vocab = _parse_vocab_text(text, path)
        missing = [token for token in REQUIRED_TOKENS if token not in vocab]
        if missing:
            raise ValueError(
                f"vocabulary {str(path)!r} has no {', '.join(missing)} token(s); a BERT vocab.txt needs "
                f"{', '.join(REQUIRED_TOKENS)} (add them as lines)"
            )
        backend = _bert_backend(models.WordPiece(vocab=vocab, unk_token="[UNK]", continuing_subword_prefix=CONTINUATION_PREFIX))
        return cls(backend, DEFAULT_CONTEXT_LENGTH if context_length is None else context_length)

    @classmethod
    def from_sentencepiece(cls, path: Union[str, Path], context_length: Optional[int] = None,
                           lowercase: bool = True, root: Optional[Union[str, Path]] = None) -> "Tokenizer":
        """SigLIP's tokenizer from its SentencePiece file (spiece.model): its texts canonicalized as SigLIP's are
        (topoclip.preprocess.sentencepiece), framed `pieces… </s>` and padded with </s> to context_length (64 when
        None, SigLIP's). lowercase: transformers' do_lower_case; root: the folder the file must not lead out of."""
        from topoclip.core.door import JSON_BYTES, read_bytes
        from topoclip.preprocess.sentencepiece import siglip_backend

        path = Path(path)
        data = read_bytes(path, "SentencePiece model", root, limit=JSON_BYTES, error=ValueError)
        backend = siglip_backend(data, repr(str(path)), lowercase=lowercase)
        return cls(backend, SIGLIP_CONTEXT_LENGTH if context_length is None else context_length)

    @classmethod
    def from_gemma(cls, path: Union[str, Path], context_length: Optional[int] = None,
                   padding_side: Optional[str] = None, pad_token: Optional[str] = None,
                   root: Optional[Union[str, Path]] = None, added_tokens: Optional[dict] = None) -> "Tokenizer":
        """SigLIP 2's tokenizer from its Gemma tokenizer.json, as transformers' Siglip2Tokenizer reads the file: its
        vocabulary, merges, added tokens and post-processor (the framing: special tokens around the text) in Gemma's
        pipeline — a lower case first (SigLIP 2 was trained on lower-cased text), spaces written ▁, byte-level BPE
        with byte fallback, no pre-tokenization — padded with `pad_token` (<pad>) on `padding_side` (the file's, else
        left: transformers' for Gemma) to context_length (64 when None, SigLIP 2's). root: the folder the file must not
        lead out of. added_tokens: tokenizer_config.json's added_tokens_decoder, which transformers reads instead of the
        file's added tokens: it must say what the file says. The file's own normalizer, pre-tokenizer, decoder and BPE
        settings are not read (transformers' are Gemma's)."""
        from topoclip.core.door import JSON_BYTES, parse_json, read_text

        path = Path(path)
        where = repr(str(path))
        data = parse_json(read_text(path, "tokenizer", root, limit=JSON_BYTES, error=ValueError), where, error=ValueError)
        model = data.get("model") if isinstance(data, dict) else None
        vocab = model.get("vocab") if isinstance(model, dict) else None
        if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(vocab, dict) or \
                GEMMA_EOS not in vocab:
            raise ValueError(f"{where} is not Gemma's tokenizer (byte-level BPE with an {GEMMA_EOS} token), which "
                             f"SigLIP 2 uses; give the folder its own tokenizer.json")
        data["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Lowercase"}, {"type": "Replace", "pattern": {"String": " "}, "content": GEMMA_SPACE}]}
        data["pre_tokenizer"] = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                                 "invert": False}
        data["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": GEMMA_SPACE}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}]}
        # transformers builds its BPE from the file's vocabulary and merges alone (Gemma's settings, nothing else read)
        data["model"] = {"type": "BPE", "vocab": vocab, "merges": model.get("merges", []), "dropout": None,
                         "unk_token": GEMMA_UNK, "continuing_subword_prefix": None, "end_of_word_suffix": None,
                         "fuse_unk": True, "byte_fallback": True, "ignore_merges": False}
        truncation = data.get("truncation")
        if isinstance(truncation, dict) and truncation.get("direction", "Right") != "Right":
            raise ValueError(f"{where}: its truncation cuts the start of a long text (direction "
                             f"{truncation.get('direction')!r}); topoclip cuts the end, as SigLIP 2 was trained")
        if added_tokens is not None:
            _check_added_tokens(added_tokens, data.get("added_tokens"), where)
        padding = data.get("padding") if isinstance(data.get("padding"), dict) else {}
        side = padding_side or {"Left": "left", "Right": "right"}.get(padding.get("direction"), "left")
        if side not in PADDING_SIDES:
            raise ValueError(f"{where}: padding side {side!r}; transformers pads on the left or the right")
        data["truncation"] = data["padding"] = None
        try:
            backend = BackendTokenizer.from_str(json.dumps(data))
        except Exception as error:  # the Rust parser raises plain Exception
            raise ValueError(f"{where} could not be read as Gemma's tokenizer ({str(error)[:200]}); give the folder "
                             f"its own tokenizer.json") from None
        pad_token = padding.get("pad_token", GEMMA_PAD) if pad_token is None else pad_token
        pad_id = backend.token_to_id(pad_token) if isinstance(pad_token, str) and pad_token else None
        if pad_id is None:
            raise ValueError(f"{where}: its padding token {pad_token!r} is not in its vocabulary")
        backend.enable_padding(direction=side, pad_id=pad_id, pad_token=pad_token)
        try:
            return cls(backend, SIGLIP_CONTEXT_LENGTH if context_length is None else context_length)
        except ValueError as error:  # its framing: said of the file
            raise ValueError(str(error).replace("the tokenizer", where, 1)) from None

    @classmethod
    def train(
        cls, captions: Iterable[str], vocab_size: int = 1024, context_length: int = DEFAULT_CONTEXT_LENGTH
    ) -> "Tokenizer":
        """Learn a lower-case WordPiece vocabulary of at most `vocab_size` tokens from captions.

        Ids 0..4 are [PAD], [UNK], [CLS], [SEP], [MASK]; then "##" continuation characters, single
        characters, and learned pieces. The same captions give the same vocabulary in every process.
        When the captions have more distinct characters than fit, the rarest become [UNK].
        """
        if isinstance(captions, (str, bytes)):
            raise TypeError("captions must be a list of strings, not a single string; wrap it: [caption]")
        captions = list(captions)
        if not captions:
            raise ValueError("cannot train a tokenizer on an empty list of captions; pass at least one caption")
        _check_texts(captions)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size must be an integer above {len(SPECIAL_TOKENS)} (the special tokens); got {vocab_size!r}"
            )
        backend = _bert_backend(models.WordPiece(unk_token="[UNK]", continuing_subword_prefix=CONTINUATION_PREFIX))
        alphabet, continuations = _choose_base_units(captions, backend, vocab_size - len(SPECIAL_TOKENS))
        if not alphabet:
            raise ValueError("the captions contain no text (all empty or whitespace); pass captions with words")
        # Determinism: HF's trainer numbers "##x" tokens in hash-map order, which changes the tie-breaks
        # between equally frequent merges from run to run. Declaring every "##x" up front (as extra
        # special tokens, sorted) fixes all ids before merging; the alphabet is pinned the same way.
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS) + continuations,
            initial_alphabet=alphabet,
            limit_alphabet=len(alphabet),
            continuing_subword_prefix=CONTINUATION_PREFIX,
            show_progress=False,
        )
        backend.train_from_iterator(captions, trainer)
        # Rebuild from the plain vocabulary so "##x" are ordinary pieces, not special added tokens.
        vocab = backend.get_vocab(with_added_tokens=False)
        vocab = {token: index for token, index in vocab.items() if index < vocab_size}
        backend = _bert_backend(models.WordPiece(vocab=vocab, unk_token="[UNK]", continuing_subword_prefix=CONTINUATION_PREFIX))
        return cls(backend, context_length)

    @classmethod
    def load(cls, path: Union[str, Path], context_length: Optional[int] = None) -> "Tokenizer":
        """Load what `save` wrote: a tokenizer.json file, or a directory containing one."""
        path = Path(path)
        if path.is_dir() and path.suffix != ".json":  # (a folder named tokenizer.json is refused by the door)
            path = path / SAVED_FILE_NAME
        if not path.exists():
            raise FileNotFoundError(f"no saved tokenizer at {str(path)!r}; write one with Tokenizer.save(path)")
        from topoclip.core.door import JSON_BYTES, read_text

        return cls._from_tokenizer_json(read_text(path, "tokenizer", limit=JSON_BYTES, error=ValueError), path,
                                        context_length)

    @classmethod
    def _from_tokenizer_json(cls, text: str, path: Path, context_length: Optional[int]) -> "Tokenizer":
        expected = "expected a tokenizer.json from the HF tokenizers library (or a BERT vocab.txt)"
        from topoclip.core.door import parse_json

        data = parse_json(text, f"{str(path)!r} ({expected})", error=ValueError)
        if not isinstance(data, dict) or "model" not in data:
            raise ValueError(f"{str(path)!r} has no 'model' entry; {expected}")
        inserted = [value for section in ("normalizer", "pre_tokenizer") for key, value in _strings(data.get(section))
                    if key in ("content", "prepend", "replacement") and len(value) > MAX_INSERTED_CHARS]
        if inserted:
            raise ValueError(f"{str(path)!r}: its normalizer or pre-tokenizer inserts a string of {len(inserted[0]):,} "
                             f"characters into every text (at most {MAX_INSERTED_CHARS}); use a tokenizer topoclip wrote")
        for step in _objects(data.get("normalizer")):  # a SentencePiece character map (SigLIP's): checked as read
            if step.get("type") == "Precompiled":
                import base64
                import binascii

                from topoclip.preprocess.sentencepiece import check_charsmap

                value = step.get("precompiled_charsmap")
                try:
                    if not isinstance(value, str):
                        raise binascii.Error
                    check_charsmap(base64.b64decode(value, validate=True), repr(str(path)))
                except binascii.Error:
                    raise ValueError(f"{str(path)!r}: its Precompiled normalizer's precompiled_charsmap is not a base64 "
                                     f"string; {expected}") from None
        unknown = sorted(set(_patterns(data)) - KNOWN_PATTERNS)
        if unknown:
            raise ValueError(f"{str(path)!r} uses the regular expression {unknown[0][:80]!r}, which topoclip does not "
                             f"know to be safe on any caption; use a tokenizer topoclip wrote (or a BERT vocab.txt)")
        try:
            backend = BackendTokenizer.from_str(text)
        except Exception as error:  # the Rust parser raises plain Exception
            raise ValueError(f"{str(path)!r} could not be read as a tokenizer ({error}); {expected}") from None
        if context_length is None:
            stored = backend.truncation  # `save` stores the context length as the truncation length
            context_length = stored["max_length"] if stored else DEFAULT_CONTEXT_LENGTH
            if not isinstance(context_length, int) or not 2 <= context_length <= MAX_CONTEXT_LENGTH:
                raise ValueError(f"{str(path)!r} sets the context length (truncation.max_length) to {context_length}; "
                                 f"it must be 2 … {MAX_CONTEXT_LENGTH} (77 for CLIP)")
        return cls(backend, context_length)

    def save(self, path: Union[str, Path]) -> Path:
        """Write tokenizer.json (vocabulary, processing, context length); returns the file written.

        A path ending in ".json" is the file; any other path is a directory that gets tokenizer.json.
        """
        path = Path(path)
        if path.suffix != ".json":
            path = path / SAVED_FILE_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(path), pretty=True)
        return path

    def transformers_config(self) -> dict:
        """tokenizer_config.json for transformers' AutoTokenizer beside `save`'s tokenizer.json: the same ids up to
        the end token (the tokenizer.json's post-processor frames a text; transformers keeps the end token when it
        truncates). OpenAI's BPE pads with id 0, the ordinary token "!", which transformers would then split out
        of every text as a special token: there it pads with the end token, as transformers' CLIPTokenizer does
        (the tower reads nothing after the end token, so the embeddings are the same)."""
        name = self._backend.id_to_token
        pad = name(self.pad_id) if self.unk_id is not None else name(self.sep_id)
        start = name(self.cls_id) if self.cls_id is not None else None
        end = name(self.sep_id) if self.sep_id is not None else None
        return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": self.context_length,
                "bos_token": start, "cls_token": start, "eos_token": end, "sep_token": end, "pad_token": pad,
                "unk_token": name(self.unk_id) if self.unk_id is not None else None,
                "clean_up_tokenization_spaces": False}

    # ----- encoding -----

    @property
    def is_wordpiece(self) -> bool:
        """True for a WordPiece vocabulary (topoclip's own), False for OpenAI's byte-level BPE or SigLIP's Unigram."""
        return isinstance(self._backend.model, models.WordPiece)

    @property
    def vocab_size(self) -> int:
        """Number of token ids; every id in a TextBatch is below this."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def id_bound(self) -> int:
        """One past the largest token id it can give (a vocabulary may skip ids): the text embedding needs this many rows."""
        return max(self._backend.get_vocab(with_added_tokens=True).values()) + 1

    def __call__(self, texts: Union[str, Sequence[str]], context_length: Optional[int] = None) -> TextBatch:
        """Tokenize captions -> TextBatch with input_ids (B, L) int64 and attention_mask (B, L) bool.

        texts: one string (B = 1) or a sequence of B strings. L = context_length (default: the
        tokenizer's). Encodes in parallel (Rust).
        """
        if isinstance(texts, str):
            texts = [texts]
        elif isinstance(texts, bytes) or not isinstance(texts, Iterable):
            raise TypeError(
                f"texts must be a string or a list of strings, got {type(texts).__name__}"
                + ("; decode bytes first: data.decode('utf-8')" if isinstance(texts, bytes) else "")
            )
        texts = list(texts)
        _check_texts(texts)
        length = self.context_length if context_length is None else _check_context_length(context_length)
        if not texts:
            empty = torch.zeros(0, length, dtype=torch.int64)
            return TextBatch(empty, empty.bool())
        # A text past MAX_TEXT_CHARS is cut there first: the context keeps its first few hundred characters anyway,
        # and the library's memory grows with the text (hundreds of bytes a character).
        if self._siglip_lowercase is not None:  # before the cut: a long run of spaces or punctuation is then gone
            texts = [canonicalize(text, self._siglip_lowercase) for text in texts]
            if self._charsmap is not None:
                texts = [self._charsmap.normalize(text) for text in texts]
        texts = [text[:MAX_TEXT_CHARS] for text in texts]
        try:
            encodings = self._backend_for(length).encode_batch(texts)
        except BaseException as error:  # the library raises Exception, or panics (a BaseException) past its limits
            if not isinstance(error, Exception) and type(error).__name__ != "PanicException":
                raise  # KeyboardInterrupt, SystemExit
            raise UserError(f"the tokenizer failed on a caption ({(str(error).splitlines() or [''])[0][:120]}); use a "
                            f"tokenizer topoclip wrote") from None
        input_ids = torch.tensor([encoding.ids for encoding in encodings], dtype=torch.int64)  # (B, L)
        attention_mask = torch.tensor([encoding.attention_mask for encoding in encodings], dtype=torch.bool)  # (B, L)
        return TextBatch(input_ids, attention_mask)

    def _backend_for(self, length: int) -> BackendTokenizer:
        """The backend truncating/padding to `length` (a cached clone when it differs from the default)."""
        if length not in self._backends_by_length:
            clone = _text_only(BackendTokenizer.from_str(self._backends_by_length[self.context_length].to_str()))
            _set_length(clone, length, self.pad_id, self.padding_side)
            self._backends_by_length[length] = clone
        return self._backends_by_length[length]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of one sequence of ids (list of int or (L,) tensor); drops [CLS]/[SEP]/[PAD]/[MASK] by default."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1:
                raise ValueError(f"decode takes one sequence (L,), got shape {tuple(ids.shape)}; decode each row")
            ids = ids.tolist()
        ids = list(ids)
        for value in ids:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"decode needs integer token ids, got {type(value).__name__} ({value!r})")
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"token id {value} is outside the vocabulary [0, {self.vocab_size})")
        if skip_special_tokens:
            ids = [value for value in ids if value not in self._control_ids]
        return self._backend.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, context_length={self.context_length})"


# ----- helpers -----


def _bert_backend(model) -> BackendTokenizer:
    """bert-base-uncased processing around a WordPiece model."""
    backend = BackendTokenizer(model)
    # lowercase=True with strip_accents unset strips accents too, as bert-base-uncased does.
    backend.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix=CONTINUATION_PREFIX)
    return backend


def _set_length(backend: BackendTokenizer, length: int, pad_id: int, side: str = "right") -> None:
    """Truncate to `length` ids including the framing (the text loses its end, never the framing), and pad to exactly
    `length` on `side`."""
    backend.enable_truncation(max_length=length, direction="right")
    backend.enable_padding(direction=side, pad_id=pad_id, pad_token=backend.id_to_token(pad_id), length=length)


def _text_only(backend: BackendTokenizer) -> BackendTokenizer:
    """`backend`, reading a special token's string typed in a caption ("<eos>", "[SEP]") as text: a caption cannot
    frame itself. (A library flag, not kept in tokenizer.json: set on every encoder.)"""
    backend.encode_special_tokens = True
    return backend


ADDED_TOKEN_FIELDS = ("content", "special", "normalized", "lstrip", "rstrip", "single_word")


def _check_added_tokens(declared, listed, where: str) -> None:
    """tokenizer_config.json's added_tokens_decoder ({id: fields}) must list what tokenizer.json's added_tokens do."""
    def fields(entry) -> str:  # (as JSON text: a field of a hostile file may be any value, hashable or not)
        return json.dumps([entry.get(key) for key in ADDED_TOKEN_FIELDS] if isinstance(entry, dict) else entry)

    if not isinstance(declared, dict) or not isinstance(listed, list):
        raise ValueError(f"{where}: added_tokens_decoder or added_tokens is not a table of tokens")
    file = {str(entry.get("id")): fields(entry) for entry in listed if isinstance(entry, dict)}
    config = {str(key): fields(entry) for key, entry in declared.items()}
    different = sorted(set(file.items()) ^ set(config.items()), key=str)
    if different:
        raise ValueError(f"{where}: tokenizer_config.json's added_tokens_decoder and tokenizer.json's added_tokens differ "
                         f"(id {different[0][0]}); transformers reads the first, the tokenizers library the second: "
                         f"give the folder files that agree")


def _is_gemma(backend: BackendTokenizer) -> bool:
    """Gemma's vocabulary (SigLIP 2's): BPE with byte fallback, an <eos> token, no [CLS] (a BERT-style BPE keeps its
    [CLS] framing; OpenAI's byte-level BPE has no byte fallback)."""
    return isinstance(backend.model, models.BPE) and backend.model.byte_fallback and \
        backend.token_to_id(GEMMA_EOS) is not None and backend.token_to_id("[CLS]") is None


def _template(processor, backend: BackendTokenizer, where: str) -> tuple[Optional[str], Optional[str]]:
    """The special tokens a tokenizer.json's post-processor puts before and after the text (at most one each; None for
    none). ValueError for any other post-processor."""
    if processor is None:
        return None, None
    single = processor.get("single") if isinstance(processor, dict) and processor.get("type") == "TemplateProcessing" \
        else None
    if not isinstance(single, list) or not all(isinstance(item, dict) and len(item) == 1 for item in single):
        raise ValueError(f"{where}: its post-processor is not a template of special tokens around the text; topoclip "
                         f"reads TemplateProcessing (e.g. `<bos> $A <eos>`)")
    kinds = [next(iter(item)) for item in single]
    sequence = [index for index, kind in enumerate(kinds) if kind == "Sequence"]
    if len(sequence) == 1 and (not isinstance(single[sequence[0]]["Sequence"], dict) or
                               single[sequence[0]]["Sequence"].get("id") != "A"):
        raise ValueError(f"{where}: its post-processor's template holds a second text ($B) where the text ($A) goes")
    if len(sequence) != 1 or len(single) > 3 or set(kinds) - {"Sequence", "SpecialToken"} or \
            sequence[0] > 1 or len(single) - sequence[0] > 2:
        raise ValueError(f"{where}: its post-processor frames a text as {' '.join(kinds)}; topoclip reads at most one "
                         f"special token before and one after the text")
    names = [item["SpecialToken"].get("id") for item in single if "SpecialToken" in item]
    specials = processor.get("special_tokens") or {}
    for name in names:
        entry = specials.get(name) if isinstance(specials, dict) and isinstance(name, str) else None
        if not isinstance(entry, dict) or entry.get("ids") != [backend.token_to_id(name)] or \
                backend.token_to_id(name) is None:
            raise ValueError(f"{where}: its post-processor adds {name!r}, which is not one token of its vocabulary")
    return (names[0] if sequence[0] == 1 else None), (names[-1] if len(single) - sequence[0] == 2 else None)


def _strings(data) -> Iterable[tuple[str, str]]:
    """Every (key, string value) in a parsed tokenizer.json (part), walked without recursion (it may nest deeply)."""
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield from ((key, value) for key, value in node.items() if isinstance(value, str))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _objects(data) -> Iterable[dict]:
    """Every object (dict) in a parsed tokenizer.json (part), walked without recursion."""
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _patterns(data) -> Iterable[str]:
    """Every {"Regex": pattern} in a parsed tokenizer.json."""
    return (value for key, value in _strings(data) if key == "Regex")


def _check_context_length(context_length) -> int:
    if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < 2:
        raise ValueError(f"context_length must be an integer >= 2 (room for [CLS] and [SEP]); got {context_length!r}")
    return context_length


def _check_texts(texts: list) -> None:
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(
                f"caption {index} is a {type(text).__name__} ({text!r:.60}), not a str; "
                f"pass captions as Python strings"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # a lone surrogate (bytes that were not UTF-8, read as surrogateescape)
            raise UserError(f"caption {index} ({text!r:.60}) is not valid text: it holds a lone surrogate at "
                            f"character {error.start}; give UTF-8 text") from None


def _parse_vocab_text(text: str, path: Path) -> dict[str, int]:
    """vocab.txt -> {token: line number}; rejects files that do not look like one."""
    tokens = text.splitlines()
    if tokens and tokens[-1] == "":
        tokens.pop()
    expected = "expected a BERT vocab.txt (one token per line, no spaces) or a tokenizer.json"
    if not tokens:
        raise ValueError(f"{str(path)!r} is empty; {expected}")
    for line_number, token in enumerate(tokens):
        if token == "" or token != token.strip() or any(character.isspace() for character in token):
            raise ValueError(f"{str(path)!r} line {line_number + 1} is {token!r}, not a single token; {expected}")
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        duplicates = [token for token, count in collections.Counter(tokens).items() if count > 1]
        raise ValueError(f"{str(path)!r} lists tokens more than once ({duplicates[:5]}); {expected}")
    return vocab


def _choose_base_units(captions: list[str], backend: BackendTokenizer, budget: int) -> tuple[list[str], list[str]]:
    """Pick the characters a trained vocabulary starts from, within `budget` tokens.

    Returns (alphabet, continuations): single characters, and sorted "##x" for those characters
    that occur inside words. The most frequent characters win (ties by code point), each costing
    one token, or two when it also needs its "##" form.
    """
    first_counts: collections.Counter = collections.Counter()  # character at the start of a word
    inner_counts: collections.Counter = collections.Counter()  # character inside a word
    for caption in captions:
        normalized = backend.normalizer.normalize_str(caption)
        for word, _ in backend.pre_tokenizer.pre_tokenize_str(normalized):
            first_counts[word[0]] += 1
            inner_counts.update(word[1:])
    totals = first_counts + inner_counts
    alphabet, continuations = [], []
    for character in sorted(totals, key=lambda c: (-totals[c], ord(c))):
        cost = 2 if character in inner_counts else 1
        if cost > budget:
            continue
        budget -= cost
        alphabet.append(character)
        if character in inner_counts:
            continuations.append(CONTINUATION_PREFIX + character)
    return sorted(alphabet), sorted(continuations)
