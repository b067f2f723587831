"""Using a trained model: topoclip.load (folder or Hub cache), encode, classify, retrieve, `topoclip predict`."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import topoclip
from topoclip.run.training.tokenizer_setup import fit_to_trained_tokenizer
from topoclip.io.checkpoint import save_checkpoint
from topoclip.cli import main
from topoclip.config import load_config
from topoclip.core.errors import UserError
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import Tokenizer

from _reference import CAT, CAT_MISSING
from _tolerance import TINY, fp32_pair, model_roundings

CAPTIONS = ["a photo of a cat", "a photo of a dog", "a red circle", "a blue square on the left", "a car"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Multi(16, 4) model (random weights) with a small trained vocabulary."""
    config = load_config("tiny")
    tokenizer = Tokenizer.train(CAPTIONS, vocab_size=80, context_length=config.model.text.context_length)
    config = fit_to_trained_tokenizer(config, tokenizer)  # as the trainer does (a loaded Config is frozen)
    torch.manual_seed(0)
    return save_checkpoint(tmp_path_factory.mktemp("model") / "ckpt", CLIP(config.model), config, tokenizer)


def images(count=3, seed=0):
    generator = np.random.default_rng(seed)
    return [generator.integers(0, 256, (40 + 8 * i, 48, 3), dtype=np.uint8) for i in range(count)]


def test_load_encode_classify_retrieve(checkpoint):
    clip = topoclip.load(checkpoint)
    model, tokenizer, transform = clip  # unpacks as a 3-tuple
    assert not model.training and isinstance(tokenizer, Tokenizer)
    u, v = clip.encode_image(images()), clip.encode_text(CAPTIONS)
    assert u.shape == (3, 4, 16) and v.shape == (5, 4, 16)
    # on PS(16, 4): every row a unit vector (normalise, then norm: 16 fp32 terms each)
    torch.testing.assert_close(u.norm(dim=-1), torch.ones(3, 4), **fp32_pair(16 + 16))
    # The same pixels through the transform by hand give the same embeddings.
    pixels = torch.stack([transform(image) for image in images()])
    torch.testing.assert_close(clip.encode_image(pixels), u, **fp32_pair(model_roundings(TINY, 3)))

    probabilities = clip.classify(images(), ["cat", "dog", "car"], templates=["a photo of a {}.", "a {}."])
    assert probabilities.shape == (3, 3)
    torch.testing.assert_close(probabilities.sum(dim=1), torch.ones(3), **fp32_pair(3 + 3))  # softmax of 3, summed
    classifier = clip.zero_shot_classifier(["cat", "dog", "car"], ["a photo of a {}.", "a {}."])
    torch.testing.assert_close(clip.classify(images(), classifier), probabilities,
                               **fp32_pair(model_roundings(TINY, 3)))  # the same prompts, embedded again

    # A gallery holding the query itself ranks it first.
    found = clip.retrieve(CAPTIONS[3], CAPTIONS, top_k=2)
    assert found.indices.shape == (1, 2) and found.indices[0, 0] == 3
    found = clip.retrieve(images(2), u, top_k=3)  # image queries against ready embeddings
    assert found.indices[:, 0].tolist() == [0, 1]
    with pytest.raises(TypeError, match="pathlib.Path"):
        clip.encode_image("cat.jpeg")


def test_a_loaded_model_knows_where_it_came_from_and_reads_an_image_batch_array(checkpoint):
    clip = topoclip.load(checkpoint)
    assert clip.checkpoint == checkpoint and clip.run_dir is None and clip.name == checkpoint.name
    assert clip.config.model.topology == "ps-inner"
    batch = np.stack([np.full((40, 48, 3), value, dtype=np.uint8) for value in (0, 128, 255)])  # (B, H, W, 3)
    assert torch.equal(clip.pixels(batch), clip.pixels(list(batch)))
    assert clip.pixels(batch[0]).shape[0] == 1  # (H, W, 3) is one image


def test_flat_vectors_have_the_similarity_as_their_inner_product(checkpoint):
    clip = topoclip.load(checkpoint)  # Multi(16, 4), ps-inner
    u, v = clip.encode_image(images(), flat=True), clip.encode_text(CAPTIONS, flat=True)
    assert u.shape == (3, 64) and v.shape == (5, 64)
    # The similarity of ps-inner is this very matmul of the flattened points: equal, not close.
    assert torch.equal(u @ v.T, clip.model.similarity(clip.encode_image(images()), clip.encode_text(CAPTIONS)))


