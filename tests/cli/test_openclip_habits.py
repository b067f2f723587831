"""An OpenCLIP user's habits on topoclip's command line (issue #43): OpenCLIP's training flags are aliases for the
topoclip settings they stand for, or answered in one line naming what to do; no abbreviations; one device default."""
import json
import os

import pytest
import torch

from topoclip.cli import main
from topoclip.cli.openclip_flags import FLAGS


def printed_config(capsys, *flags, env=None):
    assert main(["train", "--preset", "tiny", *flags, "--print-config"]) == 0
    return json.loads(capsys.readouterr().out)


def test_openclip_training_flags_are_aliases(capsys):
    config = printed_config(capsys, "--lock-image", "--lock-image-unlocked-groups", "2", "--report-to", "all",
                            "--precision", "amp_bf16", "--lr", "1e-3", "--wd", "0.1", "--warmup", "7", "--seed", "3",
                            "--workers", "0", "--grad-clip-norm", "2.5", "--grad-checkpointing", "--force-quick-gelu",
                            "--name", "mine")
    train = config["train"]
    assert (train["lock_image"], train["lock_image_unlocked_groups"], train["report_to"], train["precision"]) == (
        True, 2, ["tensorboard", "wandb"], "bf16")
    assert (train["lr"], train["weight_decay"], train["warmup_steps"], train["seed"], train["num_workers"],
            train["grad_clip"], train["gradient_checkpointing"]) == (1e-3, 0.1, 7, 3, 0, 2.5, True)
    assert config["model"]["vision"]["activation"] == config["model"]["text"]["activation"] == "quick_gelu"
    assert config["name"] == "mine"


def test_set_wins_over_an_openclip_flag(capsys):
    assert printed_config(capsys, "--lr", "1e-3", "--set", "train.lr=2e-3")["train"]["lr"] == 2e-3


