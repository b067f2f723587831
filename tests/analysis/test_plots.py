"""The run's plots: evaluation.png keeps validation (periodic) and test (final) evaluations apart."""
import json

from PIL import Image

from topoclip.run.training.logger import evaluation_series, plot_metrics


def evaluation_records():
    """Three periodic evaluations (validation split) and the final one (test split), as the trainer logs them."""
    periodic = [{"step": step, "eval": {"scenes-shape-val/distance/top1": 10.0 * k,
                                         "scenes-shape-val/embedding/top1": 11.0 * k,
                                         "scenes-retrieval-val/mean_recall": 40.0 + k}}
                for k, step in enumerate([250, 500, 750], start=1)]
    final = {"step": 1000, "final": True, "eval": {"scenes-shape-test/distance/top1": 50.0,
                                                    "scenes-shape-test/embedding/top1": 49.0,
                                                    "scenes-retrieval-test/mean_recall": 16.6}}
    return periodic + [final]


def test_validation_and_test_evaluations_are_separate_series():
    """On main the final test value (1,000 images) continued the validation line (200 images) under one name."""
    series = evaluation_series(evaluation_records())
    assert set(series) == {"scenes-shape/top1", "scenes-retrieval/mean_recall"}
    assert series["scenes-retrieval/mean_recall"] == {"validation": ([250, 500, 750], [41.0, 42.0, 43.0]),
                                                      "test": ([1000], [16.6])}
    assert series["scenes-shape/top1"]["test"] == ([1000], [50.0])  # the distance mode, not embedding


def test_a_set_evaluated_only_with_embedding_templates_is_kept():
    records = [{"step": 5, "eval": {"mine/embedding/top1": 30.0}}]
    assert evaluation_series(records) == {"mine/embedding top1": {"validation": ([5], [30.0])}}


def test_plot_metrics_writes_the_evaluation_figure(tmp_path):
    steps = [{"step": s, "loss": 1.0 / s, "scale": 14.3, "lr": 1e-3} for s in (250, 500, 750, 1000)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in steps + evaluation_records()))
    written = plot_metrics(path, tmp_path / "plots")
    assert {p.name for p in written} == {"loss.png", "temperature.png", "learning_rate.png", "evaluation.png"}
    with Image.open(tmp_path / "plots" / "evaluation.png") as image:
        assert image.size[0] > 0 and image.size[1] > 0
