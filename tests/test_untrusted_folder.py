"""A run or checkpoint folder may be anyone's: reading it never runs a command nor sizes memory from it
(issue #16 items 2 and 3). Before: a config.json with data.train_data="pipe:..." ran its shell command
on `train --resume` and `train --init-from`; a config claiming a huge model was allocated before its
shapes were compared with the weights."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from topoclip.io import checkpoint
from topoclip.io.checkpoint import step_checkpoints
from topoclip.cli import main
from topoclip.config import load_config
from topoclip.core.errors import NonFiniteError
from topoclip.run.training.trainer import train

SMALL = ["train.num_workers=0", "train.threads=1", "train.warmup_steps=1", "evaluate.size=16",
         'evaluate.template_modes=["distance"]', "data.scenes.train_size=256", "data.scenes.val_size=32",
         "data.scenes.test_size=32"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    config = load_config("tiny", SMALL + ["train.steps=2", "train.checkpoint_every=1", "train.keep_checkpoints=5"])
    return train(config, out_dir=tmp_path_factory.mktemp("run") / "run", progress=False)


def plant(config_file: Path, marker: Path) -> None:
    """The payload: a shard 'URL' that webdataset would open through a shell."""
    values = json.loads(config_file.read_text())
    values["data"].update(source="shards", train_data=f"pipe:touch {marker}; cat {config_file.parent}/x.tar")
    config_file.write_text(json.dumps(values))


@pytest.mark.slow
def test_resume_never_runs_a_command_from_the_folders_config(run, tmp_path, capsys):
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    shutil.rmtree(folder / "checkpoints" / "step-000002")
    (folder / "eval.json").unlink()
    marker = tmp_path / "PWNED"
    plant(folder / "config.json", marker)
    assert main(["train", "--resume", str(folder), "--quiet"]) == 2
    error = capsys.readouterr().err
    assert "runs a command" in error and error.count("\n") == 1
    with pytest.raises(Exception, match="runs a command"):  # the library call too
        train(None, resume=folder, progress=False)
    assert not marker.exists()


@pytest.mark.slow
def test_init_from_takes_the_model_never_the_data(run, tmp_path, capsys):
    source = tmp_path / "checkpoint"
    shutil.copytree(step_checkpoints(run / "checkpoints")[-1], source)
    marker = tmp_path / "PWNED"
    plant(source / "topoclip_config.json", marker)
    out = tmp_path / "new"
    settings = [part for s in SMALL + ["train.steps=1"] for part in ("--set", s)]
    assert main(["train", "--init-from", str(source), "--out", str(out), "--quiet", *settings]) == 0
    assert not marker.exists()
    saved = json.loads((out / "config.json").read_text())
    assert saved["data"]["source"] == "scenes" and saved["model"] == json.loads((source / "topoclip_config.json").read_text())["model"]


def test_a_config_claiming_a_huge_model_is_refused_before_anything_is_built(run, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "exported"
    shutil.copytree(step_checkpoints(run / "checkpoints")[-1], folder)
    values = json.loads((folder / "topoclip_config.json").read_text())
    values["model"]["vision"].update(width=16384, heads=128, layers=24)
    (folder / "topoclip_config.json").write_text(json.dumps(values))
    built = []
    real = checkpoint.CLIP

    def counting(*args, **kwargs):  # only the meta-device model (no memory) may be built before the check
        built.append(torch.empty(0).device.type)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "CLIP", counting)
    assert main(["eval", str(folder)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "visual.class_embedding is (4, 64) in the file but (4, 16384) in the config" in error
    assert built == ["meta"]


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(run, tmp_path, capsys):
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    (folder / "eval.json").unlink()
    newest = folder / "checkpoints" / "step-000002" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:1000])  # cut short, as a dying disk leaves it
    assert main(["train", "--resume", str(folder), "--quiet", "--set", "train.steps=3"]) == 0
    captured = capsys.readouterr()
    assert "skipping damaged checkpoint step-000002" in captured.err and "resuming from step-000001" in captured.out


def test_the_last_update_is_checked_before_it_is_saved(tmp_path, monkeypatch, capsys):
    # The last step has no next step whose loss vouches for its update (lr 1e6 made such weights once).
    from topoclip.run.training import trainer

    monkeypatch.setattr(trainer, "batch_loss", lambda *args: torch.tensor(float("nan")))
    config = load_config("tiny", SMALL + ["train.steps=1"])
    with pytest.raises(NonFiniteError, match="the last update made the loss non-finite"):
        train(config, out_dir=tmp_path / "run", progress=False)
    assert not step_checkpoints(tmp_path / "run" / "checkpoints")


@pytest.mark.parametrize("option", [["--template", "{x}"], ["--template", "{}{}"], ["--template", "{"],
                                    ["--template", "a photo"], ["--top", "-1"]])
def test_predict_refuses_a_bad_template_or_top_in_one_line(run, option, capsys):
    assert main(["predict", str(run), "--labels", "cat,dog", *option, "--image", "x.png"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and option[0] in error and "Traceback" not in error


# ------------------------------------------------------------------ smaller (issue #16 item 8)


@pytest.mark.parametrize("name", ["../../x", "/etc/x", "a/b", ".."])
def test_a_run_name_cannot_put_the_run_folder_outside_runs(name):
    from topoclip.config import ConfigError

    with pytest.raises(ConfigError, match="must be a plain folder name"):
        load_config("tiny", [f"name={name}"])


def test_a_mistyped_local_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    from topoclip.run import inference

    asked = []
    monkeypatch.setattr(inference, "hub_folder", lambda *args: asked.append(args))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match="no such folder .*hf-hub:runs/typo"):
        inference.checkpoint_folder("runs/typo")
    inference.checkpoint_folder("org/model")  # nothing here is called org/: that is a Hub repo id
    assert asked == [("org/model", None, None)]


def test_a_template_without_its_field_is_refused_by_the_library(run):
    import topoclip
    from topoclip.core.errors import UserError

    clip = topoclip.load(run)
    with pytest.raises(UserError, match="must hold one"):
        clip.zero_shot_classifier(["cat", "dog"], ["a photo"])


def test_plots_lost_to_a_kill_are_drawn_when_the_finished_run_is_resumed(run, tmp_path, capsys):
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    shutil.rmtree(folder / "plots")  # killed while plotting, after eval.json was written
    metrics = folder / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines() if '"final"' not in line))
    assert main(["train", "--resume", str(folder), "--quiet"]) == 0
    assert "is complete" in capsys.readouterr().out
    assert (folder / "plots" / "loss.png").is_file() and (folder / "plots" / "evaluation.png").is_file()
    finals = [line for line in metrics.read_text().splitlines() if '"final"' in line]
    assert len(finals) == 1 and json.loads(finals[0])["eval"] == json.loads(
        [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"final"' in line][0])["eval"]
