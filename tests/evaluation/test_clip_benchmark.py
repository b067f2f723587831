"""CLIP_benchmark itself against topoclip: its `build` reads `topoclip eval --output`'s files, and its `eval`
run on a topoclip model (`topoclip benchmark`) over a set its own `convert_dataset` wrote gives the numbers
`topoclip eval` gives on that set.

CLIP_benchmark needs torchvision, which the CPU build of torch cannot import: these tests run in the field lane
(`bash .ci/field`: the CUDA build of torch, which runs on a CPU, torchvision, clip_benchmark and open_clip_torch).
"""
import csv
import json

import pytest
import torch
from PIL import Image

import _reference

from topoclip.cli import main
from topoclip.config import load_config
from topoclip.data.scenes import classification_sets, retrieval_set
from topoclip.run.training.trainer import train

pytestmark = pytest.mark.torchvision


@pytest.fixture(scope="module")
def builder():
    """CLIP_benchmark's own dataset writer (its cli also needs requests, which it does not declare)."""
    pytest.importorskip("clip_benchmark.cli")
    from clip_benchmark import webdataset_builder

    return webdataset_builder


class Listed(list):
    """A list of (image, target) with CLIP_benchmark's optional .classes / .templates attributes."""


def export(builder, dataset, folder, templates=None):
    """Our scenes set written by CLIP_benchmark's own converter (templates in its {c} form)."""
    items = Listed((Image.fromarray(image), int(label)) for image, label in zip(dataset.images, dataset.labels))
    items.classes = list(dataset.classnames)
    items.templates = [template.replace("{}", "{c}") for template in (templates or dataset.templates)]
    builder.convert_dataset(items, "test", str(folder), transform=builder.PIL_to_bytes("png"), verbose=False)
    return folder


@pytest.fixture(scope="module", params=["sphere", "ps-inner"])
def run(request, tmp_path_factory):
    overrides = ["train.steps=60", "evaluate.size=16", "train.eval_every=0"]
    if request.param == "sphere":
        overrides += ["model.topology=sphere", "model.class_tokens=1"]
    return train(load_config("tiny", overrides), out_dir=tmp_path_factory.mktemp("run") / "ckpt", progress=False)


@pytest.fixture(scope="module")
def sets(builder, tmp_path_factory):
    root = tmp_path_factory.mktemp("wds")
    scenes = load_config("tiny").data.scenes
    shape = next(s for s in classification_sets(scenes, "test", 48, include_out_of_domain=False) if s.name == "shape")
    export(builder, shape, root / "wds_shape1", templates=shape.templates[:1])  # one template
    export(builder, shape, root / "wds_shape", templates=shape.templates)  # several: averaged
    pairs = retrieval_set(scenes, "test", 24, captions_per_image=2)
    items = [(Image.fromarray(pairs.images[i]), [c for c, owner in zip(pairs.captions, pairs.caption_image) if owner == i])
             for i in range(len(pairs.images))]
    builder.convert_retrieval_dataset(items, "test", str(root / "wds_pairs"), transform=builder.PIL_to_bytes("png"),
                                      verbose=False)
    (root / "wds_pairs" / "dataset_type.txt").write_text("retrieval\n")  # as CLIP_benchmark's own retrieval sets
    return root


def test_clip_benchmark_on_a_topoclip_run_gives_topoclip_eval_s_numbers(run, sets, tmp_path, monkeypatch):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    names = ["shape1", "shape", "pairs"]
    listed = json.dumps([str(sets / f"wds_{name}") for name in names])
    assert main(["eval", str(run), "--set", f"evaluate.classification={listed}", "--output", str(ours),
                 "--template-mode", "flat", "--device", "cpu"]) == 0
    theirs.mkdir()
    monkeypatch.chdir(theirs)
    for name in names:
        task = ["--task", "zeroshot_retrieval"] if name == "pairs" else []  # CLIP_benchmark infers it from known names only
        assert main(["benchmark", str(run), "--", "--dataset", f"wds/{name}", "--dataset_root", str(sets / f"wds_{name}"),
                     *task, "--no_amp", "--num_workers", "0", "--recall_k", "1", "5", "10", "--quiet"]) == 0
    written = sorted(path.name for path in theirs.iterdir())
    assert len(written) == 3
    for file in written:
        mine, reference = json.loads((ours / file).read_text()), json.loads((theirs / file).read_text())
        assert {k: v for k, v in mine.items() if k != "metrics"} == {k: v for k, v in reference.items() if k != "metrics"}
        assert mine["metrics"].keys() == reference["metrics"].keys()
        for key, value in reference["metrics"].items():
            # Both are the same counts' ratios (hits / queries, or per-class means of such). CLIP_benchmark's
            # retrieval recall is a float32 mean of 0/1 values: an exact sum (< 2^24), then one float32 division,
            # within half a float32 ulp of the exact ratio ≤ 1, i.e. 2^-25; ours is float64. Bound: 2^-24.
            assert mine["metrics"][key] == pytest.approx(value, abs=2**-24), (file, key)


