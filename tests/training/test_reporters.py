"""train.report_to: TensorBoard and W&B get the same scalars as metrics.jsonl, the config and the final table."""
import json

import pytest

from topoclip.config import ConfigError, load_config, to_dict
from topoclip.run.training.logger import read_metrics, reporter_scalars
from topoclip.run.training.trainer import train

SHORT = ["train.steps=4", "train.log_every=2", "train.eval_every=2", "evaluate.size=16", "evaluate.validation_size=16"]


def logged_scalars(run) -> set[str]:
    """The numeric keys metrics.jsonl holds, as the reporters name them ("eval/shape/distance/top1" for validation,
    "test/shape/distance/top1" for the final evaluation, ...)."""
    keys = set()
    for record in read_metrics(run / "metrics.jsonl"):
        keys |= set(reporter_scalars(record))
    return keys


def test_validation_and_the_final_test_evaluation_are_apart_at_the_last_step():
    """The last step has both; the same set names in both splits must not share a chart."""
    validation = reporter_scalars({"step": 4, "eval": {"shape/distance/top1": 50.0}})
    test = reporter_scalars({"step": 4, "eval": {"shape/distance/top1": 60.0}, "final": True})
    assert validation == {"eval/shape/distance/top1": 50.0} and test == {"test/shape/distance/top1": 60.0}
    assert reporter_scalars({"step": 4, "loss": 2.0, "data": {"kept": 3}}) == {"loss": 2.0, "data/kept": 3}


@pytest.mark.slow
def test_tensorboard_gets_the_scalars_the_config_and_the_final_table(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train(load_config("tiny", SHORT), out_dir=tmp_path / "run", progress=False)
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == logged_scalars(run)
    texts = set(events.Tags()["tensors"])
    assert {"config/text_summary", "final evaluation/text_summary"} <= texts


@pytest.mark.slow
def test_wandb_offline_gets_the_scalars_the_config_and_the_final_table(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    seen = {}
    real_init = wandb.init

    def init(*args, **kwargs):  # W&B's own run object, read just before it finishes
        run = real_init(*args, **kwargs)
        real_finish = run.finish

        def finish(*a, **k):
            seen["summary"], seen["config"] = set(run.summary.keys()), dict(run.config)
            return real_finish(*a, **k)

        run.finish = finish
        return run

    monkeypatch.setattr(wandb, "init", init)
    config = load_config("tiny", SHORT + ['train.report_to=["wandb"]'])
    run = train(config, out_dir=tmp_path / "run", progress=False)
    assert logged_scalars(run) <= seen["summary"]  # every scalar of metrics.jsonl, under the same name
    assert seen["config"]["train"]["report_to"] == ["wandb"] and seen["config"]["model"] == to_dict(config)["model"]
    (offline,) = (run / "wandb").glob("offline-run-*")
    assert (run / "wandb-id.txt").read_text() in offline.name  # a resume continues this W&B run
    (table,) = (offline / "files" / "media" / "table").glob("final evaluation_*.table.json")  # written by W&B
    written = json.loads(table.read_text())
    assert written["columns"][:2] == ["dataset", "domain"] and written["data"][0][0] == "shape"


def test_unknown_or_missing_reporters_are_refused_before_training(monkeypatch):
    with pytest.raises(ConfigError, match="train.report_to has \\['mlflow'\\]"):
        load_config("tiny", ['train.report_to=["mlflow"]'])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="wandb is not installed"):
        load_config("tiny", ['train.report_to=["wandb"]'])
