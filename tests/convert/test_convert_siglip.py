"""transformers' SigLIP in, against the real library: a tiny SiglipModel, its SiglipTokenizer (a SentencePiece model
sentencepiece trains here) and its image processor, written by transformers, are imported (`convert --from hf`,
`topoclip.load(folder)`, a pretrained name from an offline Hub cache) and give transformers' own ids, pixels,
embeddings and sigmoid logits for the same strings and image; then they train, upcycle, and are refused by the
exports that cannot hold them."""
import json
import random

import numpy as np
import pytest
import torch
from PIL import Image

from topoclip.cli import main

from _hub import hub_snapshot, offline_env, with_image_size
from _siglip import save_tiny_siglip
from _tolerance import fp32_pair, network_roundings

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")
pytest.importorskip("google.protobuf")  # transformers' SiglipTokenizer reads spiece.model through it

WORDS = "a photo of the red blue green small large square circle triangle cat dog at top left right bottom two".split()
WORDS += ["\u03bf\u03b4\u03bf\u03c2"]  # a Greek word ending in final sigma: Python's lower case writes it so
WORDS += ["고양이", "사진", "café", "naïve"]  # composed forms the character map makes of decomposed ones
TEXTS = ["A photo of a cat.", "  two   RED squares, at the top-left!! ", "dog", "Zebra xylophone café ünïcode",
         "a\tb\nc", "ﬁ ① Ｆｕｌｌ-width", "", "red " * 40]
CONTEXT = 16
# Two fp32 computations of the same embeddings (towers of 2 layers, width 32, 16 positions) in other kernels: within
# the summed rounding bound of their longest reduction chain (tests/_tolerance.py), on any CPU.
BOUND = fp32_pair(network_roundings(layers=2, width=32, context=CONTEXT, batch=len(TEXTS)))


def write_spiece(path):
    """A SentencePiece Unigram model as SigLIP's (</s> = 1, <unk> = 2), trained by sentencepiece on captions."""
    rng = random.Random(0)
    captions = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))).capitalize() + rng.choice([".", "!", ""])
                for _ in range(2000)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(captions), model_prefix=str(path.with_suffix("")),
                                   vocab_size=72, model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   character_coverage=1.0, minloglevel=2)


@pytest.fixture(scope="module")
def siglip_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("siglip") / "tiny-siglip"
    folder.mkdir()
    write_spiece(folder / "spiece.model")
    save_tiny_siglip(folder, vocab_size=72, context=CONTEXT)
    transformers.SiglipTokenizer(str(folder / "spiece.model"), model_max_length=CONTEXT).save_pretrained(folder)
    transformers.SiglipImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.4, 0.5, 0.6],
                                      image_std=[0.2, 0.3, 0.25]).save_pretrained(folder)
    return folder


def photo():
    """A non-square RGB image: resized whole (no crop), as SigLIP's processor does."""
    return Image.fromarray(np.random.default_rng(3).integers(0, 256, (37, 50, 3), dtype=np.uint8))


def theirs(folder, texts, image):
    """transformers' ids, pixels, unit embeddings and logits (text × image) for `texts` and `image`."""
    model = transformers.SiglipModel.from_pretrained(folder).eval()
    processor = transformers.AutoProcessor.from_pretrained(folder)
    inputs = processor(text=texts, images=[image], padding="max_length", max_length=CONTEXT, truncation=True,
                       return_tensors="pt")
    with torch.no_grad():  # input_ids alone: SigLIP was trained with its padding attended (big_vision, OpenCLIP)
        out = model(input_ids=inputs.input_ids, pixel_values=inputs.pixel_values)
    return inputs.input_ids, inputs.pixel_values, out.text_embeds, out.image_embeds, out.logits_per_text[:, 0]


