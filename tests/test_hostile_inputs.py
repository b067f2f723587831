"""Hostile input, third round (issue #41): each case failed before its fix — a command or a network read
hidden in braces, names that leave their folder, numbers from a file that size memory, writers that delete or
mix a user's files, and inputs that ended in a traceback. The promise for each: exit 0 or 2, one line,
nothing run, nothing written outside the named folder."""
import json
import shutil
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from topoclip.io.checkpoint import TRAINING_STATE, step_checkpoints
from topoclip.cli import main
from topoclip.config import ConfigError, load_config
from topoclip.run.training.trainer import train

SMALL = ["train.num_workers=0", "train.threads=1", "train.warmup_steps=1", "evaluate.size=16",
         'evaluate.template_modes=["distance"]', "data.scenes.train_size=256", "data.scenes.val_size=32",
         "data.scenes.test_size=32"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    config = load_config("tiny", SMALL + ["train.steps=2", "train.checkpoint_every=1", "train.keep_checkpoints=5"])
    return train(config, out_dir=tmp_path_factory.mktemp("run") / "run", progress=False)


def one_line_error(capsys) -> str:
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("topoclip: error: ") and "Traceback" not in error, error
    return error


def resumable_copy(run: Path, tmp_path: Path) -> Path:
    """A copy of the run with its newest checkpoint and final files removed: `--resume` continues it."""
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    shutil.rmtree(folder / "checkpoints" / "step-000002")
    (folder / "eval.json").unlink()
    return folder


# ------------------------------------------------------------------ 1. commands and the network hidden in braces


@pytest.mark.slow
@pytest.mark.parametrize("payload", [
    "{pipe:touch MARKER; cat a.,b.}tar",
    "{https://example.invalid/x.tar,a.tar}",
    "{http://127.0.0.1:9/x.tar,a.tar}",
    "a.tar::{b.tar,PIPE:touch MARKER}",
    "${HIDDEN}",  # webdataset reads it from WDS_HIDDEN
    "{ pipe:touch MARKER,a.tar}",
])
def test_a_folders_config_never_runs_a_command_hidden_in_its_urls(run, tmp_path, capsys, monkeypatch, payload):
    marker = tmp_path / "PWNED"
    monkeypatch.setenv("WDS_HIDDEN", f"pipe:touch {marker}")
    folder = resumable_copy(run, tmp_path)
    values = json.loads((folder / "config.json").read_text())
    values["data"].update(source="shards", train_data=payload.replace("MARKER", str(marker)))
    (folder / "config.json").write_text(json.dumps(values))
    assert main(["train", "--resume", str(folder), "--quiet"]) == 2
    assert "runs a command or reads the network" in one_line_error(capsys)
    assert not marker.exists()


def test_the_command_check_expands_as_webdataset_does():
    from webdataset.shardlists import expand_urls as webdataset_expansion

    from topoclip.data.shards import command_urls, expand_urls

    for spec in ["a/{000..003}.tar::b/{x,y}.tar", "{pipe:cat a.,b.}tar", "data/{0..2}/{a,b}.tar"]:
        assert expand_urls(spec) == webdataset_expansion(spec)
    assert command_urls("{pipe:cat a.,b.}tar") == ["pipe:cat a.tar"]
    assert command_urls("{file:a.tar,b.tar}") == []


@pytest.mark.slow
def test_a_brace_pattern_of_a_hundred_million_shards_is_refused_before_it_is_listed(run, tmp_path, capsys):
    assert main(["embed", str(run), "--images", "s/{000000000..099999999}.tar", "--out", str(tmp_path / "o")]) == 2
    assert "more than 1,000,000 shards" in one_line_error(capsys)


# ------------------------------------------------------------------ 2. names that become paths


@pytest.mark.slow
@pytest.mark.parametrize("name", ["../../x", "a/b", "x\0y", "\ud800", "é" * 200])
def test_eval_output_file_names_stay_in_their_folder(run, tmp_path, capsys, name):
    out = tmp_path / "deep" / "results"
    assert main(["eval", str(run), "--output", str(out), "--name", name]) == 2
    assert "must be a plain file name" in one_line_error(capsys)
    assert not any(path.is_file() for path in tmp_path.rglob("*"))


@pytest.mark.parametrize("name", ["x\0y", "\ud800", "a\\b"])
def test_a_run_name_with_a_nul_or_a_lone_surrogate_is_one_line(name):
    with pytest.raises(ConfigError, match="must be a plain folder name"):
        load_config("tiny", [f"name={name}"])


# ------------------------------------------------------------------ 3. numbers from a file that size memory


@pytest.mark.parametrize("template", ["a {:>200000000}", "a {!r}", "a {:,}"])
def test_a_template_cannot_size_a_string(run, template, capsys):
    assert main(["predict", str(run), "--labels", "cat,dog", "--template", template, "--image", "x.png"]) == 2
    assert "format spec or conversion" in one_line_error(capsys)


def checkpoint_copy(run: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoint"
    shutil.copytree(step_checkpoints(run / "checkpoints")[-1], folder)
    return folder


def edit_tokenizer(folder: Path, edit) -> None:
    file = folder / "tokenizer.json"
    values = json.loads(file.read_text())
    edit(values)
    file.write_text(json.dumps(values))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t["truncation"].update(max_length=10**9), "context length"),  # used the model's: loads
    (lambda t: t.update(normalizer={"type": "Replace", "pattern": {"Regex": "(a|a)*$"}, "content": "x"}),
     "regular expression"),
    (lambda t: t["model"]["vocab"].update({f"extra{i}": 10_000 + i for i in range(3)}), "the tokenizer is not the model's"),
])
def test_a_checkpoints_tokenizer_is_checked_against_its_model(run, tmp_path, capsys, edit, message):
    folder = checkpoint_copy(run, tmp_path)
    edit_tokenizer(folder, edit)
    Image.new("RGB", (9, 9), (200, 10, 10)).save(tmp_path / "x.png")
    status = main(["predict", str(folder), "--labels", "cat,dog", "--image", str(tmp_path / "x.png")])
    if message == "context length":  # the model's own context length wins: nothing is sized from the file
        assert status == 0
        from topoclip.preprocess.tokenizer import Tokenizer

        with pytest.raises(ValueError, match="context length"):
            Tokenizer.load(folder / "tokenizer.json")
        return
    assert status == 2
    assert message in one_line_error(capsys)


