"""A topoclip model out to OpenCLIP's files: loaded by the real open_clip in the field lane (`bash .ci/field`),
read back by topoclip's own importer everywhere, refused in one line where OpenCLIP cannot express it."""
import gzip
import json
import re

import pytest
import torch

from topoclip.io.checkpoint import load_checkpoint, save_checkpoint
from topoclip.cli import main
from topoclip.config import load_config
from topoclip.model.clip import CLIP

from _hub import hub_snapshot, offline_env
from _tolerance import TINY, fp32_pair, model_roundings

OPENAI_LAYOUT = ["model.topology=sphere", "model.class_tokens=1", "model.text.attention=causal",
                 "model.text.pooling=end_of_text", "model.text.norm_first=true", "model.text.embedding_norm=false",
                 "model.vision.activation=quick_gelu", "model.text.activation=quick_gelu"]
# Ordinary texts, one longer than the 32-token context (truncated: its end token kept).
TEXTS = ["a red circle left of a blue square", "The GREEN triangle!!", "a photo of the cat", "two small stars",
         " ".join(["a big red circle and a small blue square"] * 6)]
# OpenAI's BPE from a small merges file (topoclip.io.convert.openai): the end-of-text token is the largest id.
MERGES = ["t h", "th e</w>", "a t</w>", "c a", "r e", "re d</w>", "c at</w>", "b l", "bl u", "blu e</w>", "s t",
          "st a", "sta r", "star s</w>"]


def tokenizer_and_config(kind, tmp_path):
    """A WordPiece vocabulary trained here (pooled at its [SEP], model.text.end_token_id), or OpenAI's BPE."""
    if kind == "wordpiece":
        from topoclip.preprocess.tokenizer import Tokenizer

        config = load_config("tiny", OPENAI_LAYOUT)
        tokenizer = Tokenizer.train(TEXTS * 3, vocab_size=config.model.text.vocab_size,
                                    context_length=config.model.text.context_length)
        return tokenizer, load_config("tiny", OPENAI_LAYOUT + [f"model.text.end_token_id={tokenizer.sep_id}",
                                                               f"model.text.cls_token_id={tokenizer.cls_id}"])
    from topoclip.io.convert.openai import bpe_tokenizer

    merges = tmp_path / "bpe_simple_vocab_16e6.txt.gz"
    merges.write_bytes(gzip.compress(("#version: 0.2\n" + "\n".join(MERGES) + "\n").encode()))
    vocab = 2 * 256 + len(MERGES) + 2
    return bpe_tokenizer(merges, vocab, 32), load_config("tiny", OPENAI_LAYOUT + [f"model.text.vocab_size={vocab}",
                                                                                  f"model.text.cls_token_id={vocab - 2}"])


@pytest.fixture(params=["wordpiece", "openai-bpe"])
def exported(request, tmp_path):
    tokenizer, config = tokenizer_and_config(request.param, tmp_path)
    torch.manual_seed(0)
    checkpoint = save_checkpoint(tmp_path / "ckpt", CLIP(config.model), config, tokenizer)
    assert main(["export", str(checkpoint), "--openclip", str(tmp_path / "openclip")]) == 0
    return checkpoint, tmp_path / "openclip"


def test_the_exported_files_read_back_into_the_same_model(exported, tmp_path):
    checkpoint, folder = exported
    cfg = json.loads((folder / "open_clip_config.json").read_text())
    assert cfg["model_cfg"]["quick_gelu"] is True and cfg["preprocess_cfg"]["resize_mode"] == "shortest"
    assert main(["convert", "--from", "openclip", str(folder), str(tmp_path / "back")]) == 0
    model, _, _ = load_checkpoint(checkpoint)
    again, _, config = load_checkpoint(tmp_path / "back")
    assert config.model.vision.eval_resize == "shortest"
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name


def test_transformers_reads_the_exported_tokenizer_with_topoclip_s_ids(exported):
    transformers = pytest.importorskip("transformers")
    checkpoint, folder = exported
    _, tokenizer, _ = load_checkpoint(checkpoint)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    ids = theirs(TEXTS, padding="max_length", max_length=tokenizer.context_length, truncation=True,
                 return_tensors="pt").input_ids
    ours = tokenizer(TEXTS)
    assert torch.equal(ids[ours.attention_mask], ours.input_ids[ours.attention_mask])  # every id up to the end token
    assert set(ids[~ours.attention_mask].tolist()) <= {theirs.pad_token_id}
    assert int(ids[-1, -1]) == tokenizer.sep_id  # the long text is cut before its end token, not through it