def test_predict_prints_the_top_labels(checkpoint, capsys):
    if CAT is None:
        pytest.skip(CAT_MISSING)
    assert main(["predict", str(checkpoint), "--image", str(CAT), "--labels", "cat, dog,car", "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == str(CAT) and len(lines) == 3
    shares = [float(line.split("%")[0]) for line in lines[1:]]
    assert shares == sorted(shares, reverse=True) and all(0 <= share <= 100 for share in shares)
    assert {line.split("%")[1].strip() for line in lines[1:]} <= {"cat", "dog", "car"}


def test_predict_user_errors(checkpoint, tmp_path, capsys):
    assert main(["predict", str(checkpoint), "--image", str(tmp_path / "none.jpg"), "--labels", "cat"]) == 2
    assert "cannot read image" in capsys.readouterr().err
    assert main(["predict", str(tmp_path / "absent"), "--image", "x.jpg", "--labels", "cat"]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def fake_hub_cache(root: Path, repo: str, files: dict) -> Path:
    """The Hugging Face cache layout: models--ORG--NAME/{refs/main, snapshots/COMMIT/FILES}."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snapshot = folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        shutil.copy(source, snapshot / name)
    return root


@pytest.mark.slow
def test_hub_repo_loads_offline_from_the_cache(checkpoint, tmp_path):
    pytest.importorskip("huggingface_hub")
    names = ["model.safetensors", "topoclip_config.json", "tokenizer.json"]
    cache = fake_hub_cache(tmp_path / "hub", "someone/tiny-topoclip", {n: checkpoint / n for n in names})
    fake_hub_cache(cache, "someone/no-weights", {"topoclip_config.json": checkpoint / "topoclip_config.json"})
    # A repository pushed with the earlier layout: its config is config.json.
    fake_hub_cache(cache, "someone/earlier", {"model.safetensors": checkpoint / "model.safetensors",
                                              "config.json": checkpoint / "topoclip_config.json"})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")}
    script = ("import topoclip, torch\n"
              "clip = topoclip.load('someone/tiny-topoclip')\n"
              "print(tuple(clip.encode_text(['a cat']).shape))\n"
              "print('earlier', tuple(topoclip.load('someone/earlier').model.embedding_shape))\n"
              "try:\n    topoclip.load('hf-hub:someone/no-weights')\n"
              "except topoclip.core.errors.UserError as error:\n    print('ERROR', error)\n")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "(1, 4, 16)" and lines[1] == "earlier (4, 16)"
    assert lines[2].startswith("ERROR someone/no-weights: model.safetensors is not in the local Hugging Face cache")


def test_missing_tokenizer_is_a_clear_error(checkpoint, tmp_path):
    shutil.copytree(checkpoint, tmp_path / "weights-only")
    (tmp_path / "weights-only" / "tokenizer.json").unlink()
    clip = topoclip.load(tmp_path / "weights-only")
    assert clip.encode_image(images(1)).shape == (1, 4, 16)  # images need no tokenizer
    with pytest.raises(UserError, match="no tokenizer.json"):
        clip.encode_text("a cat")


def test_a_folder_of_the_earlier_layout_still_loads(checkpoint, tmp_path):
    """Folders written before the config was named topoclip_config.json hold config.json."""
    earlier = tmp_path / "earlier"
    shutil.copytree(checkpoint, earlier)
    (earlier / "topoclip_config.json").rename(earlier / "config.json")
    assert topoclip.load(earlier).config.model.class_tokens == topoclip.load(checkpoint).config.model.class_tokens


@pytest.mark.parametrize("topology", ["ps-inner", "lorentz", "lorentz-product"])
def test_classify_and_retrieve_give_plain_tensors(tmp_path, topology):
    """From the hostile test of #61: a hyperbolic similarity reads the learned curvature, a parameter, so classify and
    retrieve returned tensors that required grad (numpy() refused) and kept a graph alive on every call."""
    config = load_config("tiny", [f"model.topology={topology}"])
    tokenizer = Tokenizer.train(CAPTIONS, vocab_size=80, context_length=config.model.text.context_length)
    config = fit_to_trained_tokenizer(config, tokenizer)
    clip = topoclip.load(save_checkpoint(tmp_path / "ckpt", CLIP(config.model), config, tokenizer))
    probabilities = clip.classify(images(), ["cat", "dog", "car"], templates=["a photo of a {}."])
    found = clip.retrieve(CAPTIONS[3], CAPTIONS, top_k=2)
    assert not probabilities.requires_grad and not found.values.requires_grad
    assert probabilities.numpy().shape == (3, 3) and found.values.numpy().shape == (1, 2)
    # plain tensors, not inference-mode ones (the second review): edited in place, a distillation target
    probabilities.mul_(2)
    found.indices.add_(1)
    student = torch.zeros(3, 3, requires_grad=True)
    torch.nn.functional.kl_div(student.log_softmax(-1), probabilities / 2, reduction="batchmean").backward()
    assert student.grad is not None
