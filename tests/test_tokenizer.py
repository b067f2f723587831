"""Tokenizer: BERT WordPiece encoding to fixed-length tensors, loading, training, saving."""
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _reference import ERNIE_MISSING, ERNIE_VOCAB

from topoclip.preprocess.tokenizer import SPECIAL_TOKENS, TextBatch, Tokenizer

needs_ernie = pytest.mark.skipif(ERNIE_VOCAB is None, reason=ERNIE_MISSING)

WORDS = (
    "a photo of the cat dog bird car tree house red blue green small large sitting running "
    "on under next to beach street mountain kitchen two three zebra giraffe elephant yellow"
).split()


def make_captions(count=200, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) for _ in range(count)]


@pytest.fixture(scope="module")
def ernie():
    if ERNIE_VOCAB is None:
        pytest.skip(ERNIE_MISSING)
    return Tokenizer.from_vocab(ERNIE_VOCAB)


@pytest.fixture(scope="module")
def ernie_lines():
    """Token -> id, read straight from the file: the id is the line number."""
    if ERNIE_VOCAB is None:
        pytest.skip(ERNIE_MISSING)
    lines = ERNIE_VOCAB.read_text(encoding="utf-8").splitlines()
    return {token: index for index, token in enumerate(lines)}


@pytest.fixture(scope="module")
def trained():
    return Tokenizer.train(make_captions(), vocab_size=300)


@pytest.fixture(scope="module", params=["ernie", "trained"])
def any_tokenizer(request):
    return request.getfixturevalue(request.param)


# ----- the paper's vocabulary -----


@needs_ernie
def test_ernie_special_ids_match_the_file(ernie, ernie_lines):
    assert ernie.vocab_size == len(ernie_lines) == 30522
    assert (ernie.pad_id, ernie.unk_id, ernie.cls_id, ernie.sep_id) == (
        ernie_lines["[PAD]"], ernie_lines["[UNK]"], ernie_lines["[CLS]"], ernie_lines["[SEP]"]
    )
    assert (ernie.pad_id, ernie.unk_id, ernie.cls_id, ernie.sep_id) == (0, 100, 101, 102)  # README of the file


@needs_ernie
def test_ernie_encodes_a_caption_to_the_vocab_line_numbers(ernie, ernie_lines):
    batch = ernie(["a photo of a cat"])
    words = ["a", "photo", "of", "a", "cat"]
    expected = [ernie_lines["[CLS]"]] + [ernie_lines[word] for word in words] + [ernie_lines["[SEP]"]]
    expected += [ernie_lines["[PAD]"]] * (77 - len(expected))
    assert batch.input_ids[0].tolist() == expected
    assert batch.attention_mask[0].tolist() == [True] * 7 + [False] * 70


@needs_ernie
def test_ernie_lower_cases_and_strips_accents(ernie):
    assert torch.equal(ernie("A PHOTO of a Café").input_ids, ernie("a photo of a cafe").input_ids)


@needs_ernie
def test_ernie_splits_unknown_words_into_continuation_pieces(ernie, ernie_lines):
    assert "topoclip" not in ernie_lines
    batch = ernie("topoclip")
    length = int(batch.attention_mask.sum())
    pieces = batch.input_ids[0, 1 : length - 1].tolist()
    id_to_token = {index: token for token, index in ernie_lines.items()}
    tokens = [id_to_token[piece] for piece in pieces]
    assert len(tokens) > 1 and all(token.startswith("##") for token in tokens[1:])
    assert ernie.unk_id not in pieces
    assert "".join(token.removeprefix("##") for token in tokens) == "topoclip"
    assert ernie.decode(batch.input_ids[0]) == "topoclip"


@needs_ernie
def test_caption_text_cannot_inject_special_tokens(ernie):
    ids = ernie("[SEP] [CLS] [PAD]").input_ids[0]
    assert (ids == ernie.sep_id).sum() == 1 and (ids == ernie.cls_id).sum() == 1
    assert ids[-1] == ernie.pad_id