def test_a_siglip_folder_gives_transformers_ids_pixels_embeddings_and_logits(siglip_folder):
    import topoclip
    from topoclip.preprocess.transforms import eval_transform

    clip = topoclip.load(siglip_folder)  # recognised by its config.json, converted in memory
    vision, text = clip.config.model.vision, clip.config.model.text
    assert (vision.pooling, vision.eval_resize, text.pooling, clip.config.train.loss) == ("attention", "squash", "last",
                                                                                          "sigmoid")
    ids, pixels, text_embeds, image_embeds, logits = theirs(siglip_folder, TEXTS, photo())
    ours = clip.tokenizer(TEXTS)
    assert torch.equal(ours.input_ids, ids)  # strings in: the same ids, truncation and padding included
    transform = eval_transform(vision.image_size, vision.mean, vision.std, resize=vision.eval_resize)
    # the same resized uint8 pixels (PIL's bicubic in both), each normalised by one subtraction and one division
    # in fp32: at most a few units of fp32 rounding of values below 4 in magnitude
    torch.testing.assert_close(transform(photo())[None], pixels, rtol=0, atol=4 * 4 * 2**-24)
    with torch.no_grad():
        u, v = clip.model.encode_image(pixels), clip.model.encode_text(ours)
        torch.testing.assert_close(v[:, 0], text_embeds, **BOUND)
        torch.testing.assert_close(u[:, 0], image_embeds, **BOUND)
        scale, bias = clip.model.temperature.scale, clip.model.temperature.bias
        ours_logits = (scale * clip.model.similarity(v, u) + bias)[:, 0]
    # logits: τ (≈ 1 here) times a similarity within BOUND, plus the same bias
    torch.testing.assert_close(ours_logits, logits, rtol=0, atol=4 * float(scale) * BOUND["atol"])


def test_an_image_size_past_a_multiple_of_the_patch_drops_its_last_pixels_as_transformers_does(siglip_folder,
                                                                                              tmp_path):
    """SigLIP SO400M/14 at 384 px is 27 patches a side with 6 pixels left over: a strided convolution reads none of
    them. The same here, at 36 px and patches of 8 (4 left over)."""
    import topoclip

    folder = with_image_size(siglip_folder, tmp_path / "odd", 36)
    clip = topoclip.load(folder)
    assert clip.config.model.vision.image_size == 36
    pixels = torch.randn(2, 3, 36, 36, generator=torch.Generator().manual_seed(5))
    model = transformers.SiglipModel.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = torch.nn.functional.normalize(model.get_image_features(pixel_values=pixels).pooler_output, dim=-1)
        torch.testing.assert_close(clip.model.encode_image(pixels)[:, 0], expected, **BOUND)


def test_the_tokenizer_is_siglip_s_on_hard_strings_and_survives_a_save(siglip_folder, tmp_path):
    """The SentencePiece reader (no sentencepiece, no protobuf) against transformers' SiglipTokenizer: punctuation,
    case, runs of whitespace, NFKC forms, unknown characters, truncation keeping </s>, the empty text; and the same
    ids after tokenizer.json round trip (a run folder's copy)."""
    from topoclip.preprocess.tokenizer import Tokenizer

    theirs_tokenizer = transformers.AutoTokenizer.from_pretrained(siglip_folder)
    ours = Tokenizer.from_sentencepiece(siglip_folder / "spiece.model", context_length=CONTEXT)
    hard = TEXTS + ["Ⅻ ｱｲｳ ½", "don't stop—never", "#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", "x" * 300, "\u00a0 \u3000 a",
                    "\u039f\u0394\u039f\u03a3 cat", "a\x1cb\x1fc", "x\u03a3 a\u0301b\u200bc"]  # final sigma, \x1c–\x1f
    expected = theirs_tokenizer(hard, padding="max_length", max_length=CONTEXT, truncation=True,
                                return_tensors="pt").input_ids
    assert torch.equal(ours(hard).input_ids, expected)
    assert int(expected[3, -1]) == 1  # the long text: truncated, its </s> kept
    saved = ours.save(tmp_path)
    reloaded = Tokenizer.load(saved)
    assert torch.equal(reloaded(hard).input_ids, expected)
    # a tokenizer.json handed over with a damaged character map: refused as read (the Rust library would panic on
    # the first caption, reading past its trie)
    for charsmap in ("AAAAAAAAAAA=", None, 7, "missing"):  # a trie of 0 units, not a string, no map at all
        damaged = json.loads(saved.read_text())
        for step in damaged["normalizer"]["normalizers"]:
            if step["type"] == "Precompiled":
                step["precompiled_charsmap"] = charsmap
                if charsmap == "missing":
                    del step["precompiled_charsmap"]
        (tmp_path / "damaged.json").write_text(json.dumps(damaged))
        with pytest.raises(ValueError, match="character map|precompiled_charsmap") as refused:
            Tokenizer.load(tmp_path / "damaged.json")
        assert "\n" not in str(refused.value)
    assert ours.decode(ours("A photo of a cat.").input_ids[0]) == "a photo of a cat"


