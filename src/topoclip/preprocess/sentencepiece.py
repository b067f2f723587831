"""SigLIP's tokenizer from its SentencePiece file (``spiece.model``), read without sentencepiece or protobuf.

The file is a protobuf ``ModelProto`` (sentencepiece's ``sentencepiece_model.proto``); topoclip reads the fields a
Unigram tokenizer needs — each piece (1: its text, 2: its score, 3: its type), the trainer's model type (2.3) and
unknown id (2.40), the normalizer's precompiled character map (3.2) and switches (3.3 dummy prefix, 3.4 extra
whitespace, 3.5 whitespace escape) — and builds the same tokenizer in HF ``tokenizers`` as transformers' converter
(``SpmConverter.build_tokenizer_from_spm_proto``) does, in front of it SigLIP's text canonicalization
(transformers' ``SiglipTokenizer.canonicalize_text``, from big_vision: lower case, ASCII punctuation removed,
whitespace runs made one space, the ends stripped). A text becomes ``pieces… </s>`` padded with ``</s>`` to the
context (64): SigLIP's framing, which ``Tokenizer`` recognises by its tokens (no start token).
"""
from __future__ import annotations

import functools
import math
import re
import string
import struct

from tokenizers import Regex
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

SPIECE_END = "</s>"  # SigLIP's end token, and its padding (transformers' SiglipTokenizer: eos_token = pad_token)
SPIECE_SPACE = "▁"  # SentencePiece's visible space
UNIGRAM = 1  # TrainerSpec.model_type of a Unigram model (2 is BPE: not SigLIP's)
# SigLIP's punctuation (Python's string.punctuation, as canonicalize_text removes it) as one character class: a
# pattern without repetition or alternation, linear on any text (tokenizer.KNOWN_PATTERNS lists it as safe).
PUNCTUATION_PATTERN = "[" + "".join("\\" + char for char in string.punctuation) + "]"
# SentencePiece's remove_extra_whitespaces, as transformers' converter writes it: spaces at the ends, runs of spaces.
END_SPACES_PATTERN, SPACE_RUNS_PATTERN = r"\A +| +\z", " {2,}"
PATTERNS = (PUNCTUATION_PATTERN, END_SPACES_PATTERN, SPACE_RUNS_PATTERN)
WHITESPACE_PATTERN = r"\s+"  # canonicalize_text's re.sub(r"\s+", " ", …), as the Rust normalizer writes it
MAX_PIECES = 2**22  # as model.text.vocab_size's bound: a larger vocabulary is no tokenizer topoclip could use
# The largest precompiled character map read: sentencepiece's nmt_nfkc map is 240 KB. Checking one walks every trie
# node in Python (~10 µs each), so the bound is also the bound on that time: about 3 s for a crafted 1 MiB chain.
MAX_CHARSMAP_BYTES = 2**20


def canonicalize(text: str, lowercase: bool) -> str:
    """SigLIP's text canonicalisation, as transformers' SiglipTokenizer.canonicalize_text does it (in Python, so
    Python's own lower case (Greek final sigma) and whitespace (\x1c–\x1f are whitespace to `str.split`) hold):
    lower case, ASCII punctuation removed, runs of whitespace one space, the ends stripped."""
    if lowercase:
        text = text.lower()
    return re.sub(r"\s+", " ", text.translate(PUNCTUATION_TABLE)).strip()


PUNCTUATION_TABLE = str.maketrans("", "", string.punctuation)