def test_batch_size_is_per_gpu_and_accum_freq_multiplies_it_as_in_openclip(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun's
    train = printed_config(capsys, "--batch-size", "32", "--accum-freq", "2")["train"]
    assert (train["batch_size"], train["accumulation_steps"]) == (32 * 4 * 2, 2)


def test_epochs_become_steps_of_the_data_s_epoch(capsys):
    config = printed_config(capsys, "--batch-size", "64", "--epochs", "3")
    epoch = -(-config["data"]["scenes"]["train_size"] // 64)
    assert config["train"]["steps"] == 3 * epoch


def test_train_data_picks_the_source_as_openclip_s_dataset_type_does(capsys):
    for flags, source in ([["--train-data", "shards/{00000..00009}.tar"], "shards"],
                          [["--train-data", "pairs.csv", "--csv-img-key", "path"], "csv"],
                          [["--train-data", "x", "--dataset-type", "webdataset", "--dataset-resampled",
                            "--train-num-samples", "1000"], "shards"]):
        data = printed_config(capsys, *flags)["data"]
        assert data["source"] == source and data["train_data"] == flags[1]


@pytest.mark.parametrize("value", [[], ["x"]], ids=["switch", "with a value"])
@pytest.mark.parametrize("flag", [flag.name for flag in FLAGS if flag.instead])
def test_an_openclip_flag_without_an_equivalent_is_one_line_naming_what_to_do(flag, value, capsys):
    """Switches (OpenCLIP's --horovod, --trace) and flags with a value (--opt, --val-data PATH) alike."""
    assert main(["train", "--preset", "tiny", flag, *value, "--print-config"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"{flag} is OpenCLIP's;" in error


def test_every_openclip_flag_has_its_line_in_help(capsys):
    """Failed on main: the group "OpenCLIP's flags" printed empty (every flag's help suppressed)."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = capsys.readouterr().out.split("OpenCLIP's flags:")[1]
    for flag in FLAGS:
        assert flag.name in shown and flag.help.split()[0] in shown, flag.name


def test_what_topoclip_always_does_is_accepted_and_changes_nothing(capsys):
    """Failed on main: --local-loss --gather-with-grad, on every multi-GPU line of OpenCLIP's README, were refused."""
    plain = printed_config(capsys)
    accepted = [flag.name for flag in FLAGS if flag.accepted]
    assert {"--local-loss", "--gather-with-grad"} <= set(accepted)
    values = {"--dist-url": ["env://"], "--dist-backend": ["nccl"]}
    assert printed_config(capsys, *[part for name in accepted for part in [name, *values.get(name, [])]]) == plain


def test_siglip_and_the_other_aliases_set_what_openclip_does(capsys):
    """Failed on main: --siglip was argparse's "unrecognized arguments"; OpenCLIP's --siglip is the sigmoid loss with
    the model started at logit scale 10 and bias −10 (open_clip_train.main)."""
    config = printed_config(capsys, "--siglip", "--beta1", "0.9", "--beta2", "0.95", "--log-every-n-steps", "5",
                            "--device", "cpu", "--delete-previous-checkpoint")
    train, temperature = config["train"], config["model"]["temperature"]
    assert (train["loss"], temperature["bias_init"]) == ("sigmoid", -10.0)
    assert temperature["init"] == pytest.approx(2.302585092994046, rel=1e-15)
    assert (train["betas"], train["log_every"], train["device"], train["keep_checkpoints"]) == ([0.9, 0.95], 5, "cpu", 1)
    assert main(["train", "--preset", "tiny", "--beta2", "0.95", "--print-config"]) == 2
    assert "give both" in capsys.readouterr().err
    model = printed_config(capsys, "--image-mean", "0.5", "0.5", "0.5", "--image-std", "0.2", "0.2", "0.2",
                           "--force-image-size", "48", "--force-context-length", "16")["model"]
    assert (model["vision"]["mean"], model["vision"]["std"], model["vision"]["image_size"],
            model["text"]["context_length"]) == ([0.5] * 3, [0.2] * 3, 48, 16)
    assert main(["train", "--preset", "tiny", "--force-image-size", "48", "64", "--print-config"]) == 2
    assert "square" in capsys.readouterr().err


def test_frequencies_in_epochs_become_steps(capsys):
    config = printed_config(capsys, "--batch-size", "64", "--epochs", "4", "--save-frequency", "2",
                            "--zeroshot-frequency", "1")
    epoch = -(-config["data"]["scenes"]["train_size"] // 64)
    assert (config["train"]["steps"], config["train"]["checkpoint_every"], config["train"]["eval_every"]) == (
        4 * epoch, 2 * epoch, epoch)
    assert main(["train", "--preset", "tiny", "--train-data", "s/{0..3}.tar", "--save-frequency", "1",
                 "--print-config"]) == 2
    assert "train.checkpoint_every=N" in capsys.readouterr().err


@pytest.mark.slow
def test_logs_and_name_make_the_run_folder_as_openclip_s(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    quick = ["train", "--preset", "tiny", "--quiet", "--set", "train.steps=1", "--set", "evaluate.size=16"]
    assert main([*quick, "--logs", "logs", "--name", "mine"]) == 0
    assert (tmp_path / "logs" / "mine" / "config.json").is_file()
    assert main([*quick, "--logs", "logs"]) == 0
    assert [path.name.startswith("tiny-") for path in (tmp_path / "logs").iterdir() if path.name != "mine"] == [True]
    assert main([*quick, "--logs", "logs", "--out", "elsewhere"]) == 2
    assert "not both" in capsys.readouterr().err and not (tmp_path / "elsewhere").exists()
    # OpenCLIP's way back into a run: --resume latest with the same --logs and --name
    assert main(["train", "--logs", "logs", "--name", "mine", "--resume", "latest", "--quiet", "--set",
                 "train.steps=2"]) == 0
    assert max(json.loads(line)["step"] for line in (tmp_path / "logs" / "mine" / "metrics.jsonl").read_text().splitlines()
               if line.startswith("{")) == 2
    capsys.readouterr()
    assert main(["train", "--resume", "latest", "--print-config"]) == 2
    assert "give --logs LOGS --name NAME" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    (tmp_path / "logs" / "taken").write_text("")
    for flags, said in ((["--logs", "a-file"], "--logs a-file: not a folder"),
                        (["--logs", "logs", "--name", "taken"], "is a file, not a folder; choose another --out (or "
                                                                "--logs/--name)"),
                        (["--logs", "logs", "--name", "a/b"], "with --logs LOGS it names the run folder LOGS/NAME"),
                        (["--logs", "logs", "--name", "..", "--resume", "latest"], "must be a plain folder name")):
        assert main([*quick, *flags]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and said in error, error


def test_a_tab_separated_csv_is_said_before_any_folder_is_made(tmp_path, capsys):
    """Failed on main: OpenCLIP's tab-separated table named .csv got, with --epochs, a message about shards, and
    without it a run folder left empty behind the error."""
    table = tmp_path / "pairs.csv"
    table.write_text("filepath\ttitle\n" + "".join(f"{i}.png\ta caption\n" for i in range(8)))
    flags = ["train", "--preset", "tiny", "--train-data", str(table), "--csv-img-key", "filepath",
             "--csv-caption-key", "title", "--batch-size", "4"]
    for extra in (["--epochs", "1", "--print-config"], ["--set", "train.steps=1", "--out", str(tmp_path / "run")]):
        assert main([*flags, *extra]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and "The header contains '\\t'" in error and "--csv-separator" in error
        assert not (tmp_path / "run").exists()
    config = printed_config(capsys, *flags[3:], "--csv-separator", "\t", "--epochs", "1")
    assert config["train"]["steps"] == 2


@pytest.mark.torchvision
def test_every_flag_of_open_clip_s_released_trainer_is_answered(monkeypatch):
    """open_clip_train's own parser, as released: each of its flags is an alias, accepted, answered in one line, or
    topoclip's own (--resume, --imagenet-val, --debug)."""
    params = pytest.importorskip("open_clip_train.params")
    import argparse

    from topoclip.cli.openclip_flags import OWN

    seen = {}

    def capture(self, args=None, namespace=None):
        seen["parser"] = self
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        params.parse_args([])
    theirs = {option for action in seen["parser"]._actions for option in action.option_strings
              if option.startswith("--") and option != "--help"}
    assert len(theirs) > 60
    assert theirs - {flag.name for flag in FLAGS} - set(OWN) == set()


def test_epochs_without_an_epoch_are_one_line(capsys):
    assert main(["train", "--preset", "tiny", "--train-data", "s/{0..3}.tar", "--epochs", "2", "--print-config"]) == 2
    assert "--train-num-samples" in capsys.readouterr().err


def test_no_abbreviations(tmp_path, capsys):
    assert main(["eval", str(tmp_path), "--out", str(tmp_path / "x")]) == 2  # once read as --output
    assert "unrecognized arguments: --out" in capsys.readouterr().err


def test_one_device_default():
    from topoclip.cli import parser

    commands = parser()._subparsers._group_actions[0].choices
    defaults = {name: commands[name].get_default("device") for name in ("eval", "embed", "predict")}
    assert set(defaults.values()) == {"auto"}, defaults


def test_batch_size_counts_the_processes_srun_starts(capsys, monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    assert printed_config(capsys, "--batch-size", "8")["train"]["batch_size"] == 32


@pytest.mark.slow
def test_epochs_count_the_epoch_of_the_config_the_run_trains_with(tmp_path, capsys):
    from topoclip.config import load_config
    from topoclip.run.training.trainer import train

    run = train(load_config("tiny", ["train.steps=1", "train.batch_size=8", "data.scenes.train_size=64",
                                     "evaluate.size=16"]), out_dir=tmp_path / "run", progress=False)
    capsys.readouterr()  # the training's own output
    assert main(["train", "--init-from", str(run), "--epochs", "2", "--set", "data.scenes.train_size=64",
                 "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["train"]["steps"] == 2 * 8  # 64 samples, batch 8: 8 steps an epoch
    table = tmp_path / "pairs.csv"
    table.write_text("filepath,title\n" + "".join(f"{i}.png,a caption\n" for i in range(50)))
    config = printed_config(capsys, "--train-data", str(table), "--batch-size", "10", "--epochs", "3")
    assert config["train"]["steps"] == 3 * 5  # one epoch of a CSV is one pass over its rows


def test_half_precision_weights_are_refused_as_openclip_s_pure_modes(capsys):
    for precision in ("fp16", "bf16", "pure_bf16"):
        assert main(["train", "--preset", "tiny", "--precision", precision, "--print-config"]) == 2
        assert "fp32 master weights" in capsys.readouterr().err


@pytest.mark.parametrize("flags, reason", [
    (["--aug-cfg", "scale=(0.4,1.0)", "color_jitter=0.4"], "--aug-cfg is OpenCLIP's"),
    (["--model", "RN50", "--pretrained", "ViT-B-32:openai"], "name two models"),
    (["--epochs", "2", "--val-frequency", "1", "--zeroshot-frequency", "2"], "give one"),
    (["--epochs", "0"], "at least 1"),
    (["--save-frequency", "-1"], "at least 1"),
    (["--force-image-size", "32", "32", "32"], "square"),
    (["--logs", ""], "--logs needs a folder"),
    (["--csv-separator", "ab"], "must be one character"),
])
def test_what_openclip_would_take_otherwise_is_one_line(flags, reason, capsys):
    """From the hostile review of the flags: each of these was a traceback, argparse's error, or silently dropped."""
    assert main(["train", "--preset", "tiny", *flags, "--print-config"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and reason in error, error


def test_a_tables_epoch_is_its_whole_batches_and_its_problems_are_said_first(tmp_path, capsys):
    """The loader drops a last partial batch (as OpenCLIP's CSV loader): 10 rows in batches of 4 are 2 steps an
    epoch; a table with fewer rows than a batch, a header alone, or a first line past the bound are one line, before
    any folder; OpenCLIP's --csv-separator '\\t' is a tab, as pandas reads it there."""
    table = tmp_path / "pairs.csv"
    table.write_text("filepath\ttitle\n" + "".join(f"{i}.png\ta caption\n" for i in range(10)))
    flags = ["--train-data", str(table), "--csv-separator", "\\t", "--batch-size", "4"]
    config = printed_config(capsys, *flags, "--epochs", "3", "--save-frequency", "1")
    assert (config["data"]["csv_separator"], config["train"]["steps"], config["train"]["checkpoint_every"]) == (
        "\t", 3 * 2, 2)
    assert main(["train", "--preset", "tiny", *flags[:4], "--batch-size", "16", "--epochs", "1", "--print-config"]) == 2
    assert "fewer than one batch of 16" in capsys.readouterr().err
    # without --epochs too: a batch of rows is read before the run folder is made (the table is never counted whole)
    assert main(["train", "--preset", "tiny", *flags[:4], "--batch-size", "16", "--out", str(tmp_path / "small")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "holds 10 rows, fewer than one batch of 16" in error, error
    assert not (tmp_path / "small").exists()
    header_only, huge = tmp_path / "header.csv", tmp_path / "huge.csv"
    header_only.write_text("filepath,title\n")
    huge.write_text("filepath," + "x" * (1 << 21) + ",title\n")
    for path, reason in ((header_only, "has a header but no rows"), (huge, "over 1,048,576 characters")):
        for extra in (["--epochs", "1", "--print-config"], ["--logs", str(tmp_path / "P1" / "P2"), "--name", "n"]):
            assert main(["train", "--preset", "tiny", "--train-data", str(path), *extra]) == 2
            error = capsys.readouterr().err
            assert error.count("\n") == 1 and reason in error, error
            assert not (tmp_path / "P1").exists()


def test_siglip_from_a_softmax_trained_checkpoint_starts_the_bias_fresh_and_says_so(tmp_path, capsys):
    """From the review of #62: `--init-from CLIP --siglip` (OpenCLIP's line for SigLIP fine-tuning of a CLIP) was
    refused as a file that "does not fit" its config. The sigmoid bias is the loss's, not the checkpoint's: the run
    starts it at its configured init (−10 under --siglip) and every other weight, τ too, from the checkpoint; the way
    back (InfoNCE from a sigmoid checkpoint) leaves the bias out."""
    from safetensors.torch import load_file

    base, quick = tmp_path / "clip", ["--set", "train.steps=2", "--set", "evaluate.size=8", "--set", "train.eval_every=0",
                                      "--set", "train.batch_size=8", "--quiet"]
    assert main(["train", "--preset", "tiny", *quick, "--out", str(base)]) == 0
    capsys.readouterr()
    assert main(["train", "--init-from", str(base), "--siglip", *quick, "--set", "train.lr=1e-12",
                 "--out", str(tmp_path / "siglip")]) == 0
    note = capsys.readouterr().err
    assert note.count("has no sigmoid-loss bias (it was trained with a softmax loss); the bias starts at "
                      "model.temperature.bias_init = -10") == 1
    before = load_file(base / "checkpoints" / "step-000002" / "model.safetensors")
    after = load_file(tmp_path / "siglip" / "checkpoints" / "step-000002" / "model.safetensors")
    assert "temperature.bias" not in before and after["temperature.bias"].item() == pytest.approx(-10.0, abs=1e-9)
    # The checkpoint's weights, τ too: AdamW moves a weight by at most a few lr a step (its normalised step is ≤ 1 at
    # the first and bounded after), so two steps at lr 1e-12 stay far below 1e-9, and a fresh init would be O(0.01).
    assert all((after[name] - tensor).abs().max() < 1e-9 for name, tensor in before.items())
    assert main(["train", "--init-from", str(tmp_path / "siglip"), "--set", "train.loss=infonce", "--set",
                 "model.temperature.bias_init=null", *quick, "--out", str(tmp_path / "back")]) == 0
    assert "temperature.bias" not in load_file(tmp_path / "back" / "checkpoints" / "step-000002" / "model.safetensors")


def test_pretrained_given_a_path_starts_from_the_model_there_as_openclip_s_does(tmp_path, capsys):
    """From the review of #62: OpenCLIP's `--pretrained PATH` (beside --model or not) was read as a name ("no pretrained
    model 'ViT-B-16:/…'"). A folder topoclip reads is --init-from; OpenCLIP's own file is one line naming the
    conversion."""
    run = tmp_path / "run"
    quick = ["--set", "train.steps=2", "--set", "evaluate.size=8", "--set", "train.eval_every=0", "--set",
             "train.batch_size=8", "--quiet"]
    assert main(["train", "--preset", "tiny", *quick, "--out", str(run)]) == 0
    capsys.readouterr()
    for flags in (["--pretrained", str(run)], ["--model", "ViT-B-16", "--pretrained", str(run / "checkpoints")]):
        config = printed_config(capsys, *flags)
        assert config["train"]["init_from"] == flags[-1]
    weights = tmp_path / "open_clip_pytorch_model.bin"
    weights.write_bytes(b"not read")
    capsys.readouterr()
    assert main(["train", "--model", "RN50", "--pretrained", str(run), "--print-config"]) == 0  # the folder's model
    assert "--model RN50 is not read: the run takes" in capsys.readouterr().err
    (tmp_path / "openai").mkdir()  # a name wins over a folder that happens to share it, as in OpenCLIP
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "model")
    here = os.getcwd()
    try:
        os.chdir(tmp_path)
        import topoclip.io.pretrained as pretrained

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pretrained, "pretrained_folder", lambda name, revision=None: run)
            config = printed_config(capsys, "--model", "ViT-B-16", "--pretrained", "openai")
        assert config["train"]["init_from"] == str(run)
        assert main(["train", "--pretrained", "fifo/model", "--print-config"]) == 2
        assert "--pretrained fifo/model: not a file or folder (a link to nothing, a FIFO" in capsys.readouterr().err
    finally:
        os.chdir(here)
    assert main(["train", "--model", "ViT-B-16", "--pretrained", str(weights), "--print-config"]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and f"convert OpenCLIP's own files first (topoclip convert --from openclip {weights}" in said
    assert main(["train", "--pretrained", str(run), "--init-from", str(run), "--print-config"]) == 2
    assert "cannot be combined with --init-from" in capsys.readouterr().err


def test_a_run_shorter_than_its_warmup_says_so(tmp_path, capsys):
    """From the review of #62: the README's fine-tune of a small table ran 18 steps under the default 100 warm-up
    steps, and its lr never came near --lr, unsaid."""
    quick = ["--set", "train.steps=4", "--set", "evaluate.size=8", "--set", "train.eval_every=0", "--set",
             "train.batch_size=8", "--quiet"]
    assert main(["train", "--preset", "tiny", *quick, "--warmup", "100", "--out", str(tmp_path / "short")]) == 0
    assert ("topoclip: note: train.warmup_steps = 100 is not below train.steps = 4: the lr rises to 4 % of train.lr "
            "and never decays; set fewer (OpenCLIP's --warmup), e.g. --set train.warmup_steps=1") in capsys.readouterr().err
    assert main(["train", "--preset", "tiny", *quick, "--warmup", "1", "--out", str(tmp_path / "fine")]) == 0
    assert "warmup" not in capsys.readouterr().err


def test_an_init_checkpoint_s_fresh_parts_are_named_exactly_and_its_weights_are_finite(tmp_path, capsys):
    """From the second review of #62: the sigmoid bias a run may start fresh let any tensor whose name began with it
    through (temperature.bias_junk), and a checkpoint holding NaN was trained on until the loss said "lower the lr"."""
    from safetensors.torch import load_file, save_file

    base = tmp_path / "clip"
    quick = ["--set", "train.steps=2", "--set", "evaluate.size=8", "--set", "train.eval_every=0", "--set",
             "train.batch_size=8", "--quiet"]
    assert main(["train", "--preset", "tiny", *quick, "--out", str(base)]) == 0
    file = base / "checkpoints" / "step-000002" / "model.safetensors"
    weights = load_file(file)
    for name, change in (("extra", lambda w: {**w, "temperature.bias_junk": torch.zeros(7, 7)}),
                         ("nan", lambda w: {**w, "text.ln_final.weight": w["text.ln_final.weight"] * float("nan")})):
        save_file(change(weights), str(file))
        capsys.readouterr()
        assert main(["train", "--init-from", str(base), "--siglip", *quick, "--out", str(tmp_path / name)]) == 2
        said = capsys.readouterr().err
        assert said.count("\n") == 1, said
        assert ("the file has 1 tensors the model lacks, e.g. temperature.bias_junk" if name == "extra" else
                "its weight text.ln_final.weight holds non-finite values; the checkpoint is damaged") in said
        assert not (tmp_path / name).exists()