@needs_ernie
def test_a_tokenizer_json_whose_specials_are_added_tokens_cannot_be_injected_either(ernie, tmp_path):
    """The Hub's BERT tokenizer.json lists [CLS], [SEP], [PAD] as added special tokens, which the library would match
    in the text: read as text all the same."""
    from tokenizers import Tokenizer as BackendTokenizer

    backend = BackendTokenizer.from_str(ernie._backend.to_str())
    backend.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    backend.save(str(tmp_path / "tokenizer.json"))
    loaded = Tokenizer.from_vocab(tmp_path / "tokenizer.json")
    for length in (None, 24):  # the default length and a per-call one (its own copy of the library's tokenizer)
        ids = loaded("[SEP] [CLS] [PAD]", context_length=length).input_ids[0]
        assert torch.equal(ids, ernie("[SEP] [CLS] [PAD]", context_length=length).input_ids[0])
        assert (ids == loaded.sep_id).sum() == 1 and (ids == loaded.cls_id).sum() == 1


# ----- behaviour every tokenizer must have -----


def test_shapes_and_dtypes(any_tokenizer):
    batch = any_tokenizer(["a photo of a cat", "a dog", "two red cars on the street"])
    assert isinstance(batch, TextBatch)
    assert batch.input_ids.shape == batch.attention_mask.shape == (3, any_tokenizer.context_length)
    assert batch.input_ids.dtype == torch.int64 and batch.attention_mask.dtype == torch.bool
    lengths = batch.attention_mask.sum(dim=1)
    for row, length in enumerate(lengths.tolist()):
        assert batch.input_ids[row, 0] == any_tokenizer.cls_id
        assert batch.input_ids[row, length - 1] == any_tokenizer.sep_id
        assert batch.attention_mask[row, :length].all() and not batch.attention_mask[row, length:].any()
        assert (batch.input_ids[row, length:] == any_tokenizer.pad_id).all()
    assert int(batch.input_ids.max()) < any_tokenizer.vocab_size


def test_a_single_string_is_a_batch_of_one(any_tokenizer):
    single = any_tokenizer("a photo of a cat")
    assert len(single) == 1
    assert torch.equal(single.input_ids, any_tokenizer(["a photo of a cat"]).input_ids)


def test_batch_encoding_equals_one_by_one(any_tokenizer):
    captions = make_captions(50, seed=3)
    batch = any_tokenizer(captions)
    for row, caption in enumerate(captions):
        assert torch.equal(batch.input_ids[row], any_tokenizer(caption).input_ids[0])


def test_empty_string_gives_cls_sep_and_padding(any_tokenizer):
    batch = any_tokenizer("")
    assert int(batch.attention_mask.sum()) == 2
    assert batch.input_ids[0, :2].tolist() == [any_tokenizer.cls_id, any_tokenizer.sep_id]
    assert (batch.input_ids[0, 2:] == any_tokenizer.pad_id).all()


def test_long_caption_is_truncated_and_keeps_sep(any_tokenizer):
    caption = " ".join(make_captions(2000, seed=1))[:10_000]
    assert len(caption) == 10_000
    batch = any_tokenizer(caption)
    assert batch.input_ids.shape == (1, any_tokenizer.context_length)
    assert batch.attention_mask.all()
    assert batch.input_ids[0, 0] == any_tokenizer.cls_id and batch.input_ids[0, -1] == any_tokenizer.sep_id
    assert (batch.input_ids[0, 1:-1] != any_tokenizer.sep_id).all()


@pytest.mark.parametrize(
    "caption",
    ["🐱🐶 a cat 🎉", "一只猫坐在桌子上", "قطة تجلس على الطاولة", "кошка сидит на столе", "मेज पर बैठी बिल्ली", "\u200b\x00\ufffd"],
)
def test_emoji_and_other_scripts_do_not_crash(any_tokenizer, caption):
    batch = any_tokenizer(caption)
    length = int(batch.attention_mask.sum())
    assert length >= 2 and batch.input_ids[0, length - 1] == any_tokenizer.sep_id
    assert int(batch.input_ids.min()) >= 0 and int(batch.input_ids.max()) < any_tokenizer.vocab_size


