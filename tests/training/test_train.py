"""Training: a few CPU steps of real training, resume = uninterrupted, the run folder, the CLI."""
import json
import shutil

import pytest

from topoclip.io.checkpoint import load_checkpoint, step_checkpoints
from topoclip.cli import main
from topoclip.config import ConfigError, load_config
from topoclip.core.geometry import TOPOLOGIES
from topoclip.run.training.optim import cosine_with_warmup, parameter_groups
from topoclip.run.training.trainer import train

# A small, fast run: 32 px scenes, tiny towers, no DataLoader workers, small evaluation sets.
SMALL = ["train.num_workers=0", "train.log_every=1", "evaluate.size=48", "evaluate.template_modes=[\"distance\"]",
         "data.scenes.train_size=2048", "data.scenes.val_size=64", "data.scenes.test_size=64"]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


@pytest.mark.slow
def test_run_folder_has_everything(tmp_path):
    run = train(load_config("tiny", SMALL + ["train.steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=1"]),
                out_dir=tmp_path / "run", progress=False)
    for name in ["config.json", "tokenizer.json", "metrics.jsonl", "eval.json", "plots/loss.png", "plots/temperature.png",
                 "plots/evaluation.png"]:
        assert (run / name).is_file(), name
    assert [p.name for p in step_checkpoints(run / "checkpoints")] == ["step-000004"]  # kept the last 1
    records = json.loads((run / "eval.json").read_text())
    assert {r["task"] for r in records} == {"zeroshot_classification", "zeroshot_retrieval"}
    # CLIP_benchmark-style records; the built-in sets also say how they relate to training ("domain").
    assert all(set(r) == {"dataset", "model", "task", "metrics", "domain"} for r in records)
    assert {r["domain"] for r in records} == {"in-domain", "out-of-domain", "held-out", "held-out, out-of-domain"}
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = logged[0]
    assert {"loss", "scale", "t", "lr", "grad_norm", "images_per_s", "data"} <= set(first)
    model, tokenizer, config = load_checkpoint(run)
    assert config.train.steps == 4 and tokenizer.cls_id == config.model.text.cls_token_id


@pytest.mark.slow
def test_resume_equals_uninterrupted(tmp_path):
    settings = SMALL + ["train.steps=6", "train.checkpoint_every=3", "train.keep_checkpoints=5", "train.warmup_steps=2"]
    whole = train(load_config("tiny", settings), out_dir=tmp_path / "whole", progress=False)
    expected = losses(whole)
    # A run killed between steps 3 and 6 is the same folder without the step-6 checkpoint (and the
    # end-of-run files); metrics logged after step 3 are dropped by the resume.
    shutil.copytree(whole, tmp_path / "killed")
    killed = tmp_path / "killed"
    shutil.rmtree(killed / "checkpoints" / "step-000006")
    (killed / "eval.json").unlink()
    resumed = train(None, resume=killed, progress=False)
    got = losses(resumed)
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        assert got[step] == expected[step], step  # the same operations on the same inputs: bit for bit


@pytest.mark.slow
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_each_topology_learns(tmp_path, topology):
    # Euclidean distances are unbounded (‖u − v‖ ≈ 10 at init here), so it trains at τ = 1, the
    # paper's setting where it still works (Table 6); τ = 14 saturates the softmax in 60 steps.
    temperature = ["model.temperature.init=0"] if topology == "euclidean" else []
    run = train(load_config("tiny", SMALL + temperature + [f"model.topology={topology}", "train.steps=60", "train.batch_size=64",
                                             "train.lr=2e-3", "train.warmup_steps=5", "train.checkpoint_every=0",
                                             "evaluate.size=128"]),
                out_dir=tmp_path / topology, progress=False)
    history = losses(run)
    first, last = sum(history[s] for s in range(1, 6)) / 5, sum(history[s] for s in range(56, 61)) / 5
    assert last < first - 0.3, (first, last)
    colour = next(r for r in json.loads((run / "eval.json").read_text()) if r["dataset"] == "colour")
    assert colour["metrics"]["top1"] > 12.5 + 10  # 8 colours: chance is 12.5 %