def test_clip_benchmark_build_reads_topoclip_eval_s_files(run, sets, tmp_path, monkeypatch):
    from clip_benchmark import cli

    out = tmp_path / "results"
    assert main(["eval", str(run), "--set", f'evaluate.classification=["{sets / "wds_shape"}"]', "--output", str(out),
                 "--device", "cpu"]) == 0
    files = sorted(str(path) for path in out.iterdir())
    monkeypatch.setattr("sys.argv", ["clip_benchmark", "build", *files, "--output", str(tmp_path / "table.csv")])
    cli.main()
    with open(tmp_path / "table.csv") as table:
        rows = list(csv.DictReader(table))
    assert len(rows) == len(files)
    shape = next(row for row in rows if row["dataset"] == "wds/shape")
    assert shape["model_fullname"] == f"tiny {run}" and 0 <= float(shape["acc1"]) <= 1


def test_a_ps_geodesic_run_is_refused_in_one_line(tmp_path, capsys):
    config = load_config("tiny", ["model.topology=ps-geodesic", "train.steps=1", "evaluate.size=16"])
    run = train(config, out_dir=tmp_path / "geodesic", progress=False)
    assert main(["benchmark", str(run), "--", "--dataset", "cifar10"]) != 0
    assert "no flat form" in capsys.readouterr().err


def test_openclip_s_eval_pixels_equal_the_shortest_resize():
    open_clip = pytest.importorskip("open_clip")
    from topoclip.preprocess.transforms import eval_transform

    preprocess = open_clip.image_transform(224, is_train=False)
    ours = eval_transform(224, resize="shortest")
    if _reference.CAT is None:  # the real photo is shared reference data, not shipped
        pytest.skip(_reference.CAT_MISSING)
    cat = _reference.CAT
    generator = torch.Generator().manual_seed(0)
    images = [Image.open(cat).convert("RGB")] + [
        Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=generator, dtype=torch.uint8).numpy())
        for h, w in [(37, 53), (225, 300), (301, 97), (224, 224), (7, 640)]]
    std = torch.tensor(open_clip.OPENAI_DATASET_STD).view(3, 1, 1)
    for image in images:
        # One uint8 step is 1/255 before normalisation; after it, 1/(255·std).
        assert ((ours(image) - preprocess(image)) * std).abs().max() <= 1 / 255