def test_a_deeply_nested_tokenizer_file_is_one_line(run, tmp_path, capsys):
    folder = checkpoint_copy(run, tmp_path)
    (folder / "tokenizer.json").write_text('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert main(["predict", str(folder), "--labels", "cat,dog", "--image", "x.png"]) == 2
    assert "nested too deeply" in one_line_error(capsys)


def test_a_panic_inside_the_tokenizer_library_is_a_user_error():
    from tokenizers import Regex, normalizers

    from topoclip.core.errors import UserError
    from topoclip.preprocess.tokenizer import Tokenizer

    tokenizer = Tokenizer.train(["a red circle", "a blue square"], vocab_size=64)
    tokenizer._backend.normalizer = normalizers.Replace(Regex("(a|a)*$"), "x")  # past the library's retry limit
    with pytest.raises(UserError, match="the tokenizer failed on a caption"):
        tokenizer(["a" * 40 + "b"])


def write_tar(path: Path, members: dict) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, __import__("io").BytesIO(data))
    return path


def png_bytes() -> bytes:
    import io

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_huge_caption_is_skipped_and_counted_not_read_into_the_tokenizer(tmp_path):
    from topoclip.data.images import MAX_CAPTION_CHARS, clean_caption
    from topoclip.data.quality import BadSample
    from topoclip.data.shards import read_captions

    shard = write_tar(tmp_path / "0.tar", {"0.png": png_bytes(), "0.txt": b"x" * (4 * MAX_CAPTION_CHARS + 1),
                                           "1.png": png_bytes(), "1.txt": b"a red circle"})
    assert read_captions(str(shard), 10) == ["a red circle"]
    for raw in ("y" * (MAX_CAPTION_CHARS + 1), b"z " * (MAX_CAPTION_CHARS // 2 + 1)):
        with pytest.raises(BadSample) as caught:
            clean_caption(raw)
        assert caught.value.kind == "long_caption"


def test_a_csv_field_past_csvs_limit_skips_its_row(tmp_path):
    from topoclip.data.csv import read_caption_table

    table = tmp_path / "t.csv"
    table.write_text("filepath,title\na.jpg,red\nb.jpg," + "x" * 200_000 + "\nc.jpg,blue\n")
    with pytest.warns(UserWarning, match="skipped 1 row"):
        assert read_caption_table(table) == [("a.jpg", "red"), ("c.jpg", "blue")]


def clip_benchmark_set(root: Path, shards: str = "1", templates: str = None) -> Path:
    (root / "test").mkdir(parents=True)
    (root / "test" / "nshards.txt").write_text(shards)
    (root / "classnames.txt").write_text("red\nblue\n")
    if templates is not None:
        (root / "zeroshot_classification_templates.txt").write_text(templates)
    write_tar(root / "test" / "0.tar", {"0.png": png_bytes(), "0.cls": b"0", "1.png": png_bytes(), "1.cls": b"1"})
    return root


@pytest.mark.parametrize("damage, message", [
    (lambda root: (root / "test" / "nshards.txt").write_text("100000000"), "number of shards"),
    (lambda root: (root / "test" / "0.tar").write_bytes(b"garbage" * 100), "not a readable tar"),
    (lambda root: (root / "test" / "0.tar").write_bytes((root / "test" / "0.tar").read_bytes()[:1200]),
     "not a readable tar"),
    (lambda root: (root / "zeroshot_classification_templates.txt").write_text("\n\n"), "holds no template"),
])
def test_a_damaged_clip_benchmark_set_is_one_line(tmp_path, damage, message):
    from topoclip.data.benchmark_sets import load_wds_set

    root = clip_benchmark_set(tmp_path / "wds_x")
    assert len(load_wds_set(root).images) == 2
    damage(root)
    with pytest.raises(ValueError, match=message):
        load_wds_set(root)


# ------------------------------------------------------------------ 4. writers never delete or mix a user's files


def test_writers_leave_a_users_scratch_named_folder_alone(run, tmp_path, capsys):
    precious = {}
    for destination in ("weights", "converted", "dry"):
        folder = tmp_path / f"{destination}.tmp"
        folder.mkdir()
        (folder / "mine.txt").write_text("keep me")
        precious[destination] = folder
    assert main(["export", str(run), "--weights", str(tmp_path / "weights")]) == 0
    assert main(["convert", str(run), str(tmp_path / "converted")]) == 0
    assert main(["push", str(run), "me/model", "--dry-run", str(tmp_path / "dry")]) == 0
    for folder in precious.values():
        assert (folder / "mine.txt").read_text() == "keep me"
    assert not list(tmp_path.rglob("*.partial"))  # no scratch left behind either


def test_make_shards_refuses_a_folder_that_holds_anything(tmp_path, capsys):
    out = tmp_path / "shards"
    out.mkdir()
    (out / "00000.tar").write_bytes(b"an earlier set")
    (out / "00001.tar").write_bytes(b"an earlier set")
    assert main(["data", "make-shards", "--preset", "tiny", "--count", "4", "--out", str(out)]) == 2
    assert "not empty" in one_line_error(capsys)
    assert (out / "00000.tar").read_bytes() == b"an earlier set"
    assert main(["data", "make-shards", "--preset", "tiny", "--resume", "--out", str(out)]) == 2
    assert "--resume continues a CSV conversion" in one_line_error(capsys)
    assert main(["data", "make-shards", "--preset", "tiny", "--count", "4", "--out", str(tmp_path / "a::b")]) == 2
    assert "holds '::', which webdataset reads as a separator" in one_line_error(capsys)
    assert not (tmp_path / "a::b").exists()
    table = tmp_path / "t.csv"
    assert main(["data", "make-shards", "--csv", str(table), "--resume", "--out", str(out)]) == 2
    assert "does not exist (--csv)" in one_line_error(capsys)  # (a missing CSV: one line, before the folder is looked at)
    table.write_text("filepath\ttitle\nx.jpg\thello\n")
    assert main(["data", "make-shards", "--csv", str(table), "--out", str(tmp_path / "new")]) == 2
    assert "no column 'filepath' (--image-key)" in (line := one_line_error(capsys)) and "(--separator)" in line
    assert main(["data", "make-shards", "--csv", str(table), "--separator", "\\t", "--out", str(tmp_path / "tab")]) == 2
    error = capsys.readouterr().err.splitlines()[-1]  # (below the progress bar of the rows)
    assert error.startswith("topoclip: error: no row of") and "skipped missing_file 1" in error  # '\t': a tab
    assert main(["data", "make-shards", "--csv", str(table), "--separator", "ab", "--out", str(tmp_path / "x")]) == 2
    assert "'ab' is not one character" in one_line_error(capsys)
    table.write_text("")
    assert main(["data", "make-shards", "--csv", str(table), "--out", str(tmp_path / "new")]) == 2
    assert "is empty" in one_line_error(capsys) and not (tmp_path / "new").exists()  # no folder left behind
    table.write_text("filepath,title\n")  # a header and no rows: no shard is an error, not a success
    assert main(["data", "make-shards", "--csv", str(table), "--out", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("t.csv has no data rows")


@pytest.mark.parametrize("command", ["make-shards", "make-shards --resume", "embed", "ablate"])
def test_ctrl_c_in_a_resumable_command_says_how_to_go_on(command, tmp_path, monkeypatch, capsys):
    """Ctrl-C exits with status 130 and, where the command keeps what it finished, the command line that goes on."""
    import topoclip.data.shard_writer as writer
    import topoclip.run.embed as embedding
    import topoclip.experiments.runner as runner

    began = [True]

    def interrupted(*args, **kwargs):
        if command.startswith("make-shards") and began[0]:  # (stopped once the conversion began: its settings written)
            (tmp_path / "out").mkdir(exist_ok=True)
            (tmp_path / "out" / writer.CONVERSION).write_text("{}")
        raise KeyboardInterrupt
    for module, name in ((writer, "csv_to_shards"), (embedding, "embed"), (runner, "ablate")):
        monkeypatch.setattr(module, name, interrupted)
    out = str(tmp_path / "out")
    argv = {"make-shards": ["data", "make-shards", "--csv", "t.csv", "--out", out],
            "make-shards --resume": ["data", "make-shards", "--csv", "t.csv", "--out", out, "--resume"],
            "embed": ["embed", "run", "--texts", "t.txt", "--out", out],
            "ablate": ["ablate", "--grid", "topology", "--out", out]}[command]
    assert main(argv) == 130
    said = capsys.readouterr().err.strip()
    assert said.startswith("topoclip: interrupted; ") and out in said and "\n" not in said
    assert said.endswith("run the same command with --resume to continue after them") == (command == "make-shards")
    if command == "make-shards":  # stopped before the conversion began (hashing the CSV): nothing to resume
        (tmp_path / "out" / writer.CONVERSION).unlink()
        began[0] = False
        assert main(argv) == 130 and capsys.readouterr().err.strip() == "topoclip: interrupted"


def test_ctrl_c_in_train_names_the_resume_once_a_checkpoint_is_saved(tmp_path, monkeypatch, capsys):
    """Ctrl-C inside the first checkpoint's torch.save (whose zip writer then fails with "unexpected pos") is said as
    an interrupt, leaving no half checkpoint and nothing to go on from; after a checkpoint, the line gives the command
    that goes on, and that command finishes the run."""
    import topoclip.io.checkpoint as checkpoint
    import topoclip.core.distributed as distributed
    import topoclip.run.training.trainer as trainer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    settings = [a for s in SMALL + ["train.steps=2", "train.checkpoint_every=1"] for a in ("--set", s)]
    real_write, writes = checkpoint._WholeWrites.write, []

    def write_then_interrupt(self, data):
        writes.append(len(data))
        if len(writes) == 5:  # inside the training state's zip archive
            raise KeyboardInterrupt
        return real_write(self, data)
    monkeypatch.setattr(checkpoint._WholeWrites, "write", write_then_interrupt)
    early = tmp_path / "early"
    assert main(["train", "--preset", "tiny", "--quiet", "--out", str(early), *settings]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "topoclip: interrupted" and len(writes) == 5
    assert not list((early / "checkpoints").iterdir())  # (the scratch of the checkpoint removed)
    monkeypatch.setattr(checkpoint._WholeWrites, "write", real_write)
    monkeypatch.setattr(trainer, "finish", interrupted)  # after both steps' checkpoints, before the evaluation
    folder = tmp_path / "late"
    assert main(["train", "--preset", "tiny", "--quiet", "--out", str(folder), *settings]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (f"topoclip: interrupted; {folder} keeps its checkpoints: run "
                                                        f"`topoclip train --resume {folder}` to continue from the newest")
    resume = ["train", "--resume", str(folder), "--quiet", "--set", "train.steps=3"]  # (a longer run: the same again)
    assert main(resume) == 130
    assert capsys.readouterr().err.splitlines()[-1].endswith("keeps its checkpoints: run the same command to continue "
                                                             "from the newest")
    monkeypatch.setattr(distributed, "launch_rank", lambda: 1)  # under torchrun or srun only rank 0 says it
    assert main(resume) == 130 and capsys.readouterr().err.splitlines()[-1] == "topoclip: interrupted"
    monkeypatch.undo()
    assert main(resume) == 0 and (folder / "eval.json").is_file()


@pytest.fixture()
def images(tmp_path) -> Path:
    folder = tmp_path / "images"
    folder.mkdir()
    for index in range(3):
        Image.new("RGB", (9, 9), (40 * index, 10, 10)).save(folder / f"{index}.png")
    return folder


def test_embed_refuses_to_resume_against_a_changed_model_or_listing(run, tmp_path, images, capsys):
    model = tmp_path / "model"
    shutil.copytree(run, model)
    out = tmp_path / "out"
    options = ["--images", str(images), "--out", str(out), "--shard-size", "2", "--workers", "0", "--quiet"]
    assert main(["embed", str(model), *options]) == 0
    summary = json.loads((out / "embed.json").read_text())
    assert summary["images"]["kept"] == 3 and len(summary["settings"]["weights_sha256"]) == 64
    # A newer checkpoint in the run folder: the same --model argument now means other weights.
    shutil.copytree(model / "checkpoints" / "step-000002", model / "checkpoints" / "step-000003")
    newest = model / "checkpoints" / "step-000003" / "model.safetensors"
    from safetensors.torch import load_file, save_file

    weights = load_file(newest)
    save_file({name: tensor + 0.01 for name, tensor in weights.items()}, newest)
    assert main(["embed", str(model), *options]) == 2
    assert "the weights" in one_line_error(capsys)
    shutil.rmtree(model / "checkpoints" / "step-000003")
    Image.new("RGB", (9, 9), (0, 200, 10)).save(images / "0a.png")  # sorts between 0.png and 1.png
    assert main(["embed", str(model), *options]) == 2
    assert "the image files listed" in one_line_error(capsys)


@pytest.mark.parametrize("damage", ["not json", "[1, 2]", '{"settings": 3}', "\udcff"])
def test_embed_with_a_damaged_summary_is_one_line(run, tmp_path, images, capsys, damage):
    out = tmp_path / "out"
    out.mkdir()
    (out / "embed.json").write_bytes(damage.encode("utf-8", "surrogateescape"))
    assert main(["embed", str(run), "--images", str(images), "--out", str(out), "--workers", "0", "--quiet"]) == 2
    assert "damaged" in one_line_error(capsys)


def test_embed_texts_not_utf8_and_a_truncated_shard_are_one_line(run, tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_bytes(b"a red circle\n\xff\xfe\n")
    assert main(["embed", str(run), "--texts", str(texts), "--out", str(tmp_path / "a"), "--quiet"]) == 2
    assert "not UTF-8" in one_line_error(capsys)
    shard = write_tar(tmp_path / "0.tar", {"0.png": png_bytes(), "0.txt": b"red", "1.png": png_bytes(), "1.txt": b"x"})
    shard.write_bytes(shard.read_bytes()[:1200])
    assert main(["embed", str(run), "--images", str(shard), "--out", str(tmp_path / "b"), "--workers", "0",
                 "--quiet"]) == 2
    assert "not a readable tar" in one_line_error(capsys)


# ------------------------------------------------------------------ 5. a bad training state falls back


def damaged_states():
    def optimizer_groups(state):
        state["optimizer"]["param_groups"] = state["optimizer"]["param_groups"][:1]

    def moment_shape(state):
        moments = next(iter(state["optimizer"]["state"].values()))
        moments["exp_avg"] = torch.zeros(3, 3, 3)

    def streams(state):
        state["data"]["streams"] = [{"epoch": "x"}]

    def nan_moments(state):
        for moments in state["optimizer"]["state"].values():
            moments["exp_avg_sq"].fill_(float("nan"))

    return {"missing key": lambda state: state.pop("scheduler"),
            "nan moments": nan_moments,
            "wrong type": lambda state: state.update(step="12"),
            "other groups": optimizer_groups,
            "moment shape": moment_shape,
            "rng": lambda state: state["rng"].update(torch=torch.zeros(3)),
            "counts": lambda state: state["data"].update(bad={"corrupt_image": "many"}),
            "stream": streams,
            "not a dict": lambda state: state.clear() or state.update(step=1)}


@pytest.mark.slow
@pytest.mark.parametrize("damage", sorted(damaged_states()))
def test_a_bad_training_state_falls_back_to_the_checkpoint_before(run, tmp_path, capsys, damage):
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    (folder / "eval.json").unlink()
    file = folder / "checkpoints" / "step-000002" / TRAINING_STATE
    state = torch.load(file, weights_only=True)
    damaged_states()[damage](state)
    torch.save(state, file)
    assert main(["train", "--resume", str(folder), "--quiet", "--set", "train.steps=3"]) == 0
    captured = capsys.readouterr()
    assert "skipping damaged checkpoint step-000002" in captured.err and "resuming from step-000001" in captured.out


# ------------------------------------------------------------------ 5. numbers past what they end in


@pytest.mark.parametrize("setting", ["train.seed=1180591620717411303424", "train.seed=" + "9" * 5000,
                                     "model.vision.width=" + "1" + "0" * 400])
def test_integers_past_int64_are_one_line(setting, tmp_path, capsys):
    assert main(["train", "--preset", "tiny", "--set", setting, "--out", str(tmp_path / "run")]) == 2
    assert "64-bit" in one_line_error(capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text", ['{"train": {"seed": 1180591620717411303424}}', '{"train": {"seed": ' + "9" * 5000 + "}}",
                                  '{"base": ["tiny"]}', '{"base": 3}'])
def test_a_preset_file_with_a_huge_integer_or_a_bad_base_is_one_line(text, tmp_path, capsys):
    preset = tmp_path / "preset.json"
    preset.write_text(text)
    assert main(["train", "--preset", str(preset), "--out", str(tmp_path / "run")]) == 2
    one_line_error(capsys)


def test_a_folders_config_with_a_huge_integer_is_one_line(run, tmp_path, capsys):
    folder = resumable_copy(run, tmp_path)
    text = (folder / "config.json").read_text().replace('"seed": 0', '"seed": ' + "9" * 5000, 1)
    (folder / "config.json").write_text(text)
    assert main(["train", "--resume", str(folder), "--quiet"]) == 2
    one_line_error(capsys)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [["model.vision.image_size=8192", "model.vision.patch_size=1"],
                                      ["model.text.width=16384", "model.text.heads=16", "model.text.layers=1024"]])
def test_sizes_that_pass_alone_but_not_together_are_refused_before_anything_is_built(settings, tmp_path, capsys):
    options = [part for setting in settings for part in ("--set", setting)]
    assert main(["train", "--preset", "tiny", *options, "--out", str(tmp_path / "run")]) == 2
    assert "positions" in one_line_error(capsys) if "model.vision.patch_size=1" in settings else True
    from topoclip.model.clip import CLIP

    with pytest.raises(ConfigError, match="positions, over 65,536|over the 17,179,869,184"):
        CLIP(load_config("tiny", settings).model)


def test_init_from_a_folder_claiming_a_huge_model_is_refused_from_the_header(run, tmp_path, capsys):
    folder = checkpoint_copy(run, tmp_path)
    values = json.loads((folder / "topoclip_config.json").read_text())
    values["model"]["vision"].update(width=8192, heads=64, layers=24)
    (folder / "topoclip_config.json").write_text(json.dumps(values))
    settings = [part for s in SMALL + ["train.steps=1"] for part in ("--set", s)]
    assert main(["train", "--init-from", str(folder), "--out", str(tmp_path / "new"), "--quiet", *settings]) == 2
    assert "does not fit the model" in one_line_error(capsys)


# ------------------------------------------------------------------ 5. a run's own files, damaged


@pytest.mark.parametrize("damage", ["garbage", "[1, 2]", '[{"dataset": "x", "task": "zeroshot_retrieval"}]',
                                    "[" * 100_000])
def test_a_damaged_eval_json_is_one_line_on_resume_and_a_note_on_push(run, tmp_path, capsys, damage):
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    (folder / "eval.json").write_text(damage)
    shutil.rmtree(folder / "plots")  # a finished run with work left over reads eval.json
    metrics = folder / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines() if '"final"' not in line))
    assert main(["train", "--resume", str(folder), "--quiet"]) == 2
    assert "eval.json is damaged" in one_line_error(capsys)
    assert main(["push", str(folder), "me/model", "--dry-run", str(tmp_path / "dry")]) == 0
    assert "no evaluation table" in capsys.readouterr().err
    assert "## Evaluation" not in (tmp_path / "dry" / "README.md").read_text()


@pytest.mark.parametrize("line", ['{"step": 1, "loss": 2.0, "lr": 0.1}', '{"step": 1, "loss": 2.0, "scale": "x"}',
                                  '{"step": ' + "9" * 5000 + "}", "[" * 100_000, '{"step": 1, "eval": {"x/top1": "y"}}',
                                  '{"step": 1, "loss": "' + "x" * 50_000_000 + '"}'])
def test_metrics_lines_without_their_numbers_are_left_out_of_the_plots(tmp_path, line):
    from topoclip.run.training.logger import plot_metrics

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0, "loss": 3.0, "scale": 10.0, "lr": 0.1}\n' + line + "\n")
    written = plot_metrics(metrics, tmp_path / "plots")
    assert {path.name for path in written} >= {"loss.png", "temperature.png", "learning_rate.png"}


