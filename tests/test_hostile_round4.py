"""Hostile input, fourth round (issue #58): each case failed before its fix, on the surfaces added since round three
(preset and grid files, ablate's folders and --reuse, transformers configs, Hub ids, FSDP's optimiser folder, the
report's pool files). The promise for each: exit 0 or 2, one line, nothing run, nothing read or written outside the
folder named, no wait without end."""
import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from topoclip.cli import main
from topoclip.config import ConfigError, load_config
from topoclip.core.errors import UserError
from topoclip.experiments import grid as grids
from topoclip.run.training.trainer import train

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["train.num_workers=0", "train.threads=1", "train.warmup_steps=1", "evaluate.size=16",
         'evaluate.template_modes=["distance"]', "data.scenes.train_size=256", "data.scenes.val_size=32",
         "data.scenes.test_size=32"]
# A one-cell grid of tiny runs: what the ablate cases train.
GRID = {"preset": "tiny", "settings": [f"{s}" for s in SMALL] + ["train.steps=2", "train.batch_size=16"],
        "axes": [{"name": "topology", "levels": [{"label": "sphere", "set": ["model.topology=sphere"]}]}]}
ABLATE = ["--seeds", "1", "--probe-size", "0"]


def one_line_error(capsys) -> str:
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("topoclip: error: ") and "Traceback" not in error, error
    return error


def within(seconds: float, function, *args):
    """function(*args), failing the test (instead of hanging the suite) when it has not returned in `seconds`."""
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(value=_call(function, args)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(function, '__name__', function)} blocked"
    if isinstance(outcome["value"], BaseException):
        raise outcome["value"]
    return outcome["value"]


def _call(function, args):
    try:
        return function(*args)
    except BaseException as error:  # noqa: BLE001 - handed back to the test's thread
        return error


def write_json(path: Path, value) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    config = load_config("tiny", SMALL + ["train.steps=2", "train.checkpoint_every=1", "train.keep_checkpoints=5"])
    return train(config, out_dir=tmp_path_factory.mktemp("run") / "run", progress=False)


@pytest.fixture(scope="module")
def ablation(tmp_path_factory) -> Path:
    """A finished one-cell ablation (another user's, for --reuse)."""
    folder = tmp_path_factory.mktemp("theirs")
    grid = write_json(folder / "grid.json", GRID)
    assert main(["ablate", "--grid", str(grid), *ABLATE, "--out", str(folder / "out")]) == 0
    return folder / "out"


# ------------------------------------------------------------------ 1. a file is data, never a command


PIPE = "pipe:touch {marker}; cat S/00000.tar"


def test_a_preset_file_never_runs_a_command(tmp_path, capsys):
    marker = tmp_path / "PWN"
    value = PIPE.format(marker=marker)
    preset = write_json(tmp_path / "p.json", {"base": "tiny", "data": {"source": "shards", "train_data": value}})
    assert main(["train", "--preset", str(preset), "--print-config", "--out", str(tmp_path / "r")]) == 2
    error = one_line_error(capsys)
    assert "runs a command" in error and "--set data.train_data=" in error  # the refusal names the flag
    assert not marker.exists()
    # Typed on the command line, it is the user's: taken (printed here, not trained).
    assert main(["train", "--preset", str(preset), "--print-config", "--set", f"data.train_data={value}"]) == 0
    assert not marker.exists()


def test_a_preset_file_never_turns_on_wandb(tmp_path, capsys):
    preset = write_json(tmp_path / "p.json", {"base": "tiny", "train": {"report_to": ["wandb"]}})
    assert main(["train", "--preset", str(preset), "--print-config"]) == 2
    assert "W&B uploads" in one_line_error(capsys)


@pytest.mark.parametrize("where", ["settings", "level set", "level preset"])
def test_a_grid_file_never_runs_a_command(tmp_path, capsys, where):
    marker = tmp_path / "PWN"
    value = PIPE.format(marker=marker)
    grid = json.loads(json.dumps(GRID))
    if where == "settings":
        grid["settings"] += ["data.source=shards", f"data.train_data={value}"]
    elif where == "level set":
        grid["axes"][0]["levels"][0]["set"] += ["data.source=shards", f"data.train_data={value}"]
    else:
        preset = write_json(tmp_path / "p.json", {"base": "tiny", "data": {"source": "shards", "train_data": value}})
        grid["axes"][0]["levels"][0]["preset"] = str(preset)
    path = write_json(tmp_path / "grid.json", grid)
    assert main(["ablate", "--grid", str(path), *ABLATE, "--out", str(tmp_path / "out")]) == 2
    assert "runs a command" in one_line_error(capsys)
    assert not marker.exists() and not (tmp_path / "out" / "runs").exists()
    # The user's own --set of the same value is taken (planned here, not trained).
    specs = grids.plan(grids.load_grid(str(path)), tmp_path / "planned", 1, [f"data.train_data={value}"])
    assert specs[0].config["data"]["train_data"] == value and not marker.exists()