class _Reader:
    """Protobuf's wire format over bytes: varints, fixed 32/64-bit numbers, length-delimited fields; every length
    checked against what is left (a damaged file is a ValueError, never a read past the end)."""

    def __init__(self, data: bytes, where: str):
        self.data, self.position, self.where = data, 0, where

    def done(self) -> bool:
        return self.position >= len(self.data)

    def varint(self) -> int:
        value = shift = 0
        while True:
            if self.position >= len(self.data) or shift > 63:
                raise ValueError(f"{self.where} is not a SentencePiece model (a number runs past its end)")
            byte = self.data[self.position]
            self.position += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def take(self, size: int) -> bytes:
        if size > len(self.data) - self.position:
            raise ValueError(f"{self.where} is not a SentencePiece model (a field runs past its end); is the file "
                             f"whole?")
        chunk = self.data[self.position:self.position + size]
        self.position += size
        return chunk

    def fields(self):
        """(field number, wire type, value) in order: value an int (varint), bytes (length-delimited, 32/64-bit)."""
        while not self.done():
            key = self.varint()
            number, wire = key >> 3, key & 7
            if wire == 0:
                yield number, wire, self.varint()
            elif wire == 1:
                yield number, wire, self.take(8)
            elif wire == 2:
                yield number, wire, self.take(self.varint())
            elif wire == 5:
                yield number, wire, self.take(4)
            else:
                raise ValueError(f"{self.where} is not a SentencePiece model (wire type {wire} of field {number})")


def read_model(data: bytes, where: str) -> dict:
    """The parts of a SentencePiece ModelProto a Unigram tokenizer needs: {"pieces": [(text, score, type)],
    "model_type", "unk_id", "charsmap", "dummy_prefix", "extra_whitespace", "escape_whitespace"}."""
    pieces, trainer, normalizer = [], {}, {}
    for number, wire, value in _Reader(data, where).fields():
        if number == 1 and wire == 2:
            piece = {1: b"", 2: 0.0, 3: 1}  # the proto's defaults: empty text, score 0, NORMAL
            for field, kind, item in _Reader(value, where).fields():
                if field == 2 and kind == 5:
                    item = struct.unpack("<f", item)[0]
                if field in piece and type(item) is type(piece[field]):
                    piece[field] = item
            try:
                pieces.append((piece[1].decode("utf-8"), float(piece[2]), piece[3]))
            except UnicodeDecodeError:
                raise ValueError(f"{where}: piece {len(pieces)} is not UTF-8 text; not a SentencePiece model") from None
            if len(pieces) > MAX_PIECES:
                raise ValueError(f"{where} has over {MAX_PIECES:,} pieces; a vocabulary topoclip can use has fewer")
        elif number == 2 and wire == 2:
            trainer = {field: item for field, kind, item in _Reader(value, where).fields() if kind == 0}
        elif number == 3 and wire == 2:
            normalizer = {field: item for field, _, item in _Reader(value, where).fields()}
    if not pieces:
        raise ValueError(f"{where} holds no pieces; not a SentencePiece model (SigLIP's is spiece.model)")
    charsmap = normalizer.get(2, b"")
    return {"pieces": pieces, "model_type": trainer.get(3, UNIGRAM), "unk_id": trainer.get(40, 0),
            "charsmap": charsmap if isinstance(charsmap, bytes) else b"",
            "dummy_prefix": bool(normalizer.get(3, 1)), "extra_whitespace": bool(normalizer.get(4, 1)),
            "escape_whitespace": bool(normalizer.get(5, 1))}


def check_charsmap(blob: bytes, where: str) -> None:
    """ValueError naming `where` unless `blob` passes `charsmap_fault`: a map is checked as it is read (siglip_backend,
    a tokenizer.json) and again where it is used (CharacterMap), so the walk is remembered per map and runs once."""
    fault = charsmap_fault(blob)
    if fault:
        raise ValueError(f"{where}: {fault}")