@pytest.mark.parametrize("repo_id", ['me/mo"del', "me/model\nlicense: x", "../x", "me/../x"])
def test_a_hub_repo_id_the_hub_would_refuse_is_one_line_before_anything_is_written(run, tmp_path, capsys, repo_id):
    assert main(["push", str(run), repo_id, "--dry-run", str(tmp_path / "dry")]) == 2
    assert "not a Hub repository id" in one_line_error(capsys)
    assert not (tmp_path / "dry").exists()


def test_a_license_is_an_identifier_not_yaml(run, tmp_path, capsys):
    assert main(["push", str(run), "me/model", "--license", "mit\nbase_model: evil", "--dry-run", str(tmp_path / "d")]) == 2
    assert "not a license identifier" in one_line_error(capsys)


def test_embed_counts_every_shard_after_a_resume(run, tmp_path, images, monkeypatch):
    from topoclip.run import embed as embedding

    (images / "bad.png").write_bytes(b"not an image")
    whole = embedding.embed(run, tmp_path / "whole", images=str(images), shard_size=2, num_workers=0, progress=False)
    real_write, calls = embedding.ShardWriter.write, []

    def dies_on_the_second_shard(self, index, *args):
        calls.append(index)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_write(self, index, *args)

    monkeypatch.setattr(embedding.ShardWriter, "write", dies_on_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        embedding.embed(run, tmp_path / "resumed", images=str(images), shard_size=2, num_workers=0, progress=False)
    monkeypatch.setattr(embedding.ShardWriter, "write", real_write)
    resumed = embedding.embed(run, tmp_path / "resumed", images=str(images), shard_size=2, num_workers=0, progress=False)
    assert resumed["images"]["resumed_after_shards"] == 1
    counts = {key: whole["images"][key] for key in ("seen", "kept", "bad")}
    assert counts == {"seen": 4, "kept": 3, "bad": {"corrupt_image": 1}}
    assert {key: resumed["images"][key] for key in counts} == counts


def test_embed_on_a_full_disk_says_so_and_leaves_no_scratch(run, tmp_path, images, monkeypatch, capsys):
    import errno

    real_save = np.save

    def full_disk(file, array):
        real_save(file, array)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "save", full_disk)
    out = tmp_path / "out"
    assert main(["embed", str(run), "--images", str(images), "--out", str(out), "--workers", "0", "--quiet"]) == 2
    error = one_line_error(capsys)
    assert "no space left" in error and "run the same command to resume" in error
    assert not [path for path in out.rglob("*") if path.name.startswith(".")]