# ------------------------------------------------------------------ 2, 3. ablation folders: links, FIFOs, data loss


@pytest.mark.slow
@pytest.mark.parametrize("plant", ["a link to a file", "a link to a folder", "checkpoints linked", "a FIFO"])
def test_reuse_never_copies_through_a_link_nor_reads_a_fifo(ablation, tmp_path, capsys, plant):
    theirs = tmp_path / "theirs"
    shutil.copytree(ablation, theirs)
    seed = theirs / "runs" / "sphere" / "seed-0"
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    if plant == "a link to a file":
        (seed / "secret.txt").symlink_to(secret)
    elif plant == "a link to a folder":
        (seed / "share").symlink_to(tmp_path)
    elif plant == "checkpoints linked":
        shutil.rmtree(seed / "checkpoints")
        (seed / "checkpoints").symlink_to(ablation / "runs" / "sphere" / "seed-0" / "checkpoints")
    else:
        os.mkfifo(seed / "plots" / "pipe")
    grid = write_json(tmp_path / "grid.json", GRID)
    out = tmp_path / "mine"
    status = within(120, main, ["ablate", "--grid", str(grid), *ABLATE, "--out", str(out), "--reuse", str(theirs)])
    assert status == 2 and "topoclip copies and reads only files and folders" in one_line_error(capsys)
    assert not (out / "runs" / "sphere" / "seed-0").exists()  # nothing of it copied, not even in part
    assert not any(path.is_symlink() or path.name == "secret.txt" for path in out.rglob("*"))


def test_a_linked_cell_folder_is_refused_before_anything_is_deleted(tmp_path, capsys):
    """Failed before: with OUT/runs/CELL -> ~/mydata, ablate deleted ~/mydata/seed-0 and trained into ~/mydata."""
    mine = tmp_path / "mydata"
    (mine / "seed-0").mkdir(parents=True)
    (mine / "seed-0" / "thesis.tex").write_text("mine")
    out = tmp_path / "X"
    (out / "runs").mkdir(parents=True)
    (out / "runs" / "sphere").symlink_to(mine)
    grid = write_json(tmp_path / "grid.json", GRID)
    assert main(["ablate", "--grid", str(grid), *ABLATE, "--out", str(out)]) == 2
    assert "outside" in one_line_error(capsys)
    assert (mine / "seed-0" / "thesis.tex").read_text() == "mine" and sorted(os.listdir(mine)) == ["seed-0"]


@pytest.mark.slow
@pytest.mark.parametrize("damage, message", [("eval.json", "delete"), ("config.json", "not valid JSON")])
def test_ablate_re_reading_a_damaged_run_is_one_line(ablation, tmp_path, capsys, damage, message):
    out = tmp_path / "out"
    shutil.copytree(ablation, out)
    (out / "runs" / "sphere" / "seed-0" / damage).write_text("[" * 100_000)
    grid = write_json(tmp_path / "grid.json", GRID)
    assert main(["ablate", "--grid", str(grid), *ABLATE, "--out", str(out)]) == 2
    assert message in one_line_error(capsys)


# ------------------------------------------------------------------ 4. what never ended


def test_a_grid_of_billions_of_cells_or_runs_is_refused_before_it_is_planned(tmp_path, capsys):
    levels = [{"label": f"l{k}", "set": []} for k in range(20)]
    grid = write_json(tmp_path / "grid.json", {"preset": "tiny", "axes": [{"name": f"a{k}", "levels": levels}
                                                                           for k in range(8)]})
    assert within(30, main, ["ablate", "--grid", str(grid), "--out", str(tmp_path / "a")]) == 2
    assert "more than 10,000 cells" in one_line_error(capsys)
    small = write_json(tmp_path / "small.json", GRID)
    assert within(30, main, ["ablate", "--grid", str(small), "--seeds", "1000000000", "--out", str(tmp_path / "b")]) == 2
    assert "over the 100,000 one ablation may plan" in one_line_error(capsys)


