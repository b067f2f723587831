"""SigLIP 2 in, against the real library: a tiny SiglipModel written by transformers beside a Gemma-style tokenizer.json
(byte-level BPE with byte fallback, Gemma's special tokens, an added special token and an added ordinary one, built
with the `tokenizers` library here) gives transformers' Siglip2Tokenizer's ids and transformers' embeddings, for each
framing a tokenizer.json can say (Gemma's `<bos> $A`, `$A <eos>`, none) and each padding side tokenizer_config.json
can say; by name from an offline Hub cache; refused in one line where the files say what topoclip does not read."""
import json
import random

import pytest
import torch

from topoclip.cli import main

from _hub import hub_snapshot, offline_env
from _siglip import save_tiny_siglip
from _tolerance import fp32_pair, network_roundings

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
Siglip2Tokenizer = pytest.importorskip("transformers.models.siglip2.tokenization_siglip2").Siglip2Tokenizer

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]  # Gemma's ids 0-4
WORDS = "a photo of the red blue green small large square circle cat dog at top left right two".split()
TEXTS = ["A Photo of a CAT.", "  two   RED squares, at the top-left!! ", "dog", "Zebra café ünïcode 猫 ΟΔΟΣ", "a\tb\nc",
         "<table> <TABLE> html", "", "red " * 40, "İstanbul ﬁ ①"]
CONTEXT = 16
# Two fp32 computations of the same embeddings (towers of 2 layers, width 32, 16 positions) in other kernels: within
# the summed rounding bound of their longest reduction chain (tests/_tolerance.py), on any CPU.
BOUND = fp32_pair(network_roundings(layers=2, width=32, context=CONTEXT, batch=len(TEXTS)))
FRAMINGS = {"gemma": "<bos> $A", "end": "$A <eos>", "both": "<bos> $A <eos>", "none": None}


def write_gemma(folder, framing="<bos> $A", padding_side=None):
    """tokenizer.json as Gemma's (BPE over the text with spaces written ▁, byte fallback to <0xNN>, its specials first,
    the post-processor `framing`) and tokenizer_config.json as SigLIP 2's repositories name it (GemmaTokenizer)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    rng = random.Random(0)
    captions = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(500)]
    backend = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIALS + [f"<0x{i:02X}>" for i in range(256)],
                                  show_progress=False)
    backend.train_from_iterator(captions, trainer)
    backend.add_special_tokens([AddedToken("<start_of_turn>", special=True, normalized=False)])
    backend.add_tokens([AddedToken("<table>", special=False, normalized=False)])
    if framing is not None:
        names = [part for part in framing.split() if part != "$A"]
        backend.post_processor = processors.TemplateProcessing(
            single=framing, special_tokens=[(name, backend.token_to_id(name)) for name in names])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "GemmaTokenizer", "add_bos_token": False, "add_eos_token": True,
                "pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>",
                "model_max_length": CONTEXT}
    if padding_side is not None:
        settings["padding_side"] = padding_side
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return backend.get_vocab_size(with_added_tokens=True)


def write_siglip2(folder, framing="<bos> $A", padding_side=None):
    """A SigLIP 2 fixed-resolution folder: transformers' SiglipModel, its image processor, Gemma's tokenizer."""
    folder.mkdir(parents=True)
    vocab = write_gemma(folder, framing, padding_side)
    save_tiny_siglip(folder, vocab_size=vocab, context=CONTEXT)
    transformers.SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def siglip2_folder(tmp_path_factory):
    return write_siglip2(tmp_path_factory.mktemp("siglip2") / "tiny-siglip2")


def their_ids(folder, texts):
    """transformers' Siglip2Tokenizer (Gemma's BPE, lower case; AutoTokenizer's class for SigLIP 2), padded to the
    context as SigLIP 2's processor asks."""
    tokenizer = Siglip2Tokenizer.from_pretrained(folder)
    return torch.tensor(tokenizer(texts, padding="max_length", max_length=CONTEXT, truncation=True)["input_ids"])


def random_texts(count, seed=0):
    rng = random.Random(seed)
    alphabet = "aAbBcCdDrReE tT.,!?<>/é猫\n\t_-İΣς0123456789"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40))) for _ in range(count)]


@pytest.mark.parametrize("framing", sorted(FRAMINGS))
@pytest.mark.parametrize("side", [None, "right"])
def test_the_tokenizer_is_siglip2_s_for_each_framing_and_padding_side(tmp_path, framing, side):
    """The same ids as transformers on hard strings (case, punctuation, whitespace runs, bytes outside the vocabulary,
    an added token typed in either case, truncation keeping the framing, the empty text) and 500 random ones; the
    same again after the tokenizer is saved and loaded."""
    from topoclip.io.convert.siglip import siglip_tokenizer
    from topoclip.preprocess.tokenizer import Tokenizer

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    write_gemma(folder, FRAMINGS[framing], side)
    ours = siglip_tokenizer(folder, CONTEXT)
    texts = TEXTS + random_texts(500)
    ids = their_ids(folder, texts)
    assert torch.equal(ours(texts).input_ids, ids)
    assert ours.padding_side == (side or "left")
    assert torch.equal(Tokenizer.load(ours.save(tmp_path / "saved")).__call__(texts).input_ids, ids)