# ------------------------------------------------------------------ round 3b: the independent hostile tester's cases


@pytest.mark.parametrize("link", [".lock", "metrics.jsonl", "plots", "checkpoints/step-000009", "plots/loss.png"])
def test_a_link_in_a_run_folder_is_refused_before_anything_is_written_through_it(run, tmp_path, capsys, link):
    folder = resumable_copy(run, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious")
    (folder / link).parent.mkdir(parents=True, exist_ok=True)
    if (folder / link).is_dir():
        shutil.rmtree(folder / link)
    else:
        (folder / link).unlink(missing_ok=True)
    (folder / link).symlink_to(victim if link in (".lock", "metrics.jsonl", "plots/loss.png") else outside)
    assert main(["train", "--resume", str(folder), "--quiet"]) == 2
    assert "symbolic link" in one_line_error(capsys)
    assert victim.read_text() == "precious" and sorted(p.name for p in outside.iterdir()) == ["victim.txt"]


@pytest.mark.slow
def test_a_folders_config_never_turns_on_wandb(run, tmp_path, capsys):
    folder = resumable_copy(run, tmp_path)
    values = json.loads((folder / "config.json").read_text())
    values["train"]["report_to"] = ["wandb"]
    (folder / "config.json").write_text(json.dumps(values))
    assert main(["train", "--resume", str(folder), "--quiet"]) == 2
    assert "W&B uploads to the network" in one_line_error(capsys)
    assert not (folder / "wandb-id.txt").exists()
    source = checkpoint_copy(run, tmp_path)
    values = json.loads((source / "topoclip_config.json").read_text())
    values["train"]["report_to"] = ["wandb"]
    (source / "topoclip_config.json").write_text(json.dumps(values))
    settings = [part for s in SMALL + ["train.steps=1"] for part in ("--set", s)]
    assert main(["train", "--init-from", str(source), "--out", str(tmp_path / "new"), "--quiet", *settings]) == 0
    assert "wandb" not in json.loads((tmp_path / "new" / "config.json").read_text())["train"]["report_to"]


def test_wandb_that_cannot_start_is_one_line(tmp_path, capsys, monkeypatch):
    wandb = pytest.importorskip("wandb")

    def refused(**options):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refused)
    settings = [part for s in SMALL + ["train.steps=1", 'train.report_to=["wandb"]'] for part in ("--set", s)]
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--quiet", *settings]) == 2
    assert "W&B could not start (No API key configured" in one_line_error(capsys)


