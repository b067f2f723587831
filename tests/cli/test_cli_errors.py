"""User errors end in one clear line and exit status 2; bugs (and anything with --debug) keep the traceback.

Issue 9 item 5 and issue 7 item 7: on the main branch before this change each case below printed a
16-26-line traceback around its message, because the CLI caught only ConfigError and FileNotFoundError.
"""
import errno
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from topoclip.io.checkpoint import TOKENIZER, WEIGHTS, step_checkpoints
from topoclip.cli import main
from topoclip.config import load_config
from topoclip.core.errors import UserError
from topoclip.io import run_folder
from topoclip.run.training import resume, trainer
from topoclip.run.training.trainer import train

SMALL = ["train.num_workers=0", "train.log_every=1", "train.warmup_steps=1", "evaluate.size=16",
         'evaluate.template_modes=["distance"]', "data.scenes.train_size=2048", "data.scenes.val_size=64",
         "data.scenes.test_size=64"]


def cli(*settings: str) -> list[str]:
    return [part for setting in SMALL + list(settings) for part in ("--set", setting)]


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("topoclip: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished 2-step tiny run (checkpoints at steps 1 and 2); copy it before damaging it."""
    config = load_config("tiny", SMALL + ["train.steps=2", "train.checkpoint_every=1", "train.keep_checkpoints=5"])
    return train(config, out_dir=tmp_path_factory.mktemp("run") / "run", progress=False)


def unfinished_copy(run: Path, to: Path) -> Path:
    """`run` as if killed after its step-1 checkpoint."""
    shutil.copytree(run, to)
    shutil.rmtree(to / "checkpoints" / "step-000002")
    (to / "eval.json").unlink()
    return to


def write_png(path: Path, seed: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


# --------------------------------------------------------------------------- data and evaluation sets


def write_table(folder: Path, good: int, missing: int) -> Path:
    """A CSV of `good` readable images and `missing` rows naming files that do not exist."""
    rows = ["filepath,title"]
    for i in range(good):
        write_png(folder / "img" / f"{i}.png", seed=i)
        rows.append(f"img/{i}.png,a picture number {i} of noise")
    rows += [f"img/missing{i}.png,a picture that is not there" for i in range(missing)]
    path = folder / "pairs.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_too_many_bad_samples_is_one_line(tmp_path, monkeypatch, capsys):
    """main: DataQualityError (a RuntimeError) ended in a traceback around its good message."""
    table = write_table(tmp_path, good=8, missing=8)
    monkeypatch.setattr(trainer, "BAD_FRACTION_MIN_SEEN", 1)
    settings = cli("data.source=csv", f"data.train_data={table}", "train.batch_size=4", "data.max_bad_fraction=0.1",
                   "train.steps=3")
    assert main(["train", "--preset", "tiny", "--quiet", *settings, "--out", str(tmp_path / "out")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "data.max_bad_fraction" in line and "missing_file" in line


@pytest.mark.slow
def test_a_run_with_no_evaluation_sets_says_why(tmp_path, capsys):
    """main printed an empty results table (a header line only) without saying why."""
    table = write_table(tmp_path, good=8, missing=0)
    settings = cli("data.source=csv", f"data.train_data={table}", "train.batch_size=4", "train.steps=1")
    assert main(["train", "--preset", "tiny", "--quiet", *settings, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "no evaluation sets: data.source=csv" in out and "evaluate.classification" in out
    assert "top1/R@1" not in out  # no empty table


def class_folders(root: Path, classes: int, images: int = 2, kind: str = "png") -> Path:
    for c in range(classes):
        for i in range(images):
            path = root / f"class{c}" / f"{i}.{kind}"
            if kind == "png":
                write_png(path, seed=10 * c + i)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("not an image")
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("case, expected", [("empty", "no class subfolders"), ("one class", "one class"),
                                            ("not images", "no usable image")])
def test_an_unusable_evaluation_folder_is_one_line(run, tmp_path, capsys, case, expected):
    """main: an empty or non-image class folder ended in a ValueError traceback; a one-class folder was
    scored (100 % top-1, whatever the model)."""
    root = {"empty": lambda: class_folders(tmp_path / "set", 0),
            "one class": lambda: class_folders(tmp_path / "set", 1),
            "not images": lambda: class_folders(tmp_path / "set", 3, kind="txt")}[case]()
    override = ["--set", f'evaluate.classification=["{root}"]']
    assert main(["eval", str(run), *override]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert expected in line and str(root) in line
    # Training checks the sets before it starts (not after hours of training) and writes nothing.
    out = tmp_path / "out"
    assert main(["train", "--preset", "tiny", "--quiet", *cli("train.steps=1"), *override, "--out", str(out)]) == 2
    assert expected in one_error_line(capsys.readouterr().err)
    assert not out.exists()


# --------------------------------------------------------------------------- damaged run files


@pytest.mark.parametrize("setting", ["model.curvature.init=5", "model.class_tokens=8", "model.topology=sphere"])
def test_a_checkpoints_model_settings_are_its_own_to_eval_and_convert(run, tmp_path, capsys, setting):
    """From the hostile test of #61: `eval --set model.curvature.init=5` or `model.class_tokens=8` were accepted and
    ignored (the weights decide), `model.topology=sphere` blamed another setting. One line, for each command that
    reads a checkpoint with --set."""
    assert main(["eval", str(run), "--set", setting]) == 2
    assert f"eval: a checkpoint's model settings are its own (--set {setting})" in one_error_line(capsys.readouterr().err)
    assert main(["convert", str(run), str(tmp_path / "c"), "--set", setting]) == 2
    assert f"convert: a checkpoint's model settings are its own (--set {setting})" in one_error_line(
        capsys.readouterr().err)
    assert main(["analyze", "cost", str(run), "--set", setting, "--out", str(tmp_path / "a")]) == 2
    assert "analyze cost: --set applies to each --preset; a folder's settings are its own" in one_error_line(
        capsys.readouterr().err)
    assert not (tmp_path / "c").exists() and not (tmp_path / "a").exists()


def test_a_malformed_tokenizer_is_one_line(run, tmp_path, capsys):
    """main: a malformed tokenizer.json ended in a ValueError traceback (eval and --resume)."""
    broken = unfinished_copy(run, tmp_path / "run")
    for path in [broken / TOKENIZER, *(folder / TOKENIZER for folder in step_checkpoints(broken / "checkpoints"))]:
        path.write_text('{"model": {"type": "WordPiece", "vocab": ')
    assert main(["eval", str(broken)]) == 2
    assert "tokenizer.json" in one_error_line(capsys.readouterr().err)
    assert main(["train", "--resume", str(broken), "--quiet"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "the run's tokenizer" in line and "tokenizer.json" in line


def test_weights_of_the_wrong_shape_are_one_line(run, tmp_path, capsys):
    """main: a model.safetensors that does not fit the config ended in a RuntimeError traceback
    ("size mismatch for ...", dozens of lines)."""
    broken = unfinished_copy(run, tmp_path / "run")
    weights = broken / "checkpoints" / "step-000001" / WEIGHTS
    state = load_file(weights)
    state["visual.proj"] = torch.zeros(3, 5)
    save_file(state, weights)
    for command in (["eval", str(broken)], ["train", "--resume", str(broken), "--quiet"]):
        assert main(command) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "visual.proj is (3, 5) in the file but (64, 16) in the config" in line


def test_an_unwritable_run_folder_is_one_line(run, tmp_path, monkeypatch, capsys):
    """main: a run folder that cannot be written (read-only mount, no permission, a file in the way)
    ended in a PermissionError / OSError traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["train", "--preset", "tiny", *cli("train.steps=1"), "--out", str(blocker / "run")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"cannot write to the run folder {blocker / 'run'}" in line and "writable --out" in line

    def read_only(run_dir):
        raise OSError(errno.EROFS, "Read-only file system", str(run_dir / run_folder.LOCK))

    monkeypatch.setattr(run_folder, "_lock", read_only)
    resumable = unfinished_copy(run, tmp_path / "run")
    assert main(["train", "--resume", str(resumable), "--quiet"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "Read-only file system" in line and "make it writable" in line


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0,
                    reason="root may write into a read-only folder")
def test_a_folder_without_write_permission_is_one_line(run, tmp_path, capsys):
    resumable = unfinished_copy(run, tmp_path / "run")
    resumable.chmod(0o555)
    try:
        assert main(["train", "--resume", str(resumable), "--quiet"]) == 2
        assert "Permission denied" in one_error_line(capsys.readouterr().err)
    finally:
        resumable.chmod(0o755)


# --------------------------------------------------------------------------- devices, --debug, bugs


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_one_line(run, tmp_path, capsys):
    """main: train.device=cuda / eval --device cuda ended in "Torch not compiled with CUDA enabled" tracebacks."""
    assert main(["train", "--preset", "tiny", "--set", "train.device=cuda", "--out", str(tmp_path / "out")]) == 2
    assert "train.device='cuda' but CUDA is not available" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()
    assert main(["eval", str(run), "--device", "cuda"]) == 2
    assert "--device='cuda' but CUDA is not available" in one_error_line(capsys.readouterr().err)


def test_debug_shows_the_traceback_and_bugs_keep_theirs(tmp_path, monkeypatch):
    missing = str(tmp_path / "nowhere")
    assert main(["train", "--resume", missing]) == 2
    for argv in (["--debug", "train", "--resume", missing], ["train", "--resume", missing, "--debug"]):
        with pytest.raises(UserError, match="no config.json"):
            main(argv)

    def bug(args):
        raise KeyError("a bug")

    monkeypatch.setattr(resume, "resume_config", lambda *a, **k: bug(None))
    with pytest.raises(KeyError):  # not a user error: the traceback is kept
        main(["train", "--resume", missing])


def test_version(capsys):
    """main had no `topoclip --version`."""
    import topoclip

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"topoclip {topoclip.__version__}"


@pytest.mark.parametrize("workers", [0, 2])
def test_data_with_no_usable_sample_is_one_line(tmp_path, capsys, workers):
    """main: an all-bad CSV ended in `RuntimeError: an epoch ... produced no usable sample`; all-bad resampled
    shards printed a DataLoader worker's whole traceback as the "line"."""
    table = tmp_path / "data.csv"
    table.write_text("filepath,title\n" + "".join(f"missing{i}.png,a caption\n" for i in range(40)))
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path / "csv"), "--quiet", "--set", "data.source=csv",
                 "--set", f"data.train_data={table}", "--set", "data.tokenizer=", "--set", "train.batch_size=4",
                 "--set", f"train.num_workers={workers}", *cli()]) == 2
    assert "produced no usable sample" in one_error_line(capsys.readouterr().err)
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        (shards / f"{i:05d}.tar").write_bytes(b"not a tar file" * 100)
    vocab = tmp_path / "vocab.txt"  # the shards hold no caption to train one from
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "caption"]) + "\n")
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path / "shards-run"), "--quiet",
                 "--set", "data.source=shards", "--set", f"data.train_data={shards}/{{00000..00002}}.tar",
                 "--set", "data.resampled=true", "--set", "data.samples_per_epoch=64",
                 "--set", f"data.tokenizer={vocab}", "--set", "train.batch_size=4", "--set", f"train.num_workers={workers}", *cli()]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "shard errors in a row" in line and "Traceback" not in line