@functools.lru_cache(maxsize=8)
def charsmap_fault(blob: bytes) -> str:
    """"" when `blob` is a precompiled character map the Rust library reads without indexing past its arrays.

    The map (sentencepiece's normalizer, as `tokenizers`' Precompiled reads it: crate spm_precompiled) is a u32 size,
    a darts-clone double-array trie of that many bytes, then the replacement strings, each ended by NUL. Looking a
    text up walks the trie from unit 0: at a node of base b, byte c leads to unit b ^ c, which matches when its label
    is c; a unit with a leaf names, in the unit at its child's base, where its replacement starts. The library indexes
    all of these unchecked and panics on a map that leads outside (a damaged file does), so every node reachable from
    the root is walked here once, for every byte: all its units inside the trie, every leaf's string starting at a
    character inside the strings; else what is wrong."""
    import numpy as np

    if not 4 <= len(blob) <= MAX_CHARSMAP_BYTES:
        return (f"its character map is {len(blob):,} bytes, not 4 … {MAX_CHARSMAP_BYTES:,} (sentencepiece's own is "
                f"240 KB); not a SentencePiece model topoclip reads")
    size = int.from_bytes(blob[:4], "little")
    if not size or size % 4 or 4 + size > len(blob):
        return (f"its character map's trie is {size} bytes of {len(blob) - 4}; not a SentencePiece model "
                f"sentencepiece wrote")
    units = np.frombuffer(blob[4:4 + size], dtype="<u4").astype(np.int64)
    strings = blob[4 + size:]
    try:
        strings.decode("utf-8")
    except UnicodeDecodeError:
        return "its character map's strings are not UTF-8; not a SentencePiece model"

    def offset(unit):  # darts-clone's DoubleArrayUnit::offset
        return (unit >> 10) << ((unit & (1 << 9)) >> 6)

    damaged = "its character map leads outside itself (is the file whole?); not a SentencePiece model sentencepiece wrote"
    labels = np.arange(256)
    pending, seen = [int(offset(units[0]))], set()
    while pending:
        base = pending.pop()
        if base in seen:
            continue
        seen.add(base)
        if (base | 0xFF) >= len(units):
            return damaged
        positions = base ^ labels
        found = units[positions]
        matched = (found & ((1 << 31) | 0xFF)) == labels  # DoubleArrayUnit::label
        children = positions[matched] ^ offset(found[matched])
        leaves = children[((found[matched] >> 8) & 1) == 1]  # has_leaf
        if leaves.size:
            if int(leaves.max()) >= len(units):
                return damaged
            starts = units[leaves] & ((1 << 31) - 1)  # DoubleArrayUnit::value
            if int(starts.max()) >= len(strings) or any(strings[int(start)] & 0xC0 == 0x80 for start in starts):
                return damaged
        pending.extend(int(child) for child in children)
    return ""


class CharacterMap:
    """sentencepiece's own normalizer over a precompiled character map (normalizer.cc, NormalizePrefix): at each
    point of the text's UTF-8 bytes the longest rule of the trie that matches is replaced by its string, else one
    character is kept. The Rust library's Precompiled step applies the same map one grapheme at a time (and one
    character at a time in graphemes of 6 bytes or more), so it misses rules across graphemes — decomposed Hangul,
    ligatures with combining marks — where sentencepiece, and so transformers' SiglipTokenizer, applies them."""

    MAX_RESULTS = 32  # sentencepiece reads the first 32 matches of a prefix search (kMaxTrieResultsSize)

    def __init__(self, blob: bytes, where: str):
        check_charsmap(blob, where)  # every walk below stays inside the trie and its strings
        size = int.from_bytes(blob[:4], "little")
        self.units = list(struct.unpack(f"<{size // 4}I", blob[4:4 + size]))
        self.strings = blob[4 + size:]

    def _longest(self, data: bytes, start: int) -> tuple[int, int]:
        """(length, string offset) of the longest rule matching data[start:], (0, 0) when none does."""
        units, position = self.units, 0
        position ^= (units[0] >> 10) << ((units[0] & (1 << 9)) >> 6)
        best = (0, 0)
        found = 0
        for index in range(start, len(data)):
            byte = data[index]
            position ^= byte
            unit = units[position]
            if unit & ((1 << 31) | 0xFF) != byte:
                break
            position ^= (unit >> 10) << ((unit & (1 << 9)) >> 6)
            if (unit >> 8) & 1:
                found += 1
                if found > self.MAX_RESULTS:
                    break
                best = (index + 1 - start, units[position] & ((1 << 31) - 1))
        return best

    def normalize(self, text: str) -> str:
        data = text.encode("utf-8")
        out, start = [], 0
        while start < len(data):
            length, offset = self._longest(data, start)
            if length:
                end = self.strings.find(b"\0", offset)  # each string ends with NUL (the last may not)
                out.append(self.strings[offset:end if end >= 0 else len(self.strings)])
                start += length
            else:  # one UTF-8 character as it is (the text is valid UTF-8: its length from the lead byte)
                lead = data[start]
                length = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
                out.append(data[start:start + length])
                start += length
        return b"".join(out).decode("utf-8")