def test_a_cifar_pickle_of_shared_references_is_refused_at_once(tmp_path):
    from topoclip.data.benchmark_sets import read_cifar_python

    nested = []
    for _ in range(40):
        nested = [nested, nested]  # 40 levels, 2^40 paths, a few hundred bytes pickled
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    with open(folder / "test_batch", "wb") as file:
        pickle.dump({"data": nested, "labels": []}, file)
    with pytest.raises(ValueError, match="nests deeper than 8 levels"):
        within(30, read_cifar_python, tmp_path, "cifar10")


def test_a_fifo_among_the_optimisers_shards_is_refused_at_once(tmp_path):
    from topoclip.core.errors import CheckpointError
    from topoclip.run.training.sharding import load_optimizer_shards

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    folder = tmp_path / "optimizer"
    folder.mkdir()
    os.mkfifo(folder / "shard-00001-model-00001-of-00001.safetensors")
    with pytest.raises(CheckpointError, match="FIFO"):
        within(30, load_optimizer_shards, model, optimizer, folder, optimizer.state_dict()["param_groups"])


def test_land_on_a_fifo_ablation_json_is_one_line(tmp_path):
    os.mkfifo(tmp_path / "ablation.json")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_results.py"), "land", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "FIFO" in done.stderr and done.stderr.count("\n") == 1, done.stderr


# ------------------------------------------------------------------ 5. tracebacks


def transformers_folder(tmp_path: Path, **config) -> Path:
    folder = tmp_path / "clip"
    write_json(folder / "config.json", {"architectures": ["CLIPModel"], "model_type": "clip", **config})
    return folder


@pytest.mark.parametrize("config, message", [
    ({"text_config": "gelu"}, "text_config is \"gelu\", not a dict"),
    ({"text_config": [1]}, "text_config is [1], not a dict"),
    ({"text_config": {"hidden_act": ["gelu"]}}, "text_config.hidden_act is [\"gelu\"], not a str"),
    ({"vision_config": {"num_attention_heads": "12"}}, "num_attention_heads is \"12\", not a int"),
])
def test_a_transformers_config_of_other_types_is_one_line(tmp_path, capsys, config, message):
    folder = transformers_folder(tmp_path, **config)
    assert main(["convert", "--from", "hf", str(folder), str(tmp_path / "out")]) == 2
    assert message in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_run_folders_config_with_architectures_a_number_is_one_line(run, tmp_path, capsys):
    """Failed before: `architectures: 5` made the check for a transformers folder fail with a TypeError on every
    run folder whose config.json carried the key."""
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    values = json.loads((folder / "config.json").read_text())
    write_json(folder / "config.json", {**values, "architectures": 5})
    assert main(["eval", str(folder)]) in (0, 2)
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("name, message", [
    ("hf-hub:../../etc", "is not a Hub repository id"),
    ("hf-hub:" + "a" * 500 + "/b", "is not a Hub repository id"),
    ("hf-hub:org/name@../../x", "is not a Hub revision"),
    ("hf-hub:org/name@main", "not in the local Hugging Face cache"),
])
def test_a_hub_id_is_checked_before_the_hub_is_asked(tmp_path, capsys, monkeypatch, name, message):
    from topoclip.run.inference import checkpoint_folder

    offline(monkeypatch)
    with pytest.raises(UserError, match=message):
        checkpoint_folder(name, cache_dir=tmp_path / "cache")


def offline(monkeypatch) -> None:
    """huggingface_hub offline, whenever it was imported (it reads HF_HUB_OFFLINE once, at its import)."""
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_an_offline_cache_whose_ref_leads_out_is_one_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "cache"
    repository = cache / "models--org--name"
    (repository / "refs").mkdir(parents=True)
    (repository / "refs" / "main").write_text("../../../../../../etc")
    (repository / "snapshots").mkdir()
    from topoclip.io.pretrained import hub_folder

    offline(monkeypatch)
    with pytest.raises(UserError) as refused:
        hub_folder("org/name", cache_dir=cache)
    assert "\n" not in str(refused.value)


