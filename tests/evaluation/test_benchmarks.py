"""The field's benchmarks: named sets (ImageNet synsets, CIFAR), CLIP_benchmark's WebDataset layout and
result files, the "flat" template mode and flat features (tests with CLIP_benchmark itself:
test_clip_benchmark.py, where it imports)."""
import dataclasses
import io
import json
import math
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from topoclip.run.training.tokenizer_setup import fit_to_trained_tokenizer
from topoclip.io.checkpoint import save_checkpoint
from topoclip.cli import main
from topoclip.config import ConfigError, load_config, validate
from topoclip.data.benchmark_sets import load_wds_set, read_cifar_binary
from topoclip.run.evaluation.benchmarks import get_benchmark, load_classification_entry
from topoclip.run.clip_benchmark import FlatFeatures, output_name
from topoclip.run.evaluation.zeroshot import zero_shot_classifier
from topoclip.core.errors import UserError
from topoclip.core.geometry import flatten, similarity, to_space
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import Tokenizer

SYNSETS = {"n01440764": "tench", "n01443537": "goldfish", "n01484850": "great white shark"}


def image(seed: int, size=(20, 16)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def fake_imagenet(root, per_class: int = 2):
    for index, synset in enumerate(SYNSETS):
        (root / synset).mkdir(parents=True)
        for j in range(per_class):
            image(10 * index + j).save(root / synset / f"ILSVRC2012_val_{index:04d}{j}.JPEG")
    return root


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Multi(16, 4) model with random weights and a vocabulary that knows ImageNet's class names."""
    config = load_config("tiny", ["evaluate.size=16"])  # the built-in scenes' sets, kept small
    tokenizer = Tokenizer.train(list(get_benchmark("imagenet1k").classnames), vocab_size=300,
                                context_length=config.model.text.context_length)
    config = fit_to_trained_tokenizer(config, tokenizer)  # as the trainer does (a loaded Config is frozen)
    return save_checkpoint(tmp_path_factory.mktemp("model") / "ckpt", CLIP(config.model), config, tokenizer)


# --------------------------------------------------------------------------- named benchmarks


def test_the_shipped_lists_are_the_field_s():
    imagenet = get_benchmark("imagenet1k")
    assert len(imagenet.classnames) == len(imagenet.synsets) == 1000 and len(imagenet.templates) == 80
    assert list(imagenet.synsets) == sorted(imagenet.synsets)  # class index = sorted WordNet id
    assert [imagenet.classnames[imagenet.synsets.index(s)] for s in SYNSETS] == list(SYNSETS.values())
    assert imagenet.classnames[-1] == "toilet paper" and imagenet.templates[0] == "a bad photo of a {}."
    assert get_benchmark("cifar10").classnames[:2] == ("airplane", "automobile")
    assert get_benchmark("cifar100").classnames[1] == "aquarium_fish" and len(get_benchmark("cifar100").classnames) == 100
    assert all(template.count("{}") == 1 for name in ("imagenet1k", "cifar10", "cifar100")
               for template in get_benchmark(name).templates)


@pytest.mark.slow
def test_a_fake_imagenet_evaluates_with_the_real_names_and_80_templates(checkpoint, tmp_path, capsys):
    root = fake_imagenet(tmp_path / "val")
    dataset = load_classification_entry(f"imagenet1k={root}")
    assert len(dataset.classnames) == 1000 and len(dataset.templates) == 80  # the classifier spans all 1,000
    assert dataset.labels.tolist() == [0, 0, 1, 1, 2, 2]  # n01440764 is class 0, n01484850 class 2
    assert load_classification_entry(f"imagenet1k={tmp_path}").labels.tolist() == dataset.labels.tolist()  # val/
    out = tmp_path / "results"
    assert main(["eval", str(checkpoint), "--imagenet-val", str(root), "--output", str(out), "--template-mode",
                 "distance", "--set", 'evaluate.template_modes=["distance"]', "--device", "cpu"]) == 0
    assert "imagenet1k" in capsys.readouterr().out
    files = sorted(path.name for path in out.iterdir())
    assert "imagenet1k_ckpt_tiny_en_zeroshot_classification.json" in files
    result = json.loads((out / "imagenet1k_ckpt_tiny_en_zeroshot_classification.json").read_text())
    assert set(result) == {"dataset", "model", "pretrained", "task", "metrics", "language"}
    assert set(result["metrics"]) == {"acc1", "acc5", "mean_per_class_recall"}
    assert all(0 <= value <= 1 for value in result["metrics"].values())


def test_train_imagenet_val_evaluates_imagenet_during_training(tmp_path, capsys):
    assert main(["train", "--preset", "tiny", "--imagenet-val", str(tmp_path), "--print-config"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["evaluate"]["classification"] == [f"imagenet1k={tmp_path}"]  # evaluated at eval_every and at the end


def test_imagenet_folders_that_are_not_synsets_are_named(tmp_path):
    root = fake_imagenet(tmp_path / "val")
    (root / "goldfish").mkdir()
    with pytest.raises(ValueError, match=r"1 folder\(s\) are not imagenet1k classes \(goldfish\); expected WordNet"):
        load_classification_entry(f"imagenet1k={root}")
    assert main(["eval", str(tmp_path), "--imagenet-val", str(tmp_path / "nowhere")]) != 0


def test_cifar_binary_records_and_class_folders(tmp_path):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (3, 3, 32, 32), dtype=np.uint8)  # channel-major, as the binary version
    records = [np.concatenate([[coarse, fine], p.reshape(-1)]) for coarse, fine, p in zip([4, 1, 14], [0, 1, 99], pixels)]
    (tmp_path / "test.bin").write_bytes(np.stack(records).astype(np.uint8).tobytes())
    images, labels = read_cifar_binary(tmp_path, "cifar100")
    assert labels.tolist() == [0, 1, 99]  # the fine label, second byte
    assert np.array_equal(images[2], pixels[2].transpose(1, 2, 0))
    dataset = load_classification_entry(f"cifar100={tmp_path}")
    assert dataset.classnames[99] == "worm" and len(dataset.templates) == 18
    (tmp_path / "test.bin").write_bytes(b"\0" * 3000)
    with pytest.raises(ValueError, match="not a whole number of 3074-byte records"):
        read_cifar_binary(tmp_path, "cifar100")

    folders = tmp_path / "folders"
    for name in ("aquarium_fish", "maple tree"):
        (folders / name).mkdir(parents=True)
        image(1).save(folders / name / "a.png")
    dataset = load_classification_entry(f"cifar100={folders}")
    assert dataset.labels.tolist() == [1, 47]


def write_cifar_python(folder, labels, pixels, label_key=b"fine_labels", file_name="test"):
    """CIFAR's Python version: a pickled dict (protocol 2); bytes keys are how the authors' Python 2 keys read."""
    import pickle

    folder.mkdir(parents=True, exist_ok=True)
    batch = {b"batch_label": b"testing batch 1 of 1", label_key: list(labels), b"coarse_labels": [0] * len(labels),
             b"data": pixels.reshape(len(labels), -1), b"filenames": [b"x.png"] * len(labels)}
    (folder / file_name).write_bytes(pickle.dumps(batch, protocol=2))


@pytest.mark.parametrize("set_name, folder, file_name, label_key", [
    ("cifar100", "cifar-100-python", "test", b"fine_labels"), ("cifar10", "cifar-10-batches-py", "test_batch", "labels")])
def test_cifar_python_version_as_torchvision_downloads_it(tmp_path, set_name, folder, file_name, label_key):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (3, 3, 32, 32), dtype=np.uint8)  # channel-major, as the authors stored them
    write_cifar_python(tmp_path / folder, [0, 1, 9], pixels, label_key, file_name)
    for root in (tmp_path, tmp_path / folder):  # torchvision's root, or the version's own folder
        dataset = load_classification_entry(f"{set_name}={root}")
        assert dataset.labels.tolist() == [0, 1, 9] and len(dataset.templates) == 18
        assert np.array_equal(np.asarray(dataset.images[2]), pixels[2].transpose(1, 2, 0))


def test_a_cifar_pickle_that_names_anything_but_arrays_is_refused_unrun(tmp_path):
    import pickle

    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (__import__("os").system, (f"touch {marker}",))

    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    (folder / "test").write_bytes(pickle.dumps({b"data": Payload(), b"fine_labels": [0]}, protocol=2))
    with pytest.raises(ValueError, match="posix.system|os.system"):
        load_classification_entry(f"cifar100={tmp_path}")
    assert not marker.exists()
    (folder / "test").write_bytes(pickle.dumps({b"data": np.zeros((2, 5), np.uint8), b"fine_labels": [0, 1]}))
    with pytest.raises(ValueError, match="does not hold CIFAR's uint8 pixels"):
        load_classification_entry(f"cifar100={tmp_path}")


# --------------------------------------------------------------------------- CLIP_benchmark's WebDataset layout


def add_member(archive, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    image(seed).save(buffer, format="PNG")
    return buffer.getvalue()


def write_wds(root, samples, kind="classification", shards=1):
    """CLIP_benchmark's layout: ROOT/test/{0..N-1}.tar, nshards.txt, and the metadata beside them."""
    (root / "test").mkdir(parents=True)
    (root / "test" / "nshards.txt").write_text(str(shards))
    per_shard = math.ceil(len(samples) / shards)
    for index in range(shards):
        with tarfile.open(root / "test" / f"{index}.tar", "w") as archive:
            for key, members in samples[index * per_shard:(index + 1) * per_shard]:
                for extension, data in members.items():
                    add_member(archive, f"{key}.{extension}", data)
    if kind == "retrieval":
        (root / "dataset_type.txt").write_text("retrieval\n")
    else:
        (root / "classnames.txt").write_text("cat\ndog\nbird\n")
        (root / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\na drawing of a {c}.\n")
    return root


def test_a_clip_benchmark_classification_folder_is_read_and_bad_samples_counted(tmp_path):
    samples = [(f"s{i:04d}", {"webp" if i % 2 else "png": png(i), "cls": str(i % 3).encode()}) for i in range(7)]
    samples += [("broken", {"png": b"not an image", "cls": b"1"}), ("nolabel", {"png": png(9)}),
                ("badlabel", {"png": png(10), "cls": b"dog"})]
    root = write_wds(tmp_path / "wds_toy", samples, shards=3)
    with pytest.warns(UserWarning, match="bad_label 1.*corrupt_image 1.*unpaired_member 1"):
        dataset = load_classification_entry(str(root))
    assert dataset.name == "wds/toy" and dataset.classnames == ["cat", "dog", "bird"]
    assert dataset.templates == ["a photo of a {}.", "a drawing of a {}."]  # CLIP_benchmark's {c} read as {}
    assert dataset.labels.tolist() == [i % 3 for i in range(7)]
    assert np.asarray(dataset.images[3]).shape == (16, 20, 3)
    assert dataset.images.skipped.bad == {"corrupt_image": 1, "unpaired_member": 1, "bad_label": 1}


def test_a_clip_benchmark_retrieval_folder_is_a_retrieval_set(tmp_path):
    samples = [(f"{i}", {"jpg": png(i), "txt": f"caption {i} a\ncaption {i} b\n".encode()}) for i in range(3)]
    root = write_wds(tmp_path / "wds_flickr", samples, kind="retrieval")
    dataset = load_wds_set(root)
    assert dataset.captions[:3] == ["caption 0 a", "caption 0 b", "caption 1 a"]
    assert dataset.caption_image.tolist() == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="no split 'train'.*splits found: \\['test'\\]"):
        load_wds_set(root, split="train")
    with pytest.raises(ValueError, match="a URL"):
        load_wds_set("https://huggingface.co/datasets/clip-benchmark/wds_flickr8k/tree/main")


@pytest.mark.slow
def test_eval_reads_a_clip_benchmark_folder_named_in_either_list(checkpoint, tmp_path, capsys):
    classes = write_wds(tmp_path / "wds_toy", [(f"{i}", {"png": png(i), "cls": str(i % 3).encode()}) for i in range(6)])
    pairs = write_wds(tmp_path / "wds_pairs", [(f"{i}", {"png": png(i), "txt": b"a cat"}) for i in range(4)],
                      kind="retrieval")
    out = tmp_path / "results"
    assert main(["eval", str(checkpoint), "--set", f'evaluate.classification=["{classes}", "{pairs}"]',
                 "--output", str(out), "--device", "cpu"]) == 0
    names = sorted(path.name for path in out.iterdir() if path.name.startswith(("pairs", "toy")))
    assert names == ["pairs_ckpt_tiny_en_zeroshot_retrieval.json", "toy_ckpt_tiny_en_zeroshot_classification.json"]
    retrieval = json.loads((out / names[0]).read_text())
    assert retrieval["dataset"] == "wds/pairs" and set(retrieval["metrics"]) == {
        f"{d}_retrieval_recall@{k}" for d in ("image", "text") for k in (1, 5, 10)}
    acc5 = json.loads((out / names[1]).read_text())["metrics"]["acc5"]
    assert math.isnan(acc5)  # CLIP_benchmark's: no top-5 under five classes


def test_output_names_follow_clip_benchmark():
    assert output_name("wds/cifar10", "runs/x/", "cpu-multi", "zeroshot_classification") == \
        "cifar10_x_cpu-multi_en_zeroshot_classification.json"  # CLIP_benchmark drops "wds/" from the file name
    assert output_name("vtab/dtd", "a.pt", "m", "zeroshot_retrieval") == "vtab_dtd_a.pt_m_en_zeroshot_retrieval.json"
    with pytest.raises(ConfigError, match="--template-mode chooses the mode of --output"):
        from topoclip.cli.run import command_eval
        import argparse
        command_eval(argparse.Namespace(template_mode="flat", output=None))


# --------------------------------------------------------------------------- flat features and the flat mode


@pytest.mark.parametrize("topology", ["sphere", "ps-inner"])
def test_flat_inner_products_are_the_similarity(topology):
    u, v = (to_space(topology, torch.randn(count, 4, 8, dtype=torch.float64)) for count in (5, 7))
    assert torch.allclose(flatten(topology, u) @ flatten(topology, v).T, similarity(topology, u, v), rtol=0, atol=1e-12)


@pytest.mark.parametrize("topology", ["ps-geodesic", "euclidean"])
def test_topologies_without_a_flat_form_are_refused_in_one_line(topology):
    with pytest.raises(ValueError, match=f"{topology} embeddings have no flat form: its similarity"):
        flatten(topology, torch.zeros(2, 4, 8))
    config = load_config("tiny", [f"model.topology={topology}"])
    with pytest.raises(UserError, match="CLIP_benchmark ranks by the inner product"):
        FlatFeatures(CLIP(config.model))
    config = dataclasses.replace(config, evaluate=dataclasses.replace(config.evaluate, template_modes=["flat"]))
    with pytest.raises(ConfigError, match=f"which {topology} cannot use"):
        validate(config)


def test_the_flat_mode_averages_as_clip_benchmark_does(checkpoint):
    from topoclip.io.checkpoint import load_checkpoint

    model, tokenizer, _ = load_checkpoint(checkpoint)
    names, templates = ["tench", "goldfish", "great white shark"], ["a photo of a {}.", "a {} in the water."]
    texts = FlatFeatures(model).eval()
    with torch.no_grad():
        # CLIP_benchmark's zero_shot_classifier: normalise each prompt's features, average, normalise again.
        expected = torch.stack([torch.nn.functional.normalize(torch.nn.functional.normalize(
            texts.encode_text(tokenizer([t.format(name) for t in templates])).double(), dim=-1).mean(0), dim=0)
            for name in names])
    flat = zero_shot_classifier(model, tokenizer, names, templates, "flat").embeddings.flatten(1)
    # fp32 means of unit vectors against a float64 reference: 2·64 terms per norm, a few ulps each.
    assert torch.allclose(flat.double(), expected, rtol=0, atol=1e-6)
    one = [zero_shot_classifier(model, tokenizer, names, templates[:1], mode) for mode in ("distance", "flat")]
    images = to_space("ps-inner", torch.randn(9, 4, 16))
    assert torch.equal(one[0].scores(model, images).argmax(1), one[1].scores(model, images).argmax(1))


@pytest.mark.slow
def test_a_cifar_pickle_whose_dtype_hides_object_fields_is_refused_and_the_process_survives(tmp_path):
    """A record dtype with an object field, its flags cleared so numpy would take raw bytes for object pointers:
    refused before numpy builds anything (it crashed the process when numpy built it)."""
    import subprocess
    import sys

    script = f"""
import pickle, numpy as np
from numpy._core.multiarray import _reconstruct
class D:
    def __init__(self, flags): self.flags = flags
    def __reduce__(self):
        return (np.dtype, ("V16", False, True), (3, "|", None, ("a", "b"),
                {{"a": (np.dtype("O"), 0), "b": (np.dtype("<i8"), 8)}}, 16, 1, self.flags))
class A:
    def __init__(self, flags): self.flags = flags
    def __reduce__(self):
        return (_reconstruct, (np.ndarray, (0,), b"b"),
                (1, (1,), D(self.flags), False, (0x4141414141414141).to_bytes(8, "little") + bytes(8)))
from topoclip.data.benchmark_sets import read_cifar_python
import pathlib
for flags in (0, 1):
    folder = pathlib.Path({str(tmp_path)!r}) / f"flags{{flags}}"
    folder.mkdir()
    (folder / "test_batch").write_bytes(pickle.dumps({{b"data": A(flags), b"labels": [1]}}, protocol=2))
    try:
        read_cifar_python(folder, "cifar10")
        print("loaded")
    except ValueError as error:
        print("refused", "not plain numbers" in str(error))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]  # no segmentation fault
    assert done.stdout.split() == ["refused", "True", "refused", "True"]