def runs_in_python(step: dict) -> bool:
    """Whether a normalizer step (as tokenizer.json writes it) of a tokenizer siglip_backend built is one that
    `Tokenizer` runs in Python instead (canonicalize, then CharacterMap): Lowercase, the punctuation and whitespace
    Replace, Strip, Precompiled. The Rust library runs the rest (SentencePiece's whitespace handling)."""
    pattern = step.get("pattern")
    return (step.get("type") in ("Lowercase", "Strip", "Precompiled")
            or pattern in ({"Regex": PUNCTUATION_PATTERN}, {"Regex": WHITESPACE_PATTERN}))


def siglip_backend(data: bytes, where: str, lowercase: bool = True) -> BackendTokenizer:
    """The `tokenizers` tokenizer of SigLIP's spiece.model bytes (no framing: Tokenizer adds `pieces </s>`).

    lowercase: transformers' SiglipTokenizer's do_lower_case (True in SigLIP's files)."""
    spec = read_model(data, where)
    if spec["model_type"] != UNIGRAM:
        raise ValueError(f"{where} is a SentencePiece model of type {spec['model_type']}, not Unigram (1): not "
                         f"SigLIP's tokenizer")
    vocab = [(text, score) for text, score, _ in spec["pieces"]]
    unk_id = spec["unk_id"]
    if not 0 <= unk_id < len(vocab) or SPIECE_END not in {text for text, _ in vocab}:
        raise ValueError(f"{where}: its unknown id ({unk_id}) or {SPIECE_END} is not among its {len(vocab)} pieces; "
                         f"not SigLIP's tokenizer")
    # What sentencepiece's own trainer never writes, and the Unigram model of `tokenizers` panics on when tokenizing:
    # an empty piece, a score that is not a finite number, a piece twice.
    bad = next((index for index, (text, score) in enumerate(vocab) if not text or not math.isfinite(score)), None)
    if bad is not None or len({text for text, _ in vocab}) != len(vocab):
        what = f"piece {bad} is empty or scored {vocab[bad][1]}" if bad is not None else "a piece is there twice"
        raise ValueError(f"{where}: {what}; not a SentencePiece model sentencepiece wrote")
    if spec["charsmap"]:
        check_charsmap(spec["charsmap"], where)
    try:
        backend = BackendTokenizer(models.Unigram(vocab, unk_id=unk_id, byte_fallback=False))
        precompiled = [normalizers.Precompiled(spec["charsmap"])] if spec["charsmap"] else []
    except Exception as error:  # the Rust library raises plain Exception
        raise ValueError(f"{where}: {str(error)[:120]}; not a SentencePiece model sentencepiece wrote") from None
    steps = [normalizers.Lowercase()] if lowercase else []
    # canonicalize_text: punctuation out, whitespace runs to one space, the ends stripped
    steps += [normalizers.Replace(Regex(PUNCTUATION_PATTERN), ""), normalizers.Replace(Regex(WHITESPACE_PATTERN), " "),
              normalizers.Strip()]
    steps += precompiled
    if spec["extra_whitespace"]:
        steps += [normalizers.Replace(Regex(END_SPACES_PATTERN), ""), normalizers.Replace(Regex(SPACE_RUNS_PATTERN), " ")]
    if spec["escape_whitespace"]:
        steps.append(normalizers.Replace(" ", SPIECE_SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    if spec["dummy_prefix"]:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_SPACE, prepend_scheme="always", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    return backend