def test_the_tokenizer_is_siglip_s_on_random_strings(siglip_folder):
    """Seeded random strings over what normalisation treats apart — whitespace of every kind, punctuation, case
    pairs with special rules, ligatures, decomposed Hangul and combining marks, emoji sequences — give transformers'
    ids (the Rust library's own character-map step, grapheme by grapheme, missed 59 in 4,000 such strings)."""
    import unicodedata

    from topoclip.preprocess.tokenizer import Tokenizer

    alphabet = (list("aAbBcCtT .,!?'\"-_()[]{}/\\@#$%^&*~`|;:+=") + list(" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0"
                "\u1680\u2000\u200a\u2028\u2029\u202f\u205f\u3000\u200b\u180e\ufeff") + list(
                "ΣσςΟΔΑİIıiẞßǅǄǆﬁﬃŉΐΰ¼²ⅫＡｂ！？。、«»‘’“”…–—▁\u0301\u0308\u0327\u200d\u00ad\ua7cb")
                + ["🐱", "猫", "\U0001F468\u200d\U0001F469", "cat", "photo", "red", "café", "naïve"]
                + [unicodedata.normalize("NFD", word) for word in ("고양이", "사진", "café", "naïve")])
    rng = random.Random(0)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))) for _ in range(1500)]
    ours = Tokenizer.from_sentencepiece(siglip_folder / "spiece.model", context_length=CONTEXT)
    expected = transformers.AutoTokenizer.from_pretrained(siglip_folder)(
        texts, padding="max_length", max_length=CONTEXT, truncation=True, return_tensors="pt").input_ids
    different = [text for text, row, theirs in zip(texts, ours(texts).input_ids, expected) if not torch.equal(row, theirs)]
    assert different == []


def test_a_typed_end_token_is_text_not_control(siglip_folder):
    """Unlike transformers (which cuts "</s>" typed in a caption out as the control token), topoclip reads it as
    characters, as its other tokenizers do: a caption cannot end itself early."""
    from topoclip.preprocess.tokenizer import Tokenizer

    ours = Tokenizer.from_sentencepiece(siglip_folder / "spiece.model", context_length=CONTEXT)
    ids = ours("a </s> red cat").input_ids[0].tolist()
    assert ids.index(1) == len([i for i in ids if i != 1])  # one </s>, the last real token


def test_convert_upcycle_and_train_a_siglip_model(siglip_folder, tmp_path, capsys):
    """`convert --from hf` → a topoclip folder that `train --init-from` fine-tunes with SigLIP's loss; upcycled to
    four attention-pooling queries (noise 0), each image token is the single-query model's (queries never see each
    other; the text's m last tokens do attend each other, as BERT-style class tokens do, so text is not exact)."""
    import topoclip

    assert main(["convert", "--from", "hf", str(siglip_folder), str(tmp_path / "converted")]) == 0
    single = topoclip.load(tmp_path / "converted")
    assert main(["convert", "--from", "topoclip", str(tmp_path / "converted"), str(tmp_path / "multi"),
                 "--class-tokens", "4", "--noise", "0"]) == 0
    multi = topoclip.load(tmp_path / "multi")
    assert multi.config.model.class_tokens == 4 and multi.model.visual.head.probe.shape == (4, 32)
    with torch.no_grad():
        pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
        many, one = multi.model.visual(pixels), single.model.visual(pixels)  # (2, 4, 32), (2, 1, 32)
        torch.testing.assert_close(many, one.expand_as(many), **BOUND)
        from topoclip.analysis.probe import class_token_features

        # the linear probe reads the m pooled tokens (the head's output), not ln_post's grid of 16 patches
        assert class_token_features(single.model, pixels).shape == (2, 32)
        assert class_token_features(multi.model, pixels).shape == (2, 4 * 32)
        assert multi.model.encode_text(multi.tokenizer(TEXTS)).isfinite().all()
    out = tmp_path / "run"
    assert main(["train", "--init-from", str(tmp_path / "converted"), "--out", str(out), "--quiet",
                 "--set", "train.steps=2", "--set", "train.batch_size=8", "--set", "evaluate.size=16",
                 "--set", "data.scenes.train_size=64", "--set", "train.num_workers=0"]) == 0
    assert json.loads((out / "config.json").read_text())["train"]["loss"] == "sigmoid"
    trained = topoclip.load(out)
    assert trained.config.model.text.pooling == "last" and trained.encode_text(["a red cat"]).shape == (1, 1, 32)