def test_parameter_groups_and_schedule():
    from topoclip.model.clip import CLIP

    model = CLIP(load_config("tiny").model)
    decay, no_decay = parameter_groups(model, 0.2)  # [{params, weight_decay}, ...]
    names = {id(p): n for n, p in model.named_parameters()}
    undecayed = {names[id(p)] for p in no_decay["params"]}
    assert "temperature.t" in undecayed and "text.token_embedding.weight" in undecayed
    assert "visual.class_embedding" in undecayed and "visual.ln_pre.weight" in undecayed
    assert all(names[id(p)].endswith(("weight", "proj", "projection")) for p in decay["params"])
    assert "visual.transformer.resblocks.0.attn.in_proj_weight" in {names[id(p)] for p in decay["params"]}
    assert cosine_with_warmup(0, 10, 100) == pytest.approx(0.1)
    assert cosine_with_warmup(9, 10, 100) == pytest.approx(1.0)
    assert cosine_with_warmup(55, 10, 100) == pytest.approx(0.5)
    assert cosine_with_warmup(100, 10, 100) == pytest.approx(0.0)


def test_cli_refuses_bad_settings_before_training(tmp_path, capsys):
    assert main(["train", "--preset", "tiny", "--set", "model.class_tokens=zero", "--out", str(tmp_path / "x")]) == 2
    assert "model.class_tokens='zero' must be an integer" in capsys.readouterr().err
    assert main(["train", "--preset", "tiny", "--set", "model.n_tokens=4", "--out", str(tmp_path / "x")]) == 2
    error = capsys.readouterr().err
    assert "unknown key 'model.n_tokens'" in error and "model.class_tokens" in error
    assert main(["train", "--preset", "tiny", "--set", "data.scenes.noise=2", "--out", str(tmp_path / "x")]) == 2
    assert "noise" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_cli_presets_and_help(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "multi-32x16-vit-b16" in out and "cpu-multi" in out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--resume" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_eval_writes_records(tmp_path, capsys):
    run = train(load_config("tiny", SMALL + ["train.steps=2"]), out_dir=tmp_path / "run", progress=False)
    capsys.readouterr()
    assert main(["eval", str(run), "--json", str(tmp_path / "eval.json"), "--set", "evaluate.size=32"]) == 0
    records = json.loads((tmp_path / "eval.json").read_text())
    assert records and records[0]["model"] == "tiny"
    assert "colour" in capsys.readouterr().out


def test_tokenizer_that_does_not_fit_is_refused(tmp_path):
    # A given vocabulary must fit the text tower (a trained one sets the [CLS] id instead: test_train_user_data).
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[SEP]", "[MASK]", "[CLS]", "a", "red", "circle"]) + "\n")
    with pytest.raises(ConfigError, match="the tokenizer's \\[CLS\\] id is 4 but model.text.cls_token_id=2"):
        train(load_config("tiny", SMALL + [f"data.tokenizer={vocab}"]), out_dir=tmp_path / "run", progress=False)


@pytest.mark.slow
def test_a_new_topology_is_one_function_and_one_registry_line(tmp_path, monkeypatch):
    import torch

    from topoclip.core import geometry
    from topoclip.model.clip import describe_model

    def twice_cosine(u, v):  # the toy topology: a sphere whose similarity spans [−2, 2]
        return 2 * geometry.inner_product(u, v)

    monkeypatch.setitem(geometry.TOPOLOGIES, "scaled-sphere", geometry.Topology(
        geometry.normalize_whole, twice_cosine, lambda m: (-2.0, 2.0), chunked=False, product=False,
        label="Scaled sphere({d})"))
    config = load_config("tiny", SMALL + ["model.topology=scaled-sphere", "train.steps=3", "model.class_tokens=2"])
    run = train(config, out_dir=tmp_path / "run", progress=False)
    model, _, loaded = load_checkpoint(run)
    assert loaded.model.topology == "scaled-sphere" and loaded.model.sphere_count == 1  # not a product
    assert describe_model(loaded.model) == f"Scaled sphere({2 * config.model.embed_dim}), 2 tokens"
    u, v = torch.randn(3, 1, 2 * config.model.embed_dim), torch.randn(4, 1, 2 * config.model.embed_dim)
    cosine = torch.nn.functional.normalize(u[:, 0], dim=-1) @ torch.nn.functional.normalize(v[:, 0], dim=-1).T
    # Two fp32 routes to cos of unit vectors, each within (d + 2)·u of exact (d products summed, then the
    # normalisation's rounding; Σ|u_i v_i| ≤ 1), so 2·cos differs by at most 2·2·(d + 2)·u.
    d = 2 * config.model.embed_dim
    assert torch.allclose(model.similarity(geometry.to_space("scaled-sphere", u), geometry.to_space("scaled-sphere", v)),
                          2 * cosine, rtol=0, atol=4 * (d + 2) * 2 ** -24)