def test_pieces_missing_from_the_vocabulary_become_unk(trained):
    # The trained vocabulary only saw lower-case Latin letters, so Cyrillic cannot be spelled.
    ids = trained("кошка").input_ids[0]
    assert ids[:3].tolist() == [trained.cls_id, trained.unk_id, trained.sep_id]


@needs_ernie
def test_ernie_chinese_characters_are_single_tokens(ernie, ernie_lines):
    assert "日" in ernie_lines and "本" in ernie_lines and "猫" not in ernie_lines
    ids = ernie("日本猫").input_ids[0, :5].tolist()  # each character is its own word; 猫 is not in the vocab
    assert ids == [ernie.cls_id, ernie_lines["日"], ernie_lines["本"], ernie.unk_id, ernie.sep_id]


@pytest.mark.parametrize("bad", [123, None, b"bytes", ["a cat", 7], ["a cat", None]])
def test_non_string_input_is_a_type_error(any_tokenizer, bad):
    with pytest.raises(TypeError, match="str"):
        any_tokenizer(bad)


def test_empty_list_gives_an_empty_batch(any_tokenizer):
    batch = any_tokenizer([])
    assert batch.input_ids.shape == (0, any_tokenizer.context_length) and len(batch) == 0


def test_context_length_override(any_tokenizer):
    default = any_tokenizer.context_length
    short = any_tokenizer(["a photo of a cat sitting on the red car under a tree"] * 2, context_length=6)
    assert short.input_ids.shape == (2, 6) and short.attention_mask.all()
    assert short.input_ids[0, -1] == any_tokenizer.sep_id
    assert any_tokenizer.context_length == default
    assert any_tokenizer("a cat").input_ids.shape == (1, default)
    with pytest.raises(ValueError, match="context_length"):
        any_tokenizer("a cat", context_length=1)


def test_decode_inverts_encoding(any_tokenizer):
    caption = "a photo of the cat sitting on a red car"
    assert any_tokenizer.decode(any_tokenizer(caption).input_ids[0]) == caption
    with pytest.raises(ValueError, match="outside the vocabulary"):
        any_tokenizer.decode([any_tokenizer.vocab_size])
    with pytest.raises(ValueError, match="one sequence"):
        any_tokenizer.decode(any_tokenizer(["a", "b"]).input_ids)


def test_pickles_for_data_loader_workers(any_tokenizer):
    copy = pickle.loads(pickle.dumps(any_tokenizer))
    captions = make_captions(5)
    assert torch.equal(copy(captions).input_ids, any_tokenizer(captions).input_ids)


# ----- TextBatch -----


def test_text_batch_indexing_and_device(trained):
    batch = trained(["a cat", "a red dog", "two birds", "a tree"])
    assert len(batch) == 4
    one = batch[1]
    assert isinstance(one, TextBatch) and one.input_ids.shape == (1, trained.context_length)
    assert torch.equal(one.input_ids[0], batch.input_ids[1])
    assert torch.equal(batch[-1].input_ids[0], batch.input_ids[3])
    part = batch[1:3]
    assert len(part) == 2 and torch.equal(part.attention_mask, batch.attention_mask[1:3])
    moved = batch.to("cpu")
    assert moved.input_ids.device.type == "cpu" and torch.equal(moved.input_ids, batch.input_ids)
    with pytest.raises(ValueError, match="same shape"):
        TextBatch(batch.input_ids, batch.attention_mask[:, :3])


# ----- save and load -----


@pytest.mark.parametrize("as_directory", [True, False])
def test_save_load_round_trip(any_tokenizer, tmp_path, as_directory):
    captions = make_captions(20, seed=2) + ["", "Café 🐱 一只猫"]
    original = Tokenizer.load(any_tokenizer.save(tmp_path / "first.json"), context_length=33)  # non-default length
    target = tmp_path / "saved" if as_directory else tmp_path / "saved" / "tokenizer.json"
    written = original.save(target)
    assert written.is_file() and written.name == "tokenizer.json"
    loaded = Tokenizer.load(target)
    assert loaded.context_length == 33
    assert loaded.vocab_size == original.vocab_size
    assert (loaded.pad_id, loaded.cls_id, loaded.sep_id) == (original.pad_id, original.cls_id, original.sep_id)
    assert torch.equal(loaded(captions).input_ids, original(captions).input_ids)
    assert torch.equal(loaded(captions).attention_mask, original(captions).attention_mask)
    from_vocab = Tokenizer.from_vocab(written)  # from_vocab also reads tokenizer.json
    assert from_vocab.context_length == 33 and torch.equal(from_vocab(captions).input_ids, original(captions).input_ids)


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Tokenizer.load(tmp_path / "nowhere")