@pytest.mark.slow
@pytest.mark.parametrize("fifo", ["topoclip_config.json", "training_state.pt", "metrics.jsonl"])
def test_a_fifo_in_a_checkpoint_or_run_folder_never_blocks(run, tmp_path, capsys, fifo):
    import os

    if fifo == "topoclip_config.json":
        folder = checkpoint_copy(run, tmp_path)
        (folder / fifo).unlink()
        os.mkfifo(folder / fifo)
        Image.new("RGB", (9, 9)).save(tmp_path / "x.png")
        assert main(["predict", str(folder), "--labels", "a,b", "--image", str(tmp_path / "x.png")]) == 2
        assert "not a regular file" in one_line_error(capsys)
        return
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    (folder / "eval.json").unlink()
    target = folder / "checkpoints" / "step-000002" / fifo if fifo == "training_state.pt" else folder / fifo
    target.unlink()
    os.mkfifo(target)
    status = main(["train", "--resume", str(folder), "--quiet", "--set", "train.steps=3"])
    captured = capsys.readouterr()
    if fifo == "training_state.pt":  # the damaged newest checkpoint: resumed from the one before
        assert status == 0 and "skipping damaged checkpoint step-000002" in captured.err
    else:
        assert status == 2 and "special files (metrics.jsonl)" in captured.err