@pytest.mark.parametrize("change", ["continuing_subword_prefix", "end_of_word_suffix", "openai_tokens",
                                    "agreeing_added_tokens_decoder"])
def test_what_transformers_does_not_read_of_the_file_topoclip_does_not_either(tmp_path, change):
    """transformers builds Gemma's BPE from the file's vocabulary and merges alone (a word prefix or suffix in the
    file is not read: it crashed the Rust library or changed the ids), frames a text as the file's post-processor
    says even when the vocabulary holds OpenAI's <|startoftext|>, and reads an added_tokens_decoder that agrees."""
    from topoclip.io.convert.siglip import siglip_tokenizer

    folder = tmp_path / change
    folder.mkdir()
    write_gemma(folder, "<bos> $A <eos>")
    data = json.loads((folder / "tokenizer.json").read_text())
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    if change == "openai_tokens":
        for name in ("<|startoftext|>", "<|endoftext|>"):
            data["model"]["vocab"][name] = len(data["model"]["vocab"]) + len(data["added_tokens"])
    elif change == "agreeing_added_tokens_decoder":
        settings["added_tokens_decoder"] = {str(entry["id"]): entry for entry in data["added_tokens"]}
    else:
        data["model"][change] = "##" if change == "continuing_subword_prefix" else "</w>"
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    texts = TEXTS + random_texts(200, seed=1)
    assert torch.equal(siglip_tokenizer(folder, CONTEXT)(texts).input_ids, their_ids(folder, texts))