def sparse(path: Path, size: int) -> Path:
    """A file of `size` bytes that takes no disk (a read of it would take minutes and all the memory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as file:
        file.truncate(size)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", ["topoclip_config.json", "tokenizer.json"])
def test_a_huge_file_in_a_model_folder_is_refused_unread(run, tmp_path, capsys, name):
    folder = tmp_path / "model"
    shutil.copytree(sorted((run / "checkpoints").iterdir())[-1], folder)
    sparse(folder / name, 3_500_000_000)
    assert within(60, main, ["eval", str(folder), "--set", "evaluate.size=16"]) == 2
    assert "MiB, over the" in one_line_error(capsys)


@pytest.mark.slow
def test_a_huge_classnames_file_is_refused_unread(run, tmp_path, capsys):
    """A CLIP_benchmark set whose classnames.txt is 3 GB (read whole before: MemoryError)."""
    import io
    import tarfile

    from PIL import Image

    root = tmp_path / "wds_set"
    (root / "test").mkdir(parents=True)
    (root / "test" / "nshards.txt").write_text("1")
    with tarfile.open(root / "test" / "0.tar", "w") as archive:
        for key, label in (("a", b"0"), ("b", b"1")):
            image = io.BytesIO()
            Image.new("RGB", (32, 32)).save(image, format="PNG")
            for name, data in ((f"{key}.png", image.getvalue()), (f"{key}.cls", label)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    sparse(root / "classnames.txt", 3_000_000_000)
    status = within(60, main, ["eval", str(run), "--set", f'evaluate.classification=["{root}"]',
                               "--set", "evaluate.size=16"])
    assert status == 2 and "over the 64.0 MiB" in one_line_error(capsys)


def test_an_integer_past_the_float_range_is_one_line(capsys):
    assert main(["train", "--preset", "tiny", "--print-config", "--set", "train.lr=1" + "0" * 400]) == 2
    assert "past the largest float" in one_line_error(capsys)


@pytest.mark.slow
def test_an_export_onto_a_full_disk_leaves_nothing_and_says_so(run, tmp_path, capsys, monkeypatch):
    import topoclip.io.convert.hf as hf

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf, "save_file", full)
    sphere = tmp_path / "sphere"
    config = load_config("tiny", SMALL + [  # a model transformers' CLIPModel can hold
        "train.steps=1", "model.topology=sphere", "model.class_tokens=1", "model.text.attention=causal",
        "model.text.pooling=end_of_text", "model.text.norm_first=true", "model.text.embedding_norm=false",
        "model.vision.activation=quick_gelu", "model.text.activation=quick_gelu", "train.eval_every=0"])
    train(config, out_dir=sphere, progress=False)
    assert main(["export", str(sphere), "--hf", str(tmp_path / "hf")]) == 2
    error = one_line_error(capsys)
    assert "nothing was written" in error and "--resume" not in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sphere"]


def readme_results():
    from topoclip.experiments import results

    return results


@pytest.mark.parametrize("pool", [{"parts": "abc"}, {"parts": ["../../x"]}, {"parts": ["a"], "seeds": "5"},
                                  {"parts": [["a"]]}, {"parts": ["a"]}])
def test_land_and_check_on_a_malformed_pool_file_are_one_line(tmp_path, monkeypatch, pool):
    module = readme_results()
    monkeypatch.setattr(module.files, "RESULTS", tmp_path / "results")
    write_json(tmp_path / "results" / "pool.json", {"about": "A.", **pool})
    write_json(tmp_path / "results" / "a" / "ablation.json", {"analysis": "ablation", "runs": "none"})
    out = tmp_path / "part"
    write_json(out / "ablation.json", {"analysis": "ablation", "runs": []})
    with pytest.raises(ValueError):
        module.land(out, "pool")
    with pytest.raises(ValueError):
        module.load_results("pool")


# ------------------------------------------------------------------ 6. the minor ones


def test_a_training_state_whose_step_is_not_its_folders_is_damaged(run, tmp_path, capsys):
    from topoclip.io.checkpoint import TRAINING_STATE

    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    (folder / "eval.json").unlink()
    newest = sorted((folder / "checkpoints").iterdir())[-1]
    state = torch.load(newest / TRAINING_STATE, weights_only=True)
    state["step"] = 10 ** 9
    torch.save(state, newest / TRAINING_STATE)
    assert main(["train", "--resume", str(folder), "--quiet"]) == 0  # from the checkpoint before: not "complete"
    assert "skipping damaged checkpoint" in capsys.readouterr().err
    assert (folder / "eval.json").is_file()


@pytest.mark.parametrize("name", ["a\nb", "tab\there", "bell\x07"])
def test_a_run_name_with_a_control_character_is_refused(name):
    with pytest.raises(ConfigError, match="control character"):
        load_config("tiny", [f"name={json.dumps(name)}"])


@pytest.mark.slow
def test_export_into_one_folder_twice_is_refused_before_anything_is_written(run, tmp_path, capsys):
    destination = tmp_path / "D"
    assert main(["export", str(run), "--weights", str(destination), "--onnx", str(destination)]) == 2
    assert "give each export its own folder" in one_line_error(capsys)
    assert not destination.exists()


def test_a_grid_levels_set_that_is_a_string_is_one_line(tmp_path, capsys):
    grid = json.loads(json.dumps(GRID))
    grid["axes"][0]["levels"][0]["set"] = "train.steps=1"
    path = write_json(tmp_path / "grid.json", grid)
    assert main(["ablate", "--grid", str(path), *ABLATE, "--out", str(tmp_path / "out")]) == 2
    assert "is the string 'train.steps=1'; give a list of settings" in one_line_error(capsys)


def test_full_disk_advice_names_what_helps():
    from topoclip.cli import describe_error

    said = describe_error(OSError(errno.ENOSPC, "No space left on device", "x"))
    assert "run the command again" in said and "continue the run with --resume" not in said


def test_a_junk_folder_in_the_pretrained_cache_says_to_delete_it(tmp_path, monkeypatch):
    from topoclip.io.pretrained import pretrained_folder

    monkeypatch.setenv("TOPOCLIP_CACHE", str(tmp_path))
    junk = tmp_path / "pretrained" / "ViT-B-32--openai" / "main"
    junk.mkdir(parents=True)
    (junk / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="delete that folder"):
        pretrained_folder("ViT-B-32:openai")


# ------------------------------------------------------------------ the independent review's round (before #58 closed)


@pytest.mark.slow
def test_analyze_never_writes_through_a_link_in_the_run_folder(run, tmp_path, capsys):
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    victim = tmp_path / "victim"
    victim.write_text("mine")
    (folder / "analysis").mkdir()
    (folder / "analysis" / "temperature.json").symlink_to(victim)
    assert main(["analyze", "temperature", str(folder)]) == 0
    assert victim.read_text() == "mine" and not (folder / "analysis" / "temperature.json").is_symlink()
    shutil.rmtree(folder / "analysis")
    (folder / "analysis").symlink_to(tmp_path)  # the folder itself a link out
    assert main(["analyze", "temperature", str(folder)]) == 2
    assert "outside" in one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "victim"]


@pytest.mark.slow
def test_ablate_never_writes_a_probe_through_a_link_nor_waits_on_a_fifo(ablation, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(ablation, out)
    seed = out / "runs" / "sphere" / "seed-0"
    outside = tmp_path / "new.json"
    (seed / "probe.json").unlink(missing_ok=True)
    (seed / "probe.json").symlink_to(outside)
    grid = write_json(tmp_path / "grid.json", GRID)
    main(["ablate", "--grid", str(grid), "--seeds", "1", "--probe-size", "16", "--out", str(out)])
    capsys.readouterr()
    assert not outside.exists()
    fifo = tmp_path / "fifo-out"
    (fifo / "runs" / "sphere").mkdir(parents=True)
    os.mkfifo(fifo / "runs" / "sphere" / "seed-0")
    assert within(60, main, ["ablate", "--grid", str(grid), *ABLATE, "--out", str(fifo)]) == 2
    assert "is a FIFO, where a folder belongs" in one_line_error(capsys)


def test_a_torch_file_with_a_compressed_member_is_refused_before_it_inflates(tmp_path):
    import zipfile

    from topoclip.io.convert.files import read_state_dict
    from topoclip.core.errors import CheckpointError

    plain = tmp_path / "plain.bin"
    torch.save({"w": torch.zeros(4)}, plain)
    inflating = tmp_path / "pytorch_model.bin"
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(inflating, "w", zipfile.ZIP_DEFLATED) as target:
        for member in source.infolist():
            target.writestr(member.filename, source.read(member.filename))
    assert read_state_dict(plain)["w"].shape == (4,)
    with pytest.raises(CheckpointError, match="compressed member"):
        read_state_dict(inflating)


def sparse_member_tar(path: Path, name: str, declared: int) -> Path:
    """A tar whose member `name` declares `declared` bytes, written sparse: a few KB on disk."""
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as file:
        info = tarfile.TarInfo(name)
        info.size = declared
        file.write(info.tobuf(format=tarfile.GNU_FORMAT))
        file.seek(512 + declared + (-declared % 512) + 1024 - 1)
        file.write(b"\0")
    return path


def test_a_shard_member_declaring_gigabytes_is_skipped_unread(tmp_path):
    import resource

    from topoclip.data.shards import MEMBER_BYTES, tar_samples

    shard = sparse_member_tar(tmp_path / "0.tar", "a.txt", MEMBER_BYTES + 1)
    errors = []
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    samples = list(within(60, lambda: list(tar_samples([{"url": str(shard)}], lambda e: errors.append(e) or True))))
    assert samples == [] and "claims" in str(errors[0])
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < MEMBER_BYTES // 1024 // 2  # far below what reading the member would have cost


def test_a_csv_of_one_endless_line_is_read_in_bounded_pieces(tmp_path):
    from topoclip.data.csv import MAX_LINE_CHARS, CaptionTable

    table = tmp_path / "t.csv"
    with open(table, "w") as file:
        file.write("filepath,title\n" + "x" * (3 * MAX_LINE_CHARS) + "\na.png,a cat\n")
    with pytest.warns(UserWarning, match="over 1,048,576 characters"):
        assert list(CaptionTable(table)) == [("a.png", "a cat")]


def test_json_of_millions_of_objects_is_refused_before_it_is_parsed():
    from topoclip.core import door

    with pytest.raises(door.FileRefused, match="objects and lists, over the 4,000,000"):
        door.parse_json("[" + "{}," * door.JSON_CONTAINERS + "{}]", "x")


@pytest.mark.slow
def test_a_checkpoints_folder_that_links_out_is_refused(run, tmp_path, capsys):
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    shutil.move(str(folder / "checkpoints"), str(tmp_path / "elsewhere"))
    (folder / "checkpoints").symlink_to(tmp_path / "elsewhere")
    assert main(["export", str(folder), "--weights", str(tmp_path / "w")]) == 2
    assert "outside" in one_line_error(capsys) and not (tmp_path / "w").exists()


def test_a_hub_snapshot_or_cache_folder_that_links_out_is_refused(tmp_path, capsys, monkeypatch):
    pytest.importorskip("huggingface_hub")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repository = tmp_path / "cache" / "models--org--name"
    (repository / "refs").mkdir(parents=True)
    (repository / "refs" / "main").write_text(commit)
    (repository / "snapshots").mkdir()
    outside = tmp_path / "outside"
    write_json(outside / "topoclip_config.json", {})
    (outside / "model.safetensors").write_bytes(b"x")
    (repository / "snapshots" / commit).symlink_to(outside)
    from topoclip.io.pretrained import hub_folder

    offline(monkeypatch)
    with pytest.raises(UserError, match="leads out of its repository folder"):
        hub_folder("org/name", cache_dir=tmp_path / "cache")
    monkeypatch.setenv("TOPOCLIP_CACHE", str(tmp_path / "topoclip"))
    (tmp_path / "topoclip" / "pretrained" / "ViT-B-32--openai").mkdir(parents=True)
    (tmp_path / "topoclip" / "pretrained" / "ViT-B-32--openai" / "main").symlink_to(outside)
    from topoclip.io.pretrained import pretrained_folder

    with pytest.raises(UserError, match="cache of converted models"):
        pretrained_folder("ViT-B-32:openai")


@pytest.mark.parametrize("plant", ["link out", "fifo", "garbage"])
def test_a_tokenizer_beside_openclip_weights_goes_through_the_door(tmp_path, capsys, plant):
    from topoclip.io.convert.openai import OPENCLIP_CONFIG

    folder = tmp_path / "openclip"
    folder.mkdir()
    torch.save({"w": torch.zeros(1)}, folder / "open_clip_pytorch_model.bin")
    write_json(folder / OPENCLIP_CONFIG, {"model_cfg": {"text_cfg": {}}, "preprocess_cfg": {}})
    if plant == "link out":
        write_json(tmp_path / "secret.json", {"model": {}})
        (folder / "tokenizer.json").symlink_to(tmp_path / "secret.json")
    elif plant == "fifo":
        os.mkfifo(folder / "tokenizer.json")
    else:
        (folder / "tokenizer.json").write_text("[1]")
    status = within(60, main, ["convert", "--from", "openclip", str(folder), str(tmp_path / "out")])
    assert status == 2
    one_line_error(capsys)


@pytest.mark.slow
@pytest.mark.parametrize("file, text", [
    ("eval.json", '[{"task": "zeroshot_classification", "dataset": "shape", "metrics": 5}]'),
    ("eval.json", '[{"task": "zeroshot_classification", "dataset": "shape", "metrics": {"top1": "x"}}]'),
    ("reused.json", '{"from": 5}'),
    ("metrics.jsonl", '{"eval": {"a": 1}}\n{"step": 5, "scale": "x"}\n{"step": 1e308, "scale": 1, "t": 1}\n'),
])
def test_ablate_re_reading_a_run_file_of_other_types_is_one_line_or_leaves_the_line_out(ablation, tmp_path, capsys,
                                                                                        file, text):
    out = tmp_path / "out"
    shutil.copytree(ablation, out)
    seed = out / "runs" / "sphere" / "seed-0"
    if file == "metrics.jsonl":
        with open(seed / file, "a") as log:
            log.write(text)
    else:
        (seed / file).write_text(text)
    grid = write_json(tmp_path / "grid.json", GRID)
    status = main(["ablate", "--grid", str(grid), *ABLATE, "--out", str(out)])
    error = capsys.readouterr().err
    assert "Traceback" not in error
    if file == "metrics.jsonl":
        assert status == 0  # the damaged lines are left out of the curves, the rest read
    else:
        assert status == 2 and error.count("\n") == 1


def test_two_labels_naming_one_cell_folder_are_refused(tmp_path, capsys):
    grid = json.loads(json.dumps(GRID))
    grid["axes"][0]["levels"] = [{"label": "A b", "set": ["model.topology=sphere"]}, {"label": "a-b", "set": []}]
    path = write_json(tmp_path / "grid.json", grid)
    assert main(["ablate", "--grid", str(path), *ABLATE, "--out", str(tmp_path / "out")]) == 2
    assert "name the same cell folder ('a-b')" in one_line_error(capsys)


def test_land_never_reads_through_a_link_nor_replaces_silently(tmp_path, monkeypatch):
    module = readme_results()
    monkeypatch.setattr(module.files, "RESULTS", tmp_path / "results")
    results = {"analysis": "ablation", "runs": [{"cell": "x", "seed": 0}]}
    write_json(tmp_path / "outside.json", results)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "ablation.json").symlink_to(tmp_path / "outside.json")
    with pytest.raises(ValueError, match="outside"):
        module.land(linked)
    grid = tmp_path / "sweep" / "grid"
    write_json(grid / "ablation.json", results)
    module.land(grid)
    write_json(grid / "ablation.json", {**results, "runs": [{"cell": "y", "seed": 0}]})
    with pytest.raises(ValueError, match="holds other results"):
        module.land(grid)
    assert json.loads((tmp_path / "results" / "grid" / "ablation.json").read_text()) == results
    module.land(grid, replace=True)
    assert json.loads((tmp_path / "results" / "grid" / "ablation.json").read_text())["runs"][0]["cell"] == "y"


@pytest.mark.slow
def test_export_into_a_folder_and_one_inside_it_is_refused_before_anything_is_written(run, tmp_path, capsys):
    assert main(["export", str(run), "--weights", str(tmp_path / "x" / "sub"), "--onnx", str(tmp_path / "x")]) == 2
    assert "a folder and one inside it" in one_line_error(capsys)
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.parametrize("plant", ["fifo", "folder"])
def test_resume_with_a_config_or_tokenizer_that_is_no_file_says_what_it_is(run, tmp_path, capsys, plant):
    for name in ("config.json", "tokenizer.json"):
        folder = tmp_path / name / "run"
        shutil.copytree(run, folder)
        (folder / "eval.json").unlink()
        (folder / name).unlink()
        os.mkfifo(folder / name) if plant == "fifo" else (folder / name).mkdir()
        assert within(60, main, ["train", "--resume", str(folder), "--quiet", "--set", "train.steps=3"]) == 2
        error = one_line_error(capsys)
        assert any(said in error for said in (("FIFO", "special files") if plant == "fifo" else ("is a folder",))), error