def test_clip_benchmark_s_numpy_2_4_failure_is_one_line_naming_the_fix(builder, run, sets, monkeypatch, capsys):
    from clip_benchmark import cli

    def as_under_numpy_2_4():  # what clip_benchmark 1.6.2's accuracy() raises there: float() of a 1-element array
        raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

    monkeypatch.setattr(cli, "main", as_under_numpy_2_4)
    assert main(["benchmark", str(run), "--", "--dataset", "wds/x", "--dataset_root", str(sets / "wds_shape"),
                 "--num_workers", "0"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "numpy<2.4" in error and "CLIP_benchmark#147" in error


def test_the_shipped_prompts_are_clip_benchmark_s(builder):
    from pathlib import Path

    from topoclip.run.evaluation.benchmarks import get_benchmark

    shipped = Path(builder.__file__).parent / "datasets"
    names = json.loads((shipped / "en_classnames.json").read_text())
    templates = json.loads((shipped / "en_zeroshot_classification_templates.json").read_text())
    for name in ("imagenet1k", "cifar10", "cifar100"):
        ours = get_benchmark(name)
        assert [template.replace("{}", "{c}") for template in ours.templates] == templates[name]
    assert list(get_benchmark("imagenet1k").classnames) == names["imagenet1k"]


def test_cifar100_s_python_version_scores_as_clip_benchmark_scores_it(builder, run, tmp_path, monkeypatch):
    """The folder torchvision downloads (cifar-100-python: test + meta pickles), read by topoclip and by
    CLIP_benchmark's own cifar100 loader (torchvision's CIFAR100): the same result files, number for number."""
    import pickle

    import numpy as np
    import torchvision

    from topoclip.run.evaluation.benchmarks import get_benchmark

    classnames = list(get_benchmark("cifar100").classnames)
    rng = np.random.default_rng(0)
    labels = [int(label) for label in rng.integers(0, 100, 40)]
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    pixels = rng.integers(0, 256, (40, 3 * 32 * 32), dtype=np.uint8)
    (folder / "test").write_bytes(pickle.dumps({"data": pixels, "fine_labels": labels, "coarse_labels": [0] * 40},
                                               protocol=2))  # str keys: what torchvision's latin-1 reading gives
    # The meta file carries the dataset's own label names, which CLIP_benchmark prompts with as they are.
    (folder / "meta").write_bytes(pickle.dumps({"fine_label_names": classnames}, protocol=2))
    monkeypatch.setattr(torchvision.datasets.CIFAR100, "_check_integrity", lambda self: True)  # not the real files
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args: True)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert main(["eval", str(run), "--set", f'evaluate.classification=["cifar100={tmp_path}"]', "--output", str(ours),
                 "--template-mode", "flat", "--device", "cpu"]) == 0
    theirs.mkdir()
    monkeypatch.chdir(theirs)
    assert main(["benchmark", str(run), "--", "--dataset", "cifar100", "--dataset_root", str(tmp_path), "--no_amp",
                 "--num_workers", "0", "--quiet"]) == 0
    [file] = sorted(path.name for path in theirs.iterdir())
    mine, reference = json.loads((ours / file).read_text()), json.loads((theirs / file).read_text())
    for key, value in reference["metrics"].items():  # ratios of the same counts (see the test above for the bound)
        assert mine["metrics"][key] == pytest.approx(value, abs=2**-24), key


def test_a_one_shard_set_with_clip_benchmark_s_default_workers(run, sets, tmp_path, monkeypatch, capsys):
    """CLIP_benchmark's --num_workers defaults to 4; a set of one shard (what its convert_dataset writes for a small
    set) has fewer shards than workers, which webdataset ≥ 1 refuses in each worker without one: topoclip lowers the
    workers to the shards and says so. A set without its nshards.txt is one line, not CLIP_benchmark's traceback."""
    monkeypatch.chdir(tmp_path)
    code = main(["benchmark", str(run), "--", "--dataset", "wds/shape1", "--dataset_root", str(sets / "wds_shape1"),
                 "--no_amp", "--quiet"])
    error = capsys.readouterr().err
    assert code == 0, error
    assert "--num_workers 1 (was 4)" in error
    [file] = list(tmp_path.glob("*.json"))
    assert 0 <= json.loads(file.read_text())["metrics"]["acc1"] <= 1
    code = main(["benchmark", str(run), "--", "--dataset", "wds/shape1", "--dataset_root", str(tmp_path), "--quiet"])
    error = capsys.readouterr().err
    assert code == 2 and error.count("\n") == 1 and "nshards.txt is missing" in error, error
    # --dataset_root as CLIP_benchmark's template (filled with the name without wds/), and a file of names
    (tmp_path / "names.txt").write_text("wds/shape1\n")
    for dataset in ("wds/shape1", str(tmp_path / "names.txt")):
        for file in tmp_path.glob("*.json"):
            file.unlink()
        code = main(["benchmark", str(run), "--", "--dataset", dataset, "--dataset_root", f"{sets}/wds_{{dataset}}",
                     "--no_amp", "--quiet"])
        error = capsys.readouterr().err
        assert code == 0 and "--num_workers 1 (was 4)" in error, error
    for template in ("{other}", "{dataset.x}", "{dataset[a]}", "{0}"):  # str.format's KeyError, AttributeError, ...
        code = main(["benchmark", str(run), "--", "--dataset", "wds/shape1", "--dataset_root", f"{sets}/{template}"])
        error = capsys.readouterr().err
        assert code == 2 and error.count("\n") == 1 and "{dataset} and {dataset_cleaned} only" in error, error