@pytest.mark.parametrize("model, message", [
    ({"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "<nope>"}, "the tokenizer failed on a caption"),
])
def test_a_tokenizer_that_fails_on_a_caption_is_one_line(run, tmp_path, capsys, model, message):
    folder = checkpoint_copy(run, tmp_path)
    edit_tokenizer(folder, lambda t: t.update(model={**model, "vocab": {**t["model"]["vocab"]}}))
    Image.new("RGB", (9, 9)).save(tmp_path / "x.png")
    assert main(["predict", str(folder), "--labels", "qqqq,zzzz", "--image", str(tmp_path / "x.png")]) == 2
    assert message in one_line_error(capsys)


def test_a_label_that_is_not_text_is_one_line(run, tmp_path, capsys):
    Image.new("RGB", (9, 9)).save(tmp_path / "x.png")
    assert main(["predict", str(run), "--labels", "\udcff\udcfe,dog", "--image", str(tmp_path / "x.png")]) == 2
    assert "lone surrogate" in one_line_error(capsys)


def test_a_normalizer_that_inserts_megabytes_is_refused_on_loading(run, tmp_path, capsys):
    folder = checkpoint_copy(run, tmp_path)
    edit_tokenizer(folder, lambda t: t.update(normalizer={"type": "Replace", "pattern": {"String": "a"},
                                                          "content": "x" * 3_000_000}))
    Image.new("RGB", (9, 9)).save(tmp_path / "x.png")
    assert main(["predict", str(folder), "--labels", "a" * 2000, "--image", str(tmp_path / "x.png")]) == 2
    assert "inserts a string of 3,000,000 characters" in one_line_error(capsys)


def test_a_text_is_read_up_to_max_text_chars(run):
    from topoclip.io.checkpoint import load_checkpoint
    from topoclip.preprocess.tokenizer import MAX_TEXT_CHARS

    _, tokenizer, _ = load_checkpoint(run)
    huge = "a red circle " * (MAX_TEXT_CHARS // 4)  # 3.25 × the bound: cut, not read whole
    assert torch.equal(tokenizer([huge]).input_ids, tokenizer([huge[:MAX_TEXT_CHARS]]).input_ids)


def test_a_gzip_bomb_of_merges_is_read_no_further_than_the_bound(tmp_path):
    import gzip

    from topoclip.io.convert.openai import MAX_MERGES_BYTES, read_merges

    bomb = tmp_path / "bpe_simple_vocab_16e6.txt.gz"
    with gzip.open(bomb, "wb", 9) as file:
        for _ in range((MAX_MERGES_BYTES >> 20) + 1):
            file.write(b"a b\n" * (1 << 18))  # 1 MB at a time
    with pytest.raises(ConfigError, match="more than 64 MB of merges"):
        read_merges(bomb)


@pytest.mark.parametrize("text", [b"\xff\xfe{}", b"[]", b'{"model_cfg": []}',
                                  b'{"model_cfg": {}, "preprocess_cfg": {"mean": 5, "std": 1}}',
                                  b'{"model_cfg": {"text_cfg": {"pool_type": "eos", "eos_id": "x"}}}'])
def test_a_bad_open_clip_config_is_one_line(tmp_path, capsys, text):
    from safetensors.torch import save_file

    folder = tmp_path / "openclip"
    folder.mkdir()
    save_file({"x": torch.zeros(1)}, folder / "open_clip_model.safetensors")
    (folder / "open_clip_config.json").write_bytes(text)
    assert main(["convert", "--from", "openclip", str(folder), str(tmp_path / "out")]) == 2
    assert "open_clip_config.json" in one_line_error(capsys)


@pytest.mark.parametrize("command", [
    ["data", "make-shards", "--csv", "t.csv", "--out", "o", "--image-size", "0"],
    ["data", "make-shards", "--out", "o", "--samples-per-shard", "-1"],
    ["analyze", "gradcam", "ck", "--pairs", "-1"],
    ["analyze", "experts", "ck", "--size", "0"],
    ["analyze", "equilibrium", "ck", "--draws", "0"],
    ["analyze", "equilibrium", "ck", "--fractions", "nan"],
    ["embed", "ck", "--workers", "x"],
    ["train", "--no-such-flag"],
    ["eval"],
])
def test_a_mistyped_command_line_is_one_line(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(command) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("topoclip: error: ") and "--help" in error
    assert list(tmp_path.iterdir()) == []


def test_ablate_with_a_hostile_grid_file_is_one_line(tmp_path, capsys):
    for index, text in enumerate(['{', '[1]', '{"preset": "tiny", "axes": [{"name": "a", "levels": []}]}',
                                  '{"preset": "tiny", "axes": [{"name": "a", "levels": [{"label": 5}]}]}',
                                  "[" * 100_000]):
        grid = tmp_path / f"grid{index}.json"
        grid.write_text(text)
        assert main(["ablate", "--grid", str(grid), "--seeds", "1", "--steps", "1", "--out", str(tmp_path / "a"),
                     "--probe-size", "0"]) == 2
        assert "grid" in one_line_error(capsys)


def test_a_deeply_nested_karpathy_file_is_one_line(run, tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["eval", str(run), "--set", f'evaluate.retrieval=["{deep}"]', "--set", "evaluate.size=16"]) == 2
    assert "not valid JSON" in one_line_error(capsys)


def test_export_into_a_link_is_refused_and_leaves_nothing(run, tmp_path, capsys):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert main(["export", str(run), "--weights", str(tmp_path / "link")]) == 2
    assert "symbolic link" in one_line_error(capsys)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["link", "real"] and not list((tmp_path / "real").iterdir())


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_loader_workers_end_with_a_killed_parent(tmp_path):
    """A `kill -9`'d trainer's DataLoader workers end with it, even in the middle of a blocking read (they held
    its run folder's lock, naming a dead process to the next run)."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(f"""
import os, time, torch
from topoclip.core.workers import start_worker

class Slow(torch.utils.data.Dataset):
    def __len__(self): return 1000
    def __getitem__(self, i):  # a read that blocks: torch's own watchdog checks for the parent between reads only
        time.sleep(120)
        return i

def init(worker):
    start_worker(worker)
    open({str(tmp_path)!r} + f"/worker-{{os.getpid()}}", "w").close()

for batch in torch.utils.data.DataLoader(Slow(), num_workers=2, worker_init_fn=init):
    time.sleep(0.05)
""")
    parent = subprocess.Popen([sys.executable, str(script)])
    deadline = time.time() + 60
    while len(list(tmp_path.glob("worker-*"))) < 2 and time.time() < deadline:
        time.sleep(0.1)
    workers = [int(path.name.split("-")[1]) for path in tmp_path.glob("worker-*")]
    assert len(workers) == 2
    parent.send_signal(signal.SIGKILL)
    parent.wait()

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
        except FileNotFoundError:
            return False

    deadline = time.time() + 10
    while any(map(alive, workers)) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(map(alive, workers))


def test_a_stray_quote_in_a_caption_table_loses_no_row_silently(tmp_path):
    """Found on main: a caption that opens with a quote and never closes it made csv read every row after it into one
    caption (996 of 1,000 rows gone, without a word); one that closes rows later did the same up to that row; one whose
    field outgrew csv's limit cost thousands of rows counted as "1 row". Now: never closing, or closing past the limit,
    refuses the table in one line naming the line; a row over several lines (a caption may hold a line break) is read
    and counted in one warning naming the longest; a row with a line too long to read is skipped whole and counted
    with its lines. Every reader shares CaptionTable."""
    from topoclip.core.errors import ConfigError
    from topoclip.data.csv import read_caption_table

    rows = ["filepath,title", *(f"{i}.png,caption {i}" for i in range(1000))]
    table = tmp_path / "t.csv"
    table.write_text("\n".join(rows[:5] + ['4.png,"a stray quote'] + rows[6:]) + "\n")
    with pytest.raises(ConfigError, match="the quote that opens a field on line 6 never closes, so csv read the 995 "):
        read_caption_table(table)
    table.write_text("\n".join(rows[:5] + ['4.png,"a stray quote'] + rows[6:600] + ['598.png,a closing " quote"'])
                     + "\n" + "\n".join(rows[601:]) + "\n")
    with pytest.warns(UserWarning, match=r"1 row\(s\) run over several lines \(lines 6–601 the longest\)"):
        assert len(read_caption_table(table)) == 1000 - 595
    table.write_text('filepath,title\na.png,"two\nlines"\nb.png,blue')  # a line break in a caption, no newline at the end
    with pytest.warns(UserWarning, match=r"1 row\(s\) run over several lines \(lines 2–3"):
        assert read_caption_table(table) == [("a.png", "two\nlines"), ("b.png", "blue")]
    for text, problem in (('"filepath,title\na.png,red\n', "never closes"), ('"filepath,title\na.png,red"\n',
                                                                             "closes on line 2")):
        table.write_text(text)
        with pytest.raises(ConfigError, match=f"a quote opens in its header row and {problem}"):
            read_caption_table(table)
    # In a table longer than csv's field limit (131,072 characters) the open field outgrows it first, and csv would go
    # on at the next line, reading the rest of the field as rows: refused too (the review found 2,778 lines lost so).
    lines = ["filepath,title", "a.jpg,red", 'b.jpg,"open', *(f"{i:04d}.png,{'x' * 90}" for i in range(2000)), 'c.jpg,blue']
    table.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"the field that opens with a quote on line 3 runs past what csv reads \(to "
                                          r"line 1,314\)"):  # "open\n", then 100 characters a line: 5 + 1,311·100 > 131,072
        read_caption_table(table)
    # ... or on its own line, left open there (the second review: the lines after it were read as rows)
    table.write_text(f'filepath,title\na.png,"{"y" * 140_000}\nb.png,fragment\nc.png,"end of it"\nd.png,ok\n')
    with pytest.raises(ConfigError, match="the field that opens with a quote on line 2 runs past what csv reads, field"):
        read_caption_table(table)
    # A quoted field left open on a line too long to read: the row it opens is skipped whole, to its closing quote
    # (the second review: the quote went with the line and its field's lines came out as rows)
    table.write_text(f'filepath,title\na.png,"start{"x" * (1 << 21)}\ncontinuation\nb.png,end"\nc.png,ok\n')
    with pytest.warns(UserWarning, match=r"skipped 1 row\(s\) that cannot be read \(3 lines\), e\.g\. line 2: over"):
        assert read_caption_table(table) == [("c.png", "ok")]
    # ... while csv's own quoting is followed, not a count of quotes (the third review): a QUOTE_ALL export's long line
    # is one row skipped; a literal quote inside an unquoted field opens nothing; one after a separator does
    long = "z" * ((1 << 20) + 1)
    table.write_text(f'"filepath","title"\n"a.png","ok"\n"b.png","{long}"\n"c.png","fine"\n')
    with pytest.warns(UserWarning, match="skipped 1 row"):
        assert read_caption_table(table) == [("a.png", "ok"), ("c.png", "fine")]
    table.write_text(f'filepath,title\na.png,ok\nb.png,a 5" screen {"y" * 200_000}\nc.png,fine\n')
    with pytest.warns(UserWarning, match="skipped 1 row"):
        assert read_caption_table(table) == [("a.png", "ok"), ("c.png", "fine")]
    table.write_text(f'filepath,title\nb.png,x" y,"{"y" * 200_000}\nd.png,inside\nstill",more\nc.png,fine\n')
    with pytest.raises(ConfigError, match="the field that opens with a quote on line 2 runs past what csv reads, field"):
        read_caption_table(table)
    # A line over 1 MiB (left out unread) inside a quoted field: its row is not whole, so it is skipped and counted
    # with its lines; with lone-CR line endings the rows after one are kept.
    big = "z" * ((1 << 20) + 5)
    table.write_text(f'filepath,title\na.jpg,"start\n{big}\nend"\nb.jpg,bb\n')
    with pytest.warns(UserWarning, match=r"skipped 1 row\(s\) that cannot be read \(3 lines\), e\.g\. line 3: over 1,048,576"):
        assert read_caption_table(table) == [("b.jpg", "bb")]
    table.write_text(f"filepath,title\rbig.jpg,{big}\r" + "".join(f"{k}.jpg,cap {k}\r" for k in range(3)), newline="")
    with pytest.warns(UserWarning, match=r"skipped 1 row\(s\) that cannot be read, e\.g\. line 2: over"):
        assert read_caption_table(table) == [(f"{k}.jpg", f"cap {k}") for k in range(3)]
    table.write_text('\ufeff"filepath","title"\na.jpg,aa\n')  # a BOM before a quoted header is no part of it
    assert read_caption_table(table) == [("a.jpg", "aa")]


def test_a_table_warning_turned_into_an_error_is_raised_each_time(tmp_path):
    from topoclip.data.csv import read_caption_table

    table = tmp_path / "t.csv"
    table.write_text('filepath,title\na.png,"two\nlines"\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # the review: the second read was silent (the message was noted as said before it was)
            with pytest.raises(UserWarning, match="run over several lines"):
                read_caption_table(table)


def test_a_stray_quote_in_the_training_table_is_one_line_before_any_run_folder(tmp_path, capsys):
    from topoclip.cli import main

    table = tmp_path / "t.csv"
    table.write_text("filepath,title\n" + "".join(f"{i}.png,caption {i}\n" for i in range(30)) + '30.png,"stray\n'
                     + "".join(f"{i}.png,caption {i}\n" for i in range(31, 40)))
    assert main(["train", "--preset", "tiny", "--train-data", str(table), "--batch-size", "4", "--out",
                 str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "the quote that opens a field on line 32 never closes" in error, error
    assert not (tmp_path / "run").exists()