# ----- from_vocab errors -----


def test_from_vocab_missing_file_names_the_path(tmp_path):
    path = tmp_path / "missing-vocab.txt"
    with pytest.raises(FileNotFoundError, match="missing-vocab.txt"):
        Tokenizer.from_vocab(path)


@pytest.mark.parametrize(
    "content",
    [b"\x89PNG\r\n\x1a\n\x00\xff\xfe", b"path,caption\nimages/1.jpg,a cat on a mat\n", b"", b'{"not": "a tokenizer"}', b"{broken json"],
)
def test_from_vocab_rejects_other_files(tmp_path, content):
    path = tmp_path / "weird.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="expected"):
        Tokenizer.from_vocab(path)


def test_from_vocab_names_missing_special_tokens(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("[UNK]\na\ncat\n##s\n", encoding="utf-8")
    with pytest.raises(ValueError) as error:
        Tokenizer.from_vocab(path)
    assert "no [PAD], [CLS], [SEP] token" in str(error.value)


def test_from_vocab_small_file_uses_line_numbers(tmp_path):
    lines = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "cat", "##s", "photo"]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenizer = Tokenizer.from_vocab(path, context_length=8)
    ids = tokenizer("a photo cats dog").input_ids[0].tolist()
    index = lines.index
    assert ids == [index("[CLS]"), index("a"), index("photo"), index("cat"), index("##s"), index("[UNK]"), index("[SEP]"), index("[PAD]")]


# ----- training -----


def test_trained_vocab_layout(trained):
    vocab = trained._backend.get_vocab()
    assert [vocab[token] for token in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (trained.pad_id, trained.unk_id, trained.cls_id, trained.sep_id) == (0, 1, 2, 3)
    assert trained.vocab_size <= 300
    assert sorted(vocab.values()) == list(range(len(vocab)))  # no gaps in the ids


def test_trained_vocab_spells_known_words(trained):
    for word in ["giraffe", "kitchen", "elephant", "a photo of the cat"]:
        ids = trained(word).input_ids[0]
        assert trained.unk_id not in ids.tolist()
        assert trained.decode(ids) == word


def test_trained_vocab_respects_a_tiny_size():
    captions = make_captions(50) + ["кошка 一只猫 🐱"]
    tokenizer = Tokenizer.train(captions, vocab_size=12)
    assert tokenizer.vocab_size <= 12
    assert tokenizer(captions).input_ids.max() < tokenizer.vocab_size


def test_training_is_deterministic(trained):
    again = Tokenizer.train(make_captions(), vocab_size=300)
    assert again._backend.get_vocab() == trained._backend.get_vocab()


@pytest.mark.slow
def test_training_is_deterministic_across_processes(trained, tmp_path):
    # Hash-map order differs per process; the trained vocabulary must not.
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_tokenizer as t; "
        "from topoclip.preprocess.tokenizer import Tokenizer; "
        "Tokenizer.train(t.make_captions(), vocab_size=300).save(sys.argv[2])"
    )
    subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path / "other.json")], check=True)
    other = Tokenizer.load(tmp_path / "other.json")
    assert other._backend.get_vocab() == trained._backend.get_vocab()


def test_training_errors():
    with pytest.raises(ValueError, match="empty"):
        Tokenizer.train([], vocab_size=300)
    with pytest.raises(ValueError, match="no text"):
        Tokenizer.train(["", "   "], vocab_size=300)
    with pytest.raises(TypeError, match="caption 1"):
        Tokenizer.train(["a cat", 3], vocab_size=300)
    with pytest.raises(TypeError, match="single string"):
        Tokenizer.train("a cat", vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer.train(["a cat"], vocab_size=5)