@pytest.mark.torchvision
def test_open_clip_tokenizes_and_embeds_strings_as_topoclip_does(exported):
    open_clip = pytest.importorskip("open_clip")
    checkpoint, folder = exported
    model, tokenizer, config = load_checkpoint(checkpoint)
    theirs, _, _ = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    theirs.eval()
    ids = open_clip.get_tokenizer(f"local-dir:{folder}")(TEXTS)
    ours = tokenizer(TEXTS)
    assert torch.equal(ids[ours.attention_mask], ours.input_ids[ours.attention_mask])  # padding: see transformers_config
    images = torch.randn(3, 3, config.model.vision.image_size, config.model.vision.image_size,
                         generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # Two fp32 runs of the same towers in other kernels: within the towers' rounding bound (unit vectors).
        bound = fp32_pair(model_roundings(TINY, 3))
        torch.testing.assert_close(theirs.encode_image(images, normalize=True), model.encode_image(images)[:, 0], **bound)
        torch.testing.assert_close(theirs.encode_text(ids, normalize=True), model.encode_text(ours)[:, 0], **bound)
        assert float(theirs.logit_scale.exp()) == pytest.approx(float(model.temperature.scale), rel=1e-6)


@pytest.mark.parametrize("heads", [(2, 2), (4, 1), (1, 4)])
def test_the_round_trip_keeps_the_heads_and_so_the_features(heads, tmp_path):
    """Failed on main: the importer took width / 64 heads (tiny's towers are 64 wide: one head) and ignored
    open_clip_config.json's head_width and heads, so every model of another head width came back computing other
    features from the same weights (up to 0.036 on unit text vectors)."""
    tokenizer, config = tokenizer_and_config("wordpiece", tmp_path)
    config = load_config("tiny", OPENAI_LAYOUT + [f"model.text.end_token_id={tokenizer.sep_id}",
                                                  f"model.text.cls_token_id={tokenizer.cls_id}",
                                                  f"model.vision.heads={heads[0]}", f"model.text.heads={heads[1]}"])
    torch.manual_seed(0)
    checkpoint = save_checkpoint(tmp_path / "ckpt", CLIP(config.model), config, tokenizer)
    assert main(["export", str(checkpoint), "--openclip", str(tmp_path / "openclip")]) == 0
    assert main(["convert", "--from", "openclip", str(tmp_path / "openclip"), str(tmp_path / "back")]) == 0
    model, _, _ = load_checkpoint(checkpoint)
    again, _, back = load_checkpoint(tmp_path / "back")
    assert (back.model.vision.heads, back.model.text.heads) == heads
    images, text = torch.randn(3, 3, 32, 32), tokenizer(TEXTS)
    with torch.no_grad():  # the same weights and the same computation: the same floats
        assert torch.equal(model.eval().encode_image(images), again.eval().encode_image(images))
        assert torch.equal(model.encode_text(text), again.encode_text(text))


@pytest.mark.torchvision
@pytest.mark.parametrize("head_width, text_heads", [(16, 4), (64, 8)])
def test_a_model_open_clip_builds_at_another_head_width_imports_with_its_features(head_width, text_heads, tmp_path):
    """OpenCLIP's own CLIP from an open_clip_config.json (tiny's sizes, heads of 16 wide; and OpenCLIP's defaults,
    one vision head of 64 and 8 text heads of 8), its weights in OpenCLIP's Hub layout: topoclip's import computes
    its features."""
    open_clip = pytest.importorskip("open_clip")
    from safetensors.torch import save_file

    from topoclip.io.convert.openai import import_openai
    from topoclip.preprocess.tokenizer import TextBatch

    vision_cfg = {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": head_width}
    text_cfg = {"context_length": 32, "vocab_size": 100, "width": 64, "heads": text_heads, "layers": 2}
    torch.manual_seed(0)
    theirs = open_clip.model.CLIP(embed_dim=16, vision_cfg=vision_cfg, text_cfg=text_cfg).eval()
    folder = tmp_path / "openclip"
    folder.mkdir()
    (folder / "open_clip_config.json").write_text(json.dumps({
        "model_cfg": {"embed_dim": 16, "vision_cfg": vision_cfg, "text_cfg": text_cfg},
        "preprocess_cfg": {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}}))
    save_file({name: tensor.contiguous() for name, tensor in theirs.state_dict().items()},
              str(folder / "open_clip_model.safetensors"))
    ours, _, config = import_openai(folder, format="openclip")
    assert (config.model.vision.heads, config.model.text.heads) == (64 // head_width, text_heads)
    # OpenAI's layout: pooled at the largest id (the end of text), zeros after it
    ids = torch.randint(1, 98, (3, 32), generator=torch.Generator().manual_seed(1))
    for row, end in enumerate((5, 17, 31)):
        ids[row, end], ids[row, end + 1:] = 99, 0
    mask = torch.arange(32)[None, :] <= torch.tensor([[5], [17], [31]])
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        bound = fp32_pair(model_roundings(TINY, 3))  # two fp32 runs of the same towers: unit vectors
        torch.testing.assert_close(ours.eval().encode_image(images)[:, 0], theirs.encode_image(images, normalize=True),
                                   **bound)
        torch.testing.assert_close(ours.encode_text(TextBatch(ids, mask))[:, 0], theirs.encode_text(ids, normalize=True),
                                   **bound)


def test_open_clip_s_own_defaults_stand_where_its_config_leaves_the_heads_out(tmp_path, capsys):
    """CLIPVisionCfg's head_width 64 and CLIPTextCfg's heads 8, as open_clip.create_model reads the same file."""
    tokenizer, config = tokenizer_and_config("wordpiece", tmp_path)
    config = load_config("tiny", OPENAI_LAYOUT + [f"model.text.end_token_id={tokenizer.sep_id}",
                                                  "model.vision.heads=1", "model.text.heads=8"])
    checkpoint = save_checkpoint(tmp_path / "ckpt", CLIP(config.model), config, tokenizer)
    folder = tmp_path / "openclip"
    assert main(["export", str(checkpoint), "--openclip", str(folder)]) == 0
    written = json.loads((folder / "open_clip_config.json").read_text())
    del written["model_cfg"]["vision_cfg"]["head_width"], written["model_cfg"]["text_cfg"]["heads"]
    (folder / "open_clip_config.json").write_text(json.dumps(written))
    assert main(["convert", "--from", "openclip", str(folder), str(tmp_path / "back")]) == 0
    _, _, back = load_checkpoint(tmp_path / "back")
    assert (back.model.vision.heads, back.model.text.heads) == (1, 8)
    for section, key, value, reason in [("vision_cfg", "head_width", "64", "must be a whole number ≥ 1"),
                                        ("text_cfg", "heads", 0, "must be a whole number ≥ 1"),
                                        ("text_cfg", "heads", 3, "do not divide its width 64")]:
        broken = json.loads(json.dumps(written))
        broken["model_cfg"][section][key] = value
        (folder / "open_clip_config.json").write_text(json.dumps(broken))
        assert main(["convert", "--from", "openclip", str(folder), str(tmp_path / f"refused-{key}-{value}")]) == 2
        error = capsys.readouterr().err
        assert reason in error and error.count("\n") == 1 and not (tmp_path / f"refused-{key}-{value}").exists()


def test_a_model_pooled_at_a_word_or_without_its_tokenizer_is_refused_in_one_line(tmp_path, capsys):
    tokenizer, config = tokenizer_and_config("wordpiece", tmp_path)
    wrong = load_config("tiny", OPENAI_LAYOUT)  # pooled at the largest id: a word of this vocabulary, not [SEP]
    for folder, tokenizer_given, reason in [(tmp_path / "word", tokenizer, "not its tokenizer's end token"),
                                            (tmp_path / "none", None, "no tokenizer.json")]:
        checkpoint = save_checkpoint(folder, CLIP(wrong.model), wrong, tokenizer_given)
        assert main(["export", str(checkpoint), "--openclip", str(tmp_path / "out")]) == 2
        error = capsys.readouterr().err
        assert reason in error and error.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides, reason", [
    ([], "one class token per tower on one sphere; this model is ps-inner with 4 class tokens"),
    (["model.topology=sphere", "model.class_tokens=1"], "its text tower is BERT-style"),
])
def test_models_openclip_cannot_express_are_refused_in_one_line(tmp_path, capsys, overrides, reason):
    config = load_config("tiny", overrides)
    checkpoint = save_checkpoint(tmp_path / "ckpt", CLIP(config.model), config)
    assert main(["export", str(checkpoint), "--openclip", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert reason in error and error.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.torchvision
def test_a_model_trained_here_exports_to_open_clip_with_its_own_tokenizer(tmp_path):
    """`topoclip train` (its WordPiece vocabulary trained on the captions), `export --openclip`, then OpenCLIP's own
    create_model_and_transforms and get_tokenizer on strings: topoclip's text and image embeddings."""
    open_clip = pytest.importorskip("open_clip")
    import topoclip
    from topoclip.run.training.trainer import train

    run = train(load_config("tiny", OPENAI_LAYOUT + ["train.steps=2", "evaluate.size=16", "train.eval_every=0"]),
                out_dir=tmp_path / "run", progress=False)
    assert main(["export", str(run), "--openclip", str(tmp_path / "openclip")]) == 0
    ours = topoclip.load(run)
    theirs, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'openclip'}")
    theirs.eval()
    ids = open_clip.get_tokenizer(f"local-dir:{tmp_path / 'openclip'}")(TEXTS)
    with torch.no_grad():
        bound = fp32_pair(model_roundings(TINY, len(TEXTS)))
        torch.testing.assert_close(theirs.encode_text(ids, normalize=True), ours.encode_text(TEXTS)[:, 0], **bound)


@pytest.mark.torchvision
def test_a_pretrained_name_in_open_clip_s_hub_layout_loads_with_open_clip_s_features(tmp_path):
    """`ViT-B-16:dfn2b` (apple/DFN2B-CLIP-ViT-B-16: open_clip_config.json and open_clip_model.safetensors, no
    tokenizer; QuickGELU by OpenCLIP's table, not by the file) from an offline cache, with OpenAI's BPE from
    openai/clip-vit-base-patch32's merges.txt: topoclip.load gives the features of OpenCLIP's own CLIP built as
    open_clip.create_model builds that name (quick_gelu=True) for the same ids and pixels."""
    import subprocess
    import sys

    open_clip = pytest.importorskip("open_clip")
    pytest.importorskip("huggingface_hub")
    from safetensors.torch import save_file

    vocab = 512 + len(MERGES) + 2  # byte tokens, their end-of-word forms, the merges, start and end of text
    vision_cfg = {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32}
    text_cfg = {"context_length": 32, "vocab_size": vocab, "width": 64, "heads": 4, "layers": 2}
    torch.manual_seed(0)
    theirs = open_clip.model.CLIP(embed_dim=16, vision_cfg=vision_cfg, text_cfg=text_cfg, quick_gelu=True).eval()
    snapshot = hub_snapshot(tmp_path / "hub", "apple/DFN2B-CLIP-ViT-B-16")
    (snapshot / "open_clip_config.json").write_text(json.dumps({  # no quick_gelu: OpenCLIP's table adds it
        "model_cfg": {"embed_dim": 16, "vision_cfg": vision_cfg, "text_cfg": text_cfg},
        "preprocess_cfg": {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}}))
    save_file({name: tensor.contiguous() for name, tensor in theirs.state_dict().items()},
              str(snapshot / "open_clip_model.safetensors"))
    (hub_snapshot(tmp_path / "hub", "openai/clip-vit-base-patch32") / "merges.txt").write_text(
        "#version: 0.2\n" + "\n".join(MERGES) + "\n")
    env = offline_env(tmp_path)
    script = ("import json, sys, torch, topoclip\n"
              "clip = topoclip.load('ViT-B-16:dfn2b')\n"
              f"ids = clip.tokenizer({TEXTS!r})\n"
              "images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))\n"
              "with torch.no_grad():\n"
              "    print(json.dumps({'ids': ids.input_ids.tolist(), 'text': clip.model.encode_text(ids)[:, 0].tolist(),\n"
              "                      'image': clip.model.encode_image(images)[:, 0].tolist(),\n"
              "                      'activation': clip.config.model.vision.activation}))\n")
    loaded = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    ours = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert ours["activation"] == "quick_gelu"
    ids = torch.tensor(ours["ids"])
    assert int(ids.max()) == vocab - 1  # OpenAI's layout: the end of text is the largest id, where OpenCLIP pools
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    bound = fp32_pair(model_roundings(TINY, len(TEXTS)))  # two fp32 runs of the same towers: unit vectors
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(ours["text"]), theirs.encode_text(ids, normalize=True), **bound)
        torch.testing.assert_close(torch.tensor(ours["image"]), theirs.encode_image(images, normalize=True), **bound)
    assert (tmp_path / "topoclip-cache" / "pretrained" / "ViT-B-16--dfn2b" / "main" / "tokenizer.json").is_file()


@pytest.mark.torchvision
def test_every_pretrained_name_is_open_clip_s_and_its_hub_files_are_open_clip_s():
    """Each name of `topoclip pretrained` is one of open_clip.list_pretrained()'s; where topoclip reads OpenCLIP's
    own Hub files, the repository and the QuickGELU flag are those of OpenCLIP's table; where it reads Google's
    SigLIP repositories, their size, patch and resolution are those of the timm tower OpenCLIP builds for the name."""
    open_clip = pytest.importorskip("open_clip")
    from topoclip.io.pretrained import PRETRAINED

    released = {f"{model}:{tag}" for model, tag in open_clip.list_pretrained()}
    assert sorted(set(PRETRAINED) - released) == []
    for entry in PRETRAINED.values():
        if entry.layout == "openclip":
            model, tag = entry.name.split(":")
            theirs = open_clip.get_pretrained_cfg(model, tag)
            assert (theirs["hf_hub"].rstrip("/"), bool(theirs.get("quick_gelu"))) == (entry.repo, entry.quick_gelu)
        elif entry.repo.startswith(("google/siglip-", "google/siglip2-")):  # e.g. siglip2-giant-opt-patch16-256
            timm_name = open_clip.get_model_config(entry.name.split(":")[0])["vision_cfg"]["timm_model_name"]
            size, patch, pixels = re.fullmatch(r"vit_(\w+)_patch(\d+)_siglip_(\d+)", timm_name).groups()
            repo = re.fullmatch(r"google/siglip2?-([\w-]+)-patch(\d+)-(\d+)", entry.repo).groups()
            # the same tower on the same grid of patches (OpenCLIP's SO400M/14 SigLIP 2 at 378 px, Google's at 384)
            assert (repo[0].replace("-", ""), repo[1], int(repo[2]) // int(repo[1])) == (size, patch,
                                                                                        int(pixels) // int(patch))


def test_an_open_clip_layout_name_without_its_weights_in_the_cache_names_both_files(tmp_path):
    import subprocess
    import sys

    pytest.importorskip("huggingface_hub")
    snapshot = hub_snapshot(tmp_path / "hub", "apple/DFN2B-CLIP-ViT-B-16")
    (snapshot / "open_clip_config.json").write_text("{}")
    env = offline_env(tmp_path)
    refused = subprocess.run([sys.executable, "-m", "topoclip", "train", "--pretrained", "ViT-B-16:dfn2b",
                              "--print-config"], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "neither open_clip_model.safetensors nor open_clip_pytorch_model.bin" in refused.stderr
    assert not (tmp_path / "topoclip-cache" / "pretrained" / "ViT-B-16--dfn2b" / "main").exists()


def test_an_open_clip_layout_name_whose_cached_weights_do_not_fit_says_where_they_are(tmp_path):
    """A name's cached weights that are not OpenCLIP's CLIP: one line naming the repository and the cache, not the
    --from the user never typed."""
    import subprocess
    import sys

    pytest.importorskip("huggingface_hub")
    from safetensors.torch import save_file

    snapshot = hub_snapshot(tmp_path / "hub", "apple/DFN2B-CLIP-ViT-B-16")
    (snapshot / "open_clip_config.json").write_text(json.dumps({"model_cfg": {"embed_dim": 16}}))
    save_file({"not.a.clip.weight": torch.zeros(2)}, str(snapshot / "open_clip_model.safetensors"))
    (hub_snapshot(tmp_path / "hub", "openai/clip-vit-base-patch32") / "merges.txt").write_text(
        "#version: 0.2\n" + "\n".join(MERGES) + "\n")
    env = offline_env(tmp_path)
    refused = subprocess.run([sys.executable, "-m", "topoclip", "train", "--pretrained", "ViT-B-16:dfn2b",
                              "--print-config"], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "apple/DFN2B-CLIP-ViT-B-16 (or openai/clip-vit-base-patch32's merges.txt) is not what" in refused.stderr
    assert "--from" not in refused.stderr
    assert not (tmp_path / "topoclip-cache" / "pretrained" / "ViT-B-16--dfn2b" / "main").exists()