@pytest.mark.parametrize("flag", ["--openclip", "--hf"])
def test_exports_that_cannot_hold_siglip_refuse_in_one_line(siglip_folder, tmp_path, capsys, flag):
    assert main(["convert", "--from", "hf", str(siglip_folder), str(tmp_path / "converted")]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "converted"), flag, str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "SigLIP's layout" in error and "model.vision.pooling=\"attention\"" in error
    assert not (tmp_path / "out").exists()


def test_a_siglip_model_exports_to_onnx_with_its_embeddings(siglip_folder, tmp_path):
    pytest.importorskip("onnxruntime")
    import topoclip

    clip = topoclip.load(siglip_folder)
    assert main(["convert", "--from", "hf", str(siglip_folder), str(tmp_path / "converted")]) == 0
    assert main(["export", str(tmp_path / "converted"), "--onnx", str(tmp_path / "onnx")]) == 0
    import onnxruntime

    files = sorted((tmp_path / "onnx").glob("*.onnx"))
    assert files, list((tmp_path / "onnx").iterdir())
    text_file = next(file for file in files if "text" in file.name)
    session = onnxruntime.InferenceSession(str(text_file))
    batch = clip.tokenizer(TEXTS)
    feeds = {item.name: (batch.input_ids if "ids" in item.name else batch.attention_mask).numpy().astype(np.int64)
             for item in session.get_inputs()}
    (exported,) = session.run(None, feeds)[:1]
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(exported).reshape(len(TEXTS), -1),
                                   clip.model.encode_text(batch).reshape(len(TEXTS), -1), **BOUND)


