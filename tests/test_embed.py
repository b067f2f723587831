"""`topoclip embed`: embedding shards with keys, resumable after a kill, bad inputs skipped and counted."""
import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

import topoclip
from topoclip.run.training.tokenizer_setup import fit_to_trained_tokenizer
from topoclip.run import embed as embedding
from topoclip.io.checkpoint import save_checkpoint
from topoclip.cli import main
from topoclip.config import load_config
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import Tokenizer

TEXTS = ["a red circle", "", "a blue square", "a green triangle"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = load_config("tiny")
    tokenizer = Tokenizer.train(TEXTS, vocab_size=60, context_length=config.model.text.context_length)
    config = fit_to_trained_tokenizer(config, tokenizer)  # as the trainer does (a loaded Config is frozen)
    torch.manual_seed(0)
    return save_checkpoint(tmp_path_factory.mktemp("model") / "ckpt", CLIP(config.model), config, tokenizer)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """2,000 small images in two subfolders, and one file that is not an image."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for index in range(2000):
        sub = root / ("a" if index % 2 else "b")
        sub.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)).save(sub / f"{index:05d}.png")
    (root / "a" / "broken.png").write_bytes(b"not a png")
    return root


def shards(out):
    return {path.relative_to(out).as_posix(): path.read_bytes() for path in sorted(out.rglob("*_0*"))}


@pytest.mark.slow
def test_a_killed_embedding_resumes_and_writes_what_an_uninterrupted_run_writes(checkpoint, folder, tmp_path, monkeypatch):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    summary = embedding.embed(checkpoint, whole, images=str(folder), shard_size=500, num_workers=0, progress=False)
    assert summary["images"]["kept"] == 2000 and summary["images"]["bad"] == {"corrupt_image": 1}
    assert sorted(p.name for p in (whole / "img_emb").iterdir())[:2] == ["img_emb_00000.npy", "img_emb_00001.npy"]
    first = np.load(whole / "img_emb" / "img_emb_00000.npy")
    keys = json.loads((whole / "img_emb" / "img_keys_00000.json").read_text())
    assert first.shape == (500, 4, 16) and len(keys) == 500 and keys[0] == "a/00001.png"
    clip = topoclip.load(checkpoint)
    from pathlib import Path

    reference = clip.encode_image([Path(folder / key) for key in keys[:8]])
    assert np.array_equal(first[:8], reference.numpy())  # the same pixels and model: the same numbers

    real_write, calls = embedding.ShardWriter.write, []

    def dies_on_the_third_shard(self, index, *args):
        calls.append(index)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a kill between shards
        return real_write(self, index, *args)

    monkeypatch.setattr(embedding.ShardWriter, "write", dies_on_the_third_shard)
    with pytest.raises(KeyboardInterrupt):
        embedding.embed(checkpoint, resumed, images=str(folder), shard_size=500, num_workers=0, progress=False)
    monkeypatch.setattr(embedding.ShardWriter, "write", real_write)
    again = embedding.embed(checkpoint, resumed, images=str(folder), shard_size=500, num_workers=0, progress=False)
    assert again["images"]["resumed_after_shards"] == 2
    assert shards(resumed) == shards(whole)


def test_embed_cli_texts_flat_csv_and_shards(checkpoint, folder, tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    table = tmp_path / "table.csv"
    table.write_text("filepath\n" + "".join(f"images/{name}\n" for name in ("x.png", "y.png")) + "../secret.png\n")
    (tmp_path / "images").mkdir()
    for name in ("x.png", "y.png"):
        Image.new("RGB", (9, 9), (200, 10, 10)).save(tmp_path / "images" / name)
    out = tmp_path / "out"
    assert main(["embed", str(checkpoint), "--images", str(table), "--texts", str(texts), "--out", str(out),
                 "--flat", "--workers", "2", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "images: 2 embedded of 3 (skipped: path_outside_root 1)" in printed
    assert "texts: 3 embedded of 4 (skipped: empty_caption 1)" in printed
    vectors, keys = np.load(out / "text_emb" / "text_emb_00000.npy"), json.loads((out / "text_emb" / "text_keys_00000.json").read_text())
    assert vectors.shape == (3, 64) and keys == ["1", "3", "4"]
    clip = topoclip.load(checkpoint)
    images, vectors = torch.from_numpy(np.load(out / "img_emb" / "img_emb_00000.npy")), torch.from_numpy(vectors)
    # flat vectors: their inner product is the model's similarity (for ps-inner, the very same torch matmul)
    assert torch.equal(images @ vectors.T, clip.model.similarity(images.view(2, 4, 16), vectors.view(3, 4, 16)))
    assert main(["embed", str(checkpoint), "--texts", str(texts), "--out", str(out), "--quiet"]) == 2  # other settings
    assert "other settings (flat, images)" in capsys.readouterr().err

    with tarfile.open(tmp_path / "0.tar", "w") as archive:
        for key, data in (("k1", (tmp_path / "images" / "x.png").read_bytes()), ("k2", b"junk")):
            info = tarfile.TarInfo(f"{key}.png")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    summary = embedding.embed(checkpoint, tmp_path / "from-shards", images=str(tmp_path / "{0..0}.tar"), progress=False,
                              num_workers=0)
    assert summary["images"]["kept"] == 1 and summary["images"]["bad"] == {"corrupt_image": 1}


def test_flat_embedding_is_refused_for_a_topology_without_a_flat_form(tmp_path, capsys):
    config = load_config("tiny", ["model.topology=ps-geodesic"])
    checkpoint = save_checkpoint(tmp_path / "ckpt", CLIP(config.model), config,
                                 Tokenizer.train(TEXTS, vocab_size=60, context_length=config.model.text.context_length))
    (tmp_path / "t.txt").write_text("a\n")
    assert main(["embed", str(checkpoint), "--texts", str(tmp_path / "t.txt"), "--out", str(tmp_path / "o"), "--flat"]) == 2
    assert "--flat: ps-geodesic embeddings have no flat form" in capsys.readouterr().err