def test_a_bert_style_bpe_with_an_eos_token_keeps_its_cls_framing(tmp_path):
    """Only Gemma's vocabulary (byte fallback, <eos>, no [CLS]) takes SigLIP 2's framing: a BPE tokenizer.json with
    BERT's tokens and an <eos> among its pieces is framed `[CLS] … [SEP]` as before."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import models

    from topoclip.preprocess.tokenizer import Tokenizer

    vocab = {token: index for index, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "<eos>", "a", "b"])}
    BackendTokenizer(models.BPE(vocab, [], unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_vocab(tmp_path / "tokenizer.json", context_length=6)
    assert tokenizer(["ab"]).input_ids.tolist() == [[2, 5, 6, 3, 0, 0]] and tokenizer.padding_side == "right"


def test_a_siglip2_folder_gives_transformers_embeddings(siglip2_folder, tmp_path, capsys):
    """`topoclip.load(folder)` and `convert --from hf` then its checkpoint: Siglip2Tokenizer's ids and SiglipModel's
    text and image embeddings (input_ids alone: padding attended, as SigLIP trains)."""
    import numpy as np
    from PIL import Image

    import topoclip

    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (37, 50, 3), dtype=np.uint8))
    model = transformers.SiglipModel.from_pretrained(siglip2_folder).eval()
    pixels = transformers.SiglipImageProcessor.from_pretrained(siglip2_folder)(images=[image], return_tensors="pt")
    ids = their_ids(siglip2_folder, TEXTS)
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=pixels.pixel_values)
    assert main(["convert", "--from", "hf", str(siglip2_folder), str(tmp_path / "converted")]) == 0
    for clip in (topoclip.load(siglip2_folder), topoclip.load(tmp_path / "converted")):
        batch = clip.tokenizer(TEXTS)
        assert torch.equal(batch.input_ids, ids)
        with torch.no_grad():
            torch.testing.assert_close(clip.model.encode_text(batch)[:, 0], out.text_embeds, **BOUND)
            torch.testing.assert_close(clip.model.encode_image(pixels.pixel_values)[:, 0], out.image_embeds, **BOUND)


def test_a_siglip2_model_trains_and_its_run_keeps_the_tokenizer(siglip2_folder, tmp_path):
    """`convert --from hf`, then `train --init-from` it (its own tokenizer and sigmoid loss): the run's checkpoint
    tokenizes as transformers does, padding on the left included."""
    import topoclip

    out = tmp_path / "run"
    assert main(["convert", "--from", "hf", str(siglip2_folder), str(tmp_path / "converted")]) == 0
    assert main(["train", "--init-from", str(tmp_path / "converted"), "--out", str(out), "--quiet",
                 "--set", "train.steps=2", "--set", "train.batch_size=8", "--set", "evaluate.size=16",
                 "--set", "data.scenes.train_size=64", "--set", "train.num_workers=0"]) == 0
    trained = topoclip.load(out)
    assert trained.config.train.loss == "sigmoid" and trained.tokenizer.padding_side == "left"
    assert torch.equal(trained.tokenizer(TEXTS).input_ids, their_ids(siglip2_folder, TEXTS))
    assert trained.encode_text(TEXTS).isfinite().all()


def test_a_typed_special_token_is_text_not_control(siglip2_folder):
    """"<eos>" or "<bos>" typed in a caption is text to topoclip (a caption cannot frame itself); transformers reads
    it as the control token, so there the ids differ on purpose. An added ordinary token ("<table>") is read as
    transformers reads it."""
    from topoclip.io.convert.siglip import siglip_tokenizer

    ours = siglip_tokenizer(siglip2_folder, CONTEXT)
    typed = ours(["a cat <eos> <bos> <start_of_turn>"]).input_ids[0].tolist()
    assert typed.count(ours._backend.token_to_id("<eos>")) == 0 and typed.count(ours._backend.token_to_id("<bos>")) == 1
    assert torch.equal(ours(["a <table> cat"]).input_ids, their_ids(siglip2_folder, ["a <table> cat"]))


@pytest.mark.parametrize("case, expected", [
    ("two-ends", "at most one special token"), ("pair", "not a template"), ("unknown-special", "not one token"),
    ("side", "padding_side 'middle'"), ("pad", "padding token '<nope>'"), ("truncation", "truncation_side 'left'"),
    ("wordpiece", "not Gemma's tokenizer"), ("none", "no tokenizer"), ("second-text", "second text ($B)"),
    ("file-truncation", "cuts the start"), ("empty-pad", 'pad_token is ""'), ("null-pad", "pad_token is null"),
    ("added-tokens", "added_tokens_decoder and tokenizer.json's added_tokens differ"),
    ("added-token-list", "added_tokens_decoder and tokenizer.json's added_tokens differ")])
def test_what_topoclip_does_not_read_is_one_line(siglip2_folder, tmp_path, capsys, case, expected):
    import shutil

    folder = tmp_path / case
    shutil.copytree(siglip2_folder, folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    if case == "two-ends":
        data["post_processor"]["single"] += [{"SpecialToken": {"id": "<bos>", "type_id": 0}}] * 2
    elif case == "pair":
        data["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    elif case == "unknown-special":
        data["post_processor"]["special_tokens"]["<bos>"]["ids"] = [9999]
    elif case == "side":
        settings["padding_side"] = "middle"
    elif case == "pad":
        settings["pad_token"] = "<nope>"
    elif case == "truncation":
        settings["truncation_side"] = "left"
    elif case == "second-text":
        data["post_processor"]["single"][1] = {"Sequence": {"id": "B", "type_id": 0}}
    elif case == "file-truncation":
        data["truncation"] = {"direction": "Left", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    elif case in ("empty-pad", "null-pad"):
        settings["pad_token"] = "" if case == "empty-pad" else None
    elif case == "added-tokens":  # transformers reads the config's table instead of the file's
        settings["added_tokens_decoder"] = {str(entry["id"]): {**entry, "normalized": True}
                                            for entry in data["added_tokens"]}
    elif case == "added-token-list":  # a field no table of tokens holds
        settings["added_tokens_decoder"] = {str(entry["id"]): {**entry, "content": [entry["content"]]}
                                            for entry in data["added_tokens"]}
    elif case == "wordpiece":
        data["model"] = {"type": "WordPiece", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    if case == "none":
        (folder / "tokenizer.json").unlink()
    capsys.readouterr()
    assert main(["convert", "--from", "hf", str(folder), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and expected in error, error
    assert not (tmp_path / "out").exists()


def test_a_siglip2_name_loads_from_an_offline_hub_cache(siglip2_folder, tmp_path):
    """`ViT-B-16-SigLIP2:webli` -> google/siglip2-base-patch16-224 (SigLIP's layout, Gemma's tokenizer.json, no
    spiece.model) in the Hugging Face cache, offline -> transformers' embeddings."""
    import subprocess
    import sys

    pytest.importorskip("huggingface_hub")
    hub_snapshot(tmp_path / "hub", "google/siglip2-base-patch16-224", siglip2_folder)
    script = ("import topoclip\n"
              "clip = topoclip.load('ViT-B-16-SigLIP2:webli')\n"
              f"print(clip.encode_text({TEXTS!r})[:, 0].tolist())\n")
    loaded = subprocess.run([sys.executable, "-c", script], env=offline_env(tmp_path), capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    model = transformers.SiglipModel.from_pretrained(siglip2_folder).eval()
    with torch.no_grad():
        expected = model.get_text_features(input_ids=their_ids(siglip2_folder, TEXTS))
    expected = getattr(expected, "pooler_output", expected)
    expected = expected / expected.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(torch.tensor(json.loads(loaded.stdout.strip().splitlines()[-1])), expected, **BOUND)