def test_a_folder_without_its_tokenizer_or_head_is_one_line(siglip_folder, tmp_path, capsys):
    """No spiece.model and a tokenizer.json that is not Gemma's, a damaged spiece.model, a vision tower without its head."""
    import shutil

    cases = {}
    for case in ("gemma", "damaged", "headless"):
        folder = tmp_path / case
        shutil.copytree(siglip_folder, folder)
        cases[case] = folder
    (cases["gemma"] / "spiece.model").unlink()
    (cases["gemma"] / "tokenizer.json").write_text("{}")
    data = (cases["damaged"] / "spiece.model").read_bytes()
    (cases["damaged"] / "spiece.model").write_bytes(data[: len(data) // 2])
    config = json.loads((cases["headless"] / "config.json").read_text())
    config["vision_config"]["vision_use_head"] = False
    (cases["headless"] / "config.json").write_text(json.dumps(config))
    expected = {"gemma": "not Gemma's tokenizer", "damaged": "is the file whole", "headless": "vision_use_head"}
    for case, folder in cases.items():
        capsys.readouterr()
        assert main(["convert", "--from", "hf", str(folder), str(tmp_path / f"out-{case}")]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and expected[case] in error, error
        assert not (tmp_path / f"out-{case}").exists()


@pytest.mark.parametrize("key, damaged", [
    ("text_model.encoder.layers.0.self_attn.k_proj.weight", torch.zeros(32, 16)),
    ("text_model.encoder.layers.0.self_attn.k_proj.weight", torch.zeros(32)),
    ("logit_scale", torch.zeros(2)), ("logit_bias", torch.zeros(())),
    ("vision_model.head.probe", torch.zeros(())), ("text_model.head.weight", torch.zeros(2, 32, 32)),
    ("vision_model.post_layernorm.weight", torch.zeros(20000)),
    ("logit_scale", torch.tensor([710.0])), ("logit_bias", torch.tensor([float("nan")])),  # e^710 overflows a float
])
def test_weights_that_do_not_fit_their_config_are_one_line(siglip_folder, tmp_path, capsys, monkeypatch, key, damaged):
    """Each tensor is held to its shape before it is joined, transposed or reshaped, and the identity projection is
    never larger than a weight the file holds (a 316 KB file once asked for 1.9 GB)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "damaged"
    shutil.copytree(siglip_folder, folder)
    state = load_file(str(folder / "model.safetensors"))
    state[key] = damaged
    save_file(state, str(folder / "model.safetensors"))
    eye = torch.eye
    monkeypatch.setattr(torch, "eye", lambda n, *args, **kwargs: eye(n, *args, **kwargs) if n <= 32 else pytest.fail(
        f"an identity of {n} rows"))
    assert main(["convert", "--from", "hf", str(folder), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and ("do not fit" in error or "not a trained model" in error), error
    assert not (tmp_path / "out").exists()


def test_a_folder_that_leads_out_or_asks_for_another_pooling_is_one_line(siglip_folder, tmp_path, capsys):
    """spiece.model through a link out of the folder is refused as every other file of it is; a text pooling its
    tokenizer cannot feed is refused at conversion, not only at training; a character map past its bound is said."""
    import os
    import shutil

    folder = tmp_path / "linked"
    shutil.copytree(siglip_folder, folder)
    (tmp_path / "outside.model").write_bytes((folder / "spiece.model").read_bytes())
    (folder / "spiece.model").unlink()
    os.symlink(tmp_path / "outside.model", folder / "spiece.model")
    assert main(["convert", "--from", "hf", str(folder), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "link" in error and error.count("spiece.model") == 1, error
    assert main(["convert", "--from", "hf", str(siglip_folder), str(tmp_path / "out"), "--set",
                 "model.text.pooling=class_tokens"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "keeps model.text.pooling=last" in error, error
    big = tmp_path / "big"
    shutil.copytree(siglip_folder, big)
    # a second normalizer spec (protobuf field 3: tag 0x1a) after the first, its character map (3.2: tag 0x12) 2 MiB;
    # lengths as protobuf varints: 2^21 and 2^21 + 5
    charsmap = bytes([0x12, 0x80, 0x80, 0x80, 0x01]) + bytes(2**21)
    (big / "spiece.model").write_bytes((big / "spiece.model").read_bytes() + bytes([0x1a, 0x85, 0x80, 0x80, 0x01])
                                       + charsmap)
    assert main(["convert", "--from", "hf", str(big), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "character map is 2,097,152 bytes" in error, error


def test_a_siglip_name_loads_from_an_offline_hub_cache(siglip_folder, tmp_path):
    """`ViT-B-16-SigLIP:webli` -> google/siglip-base-patch16-224 (transformers' layout) in the Hugging Face cache,
    offline -> converted once into TOPOCLIP_CACHE with its SentencePiece tokenizer -> transformers' embeddings."""
    import subprocess
    import sys

    pytest.importorskip("huggingface_hub")
    hub_snapshot(tmp_path / "hub", "google/siglip-base-patch16-224", siglip_folder)
    env = offline_env(tmp_path)
    script = ("import topoclip\n"
              "clip = topoclip.load('ViT-B-16-SigLIP:webli')\n"
              f"print(clip.encode_text({TEXTS!r})[:, 0].tolist())\n")
    loaded = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    _, _, text_embeds, _, _ = theirs(siglip_folder, TEXTS, photo())
    torch.testing.assert_close(torch.tensor(json.loads(loaded.stdout.strip().splitlines()[-1])), text_embeds, **BOUND)
    converted = tmp_path / "topoclip-cache" / "pretrained" / "ViT-B-16-SigLIP--webli" / "main"
    assert (converted / "tokenizer.json").is_file()
