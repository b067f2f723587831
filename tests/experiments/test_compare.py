"""`topoclip compare`: both models × seeds, resumable, mean ± std equal to a hand computation."""
import json
import math
import statistics

import pytest

from topoclip.experiments.compare import compare, comparison_rows, markdown

SMALL = ["evaluate.size=24", "evaluate.validation_size=16", "evaluate.captions_per_image=2", "train.num_workers=0",
         "data.scenes.train_size=256", "train.checkpoint_every=0"]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    return out, compare(out, seeds=2, steps=3, preset="tiny", overrides=SMALL, log=lambda _: None)


@pytest.mark.slow
def test_compare_writes_its_table_json_and_plot(compared):
    out, result = compared
    for name in ("compare.md", "compare.json", "compare.png"):
        assert (out / name).is_file()
    assert "| shape top-1 |" in (out / "compare.md").read_text()
    assert json.loads((out / "compare.json").read_text())["seeds"] == [0, 1]


def test_mean_and_std_equal_a_hand_computation_from_the_per_seed_eval_files(compared):
    out, result = compared
    rows = {row["metric"]: row for row in result["rows"]}
    for model in ("multi", "sphere"):
        shape = []
        for seed in (0, 1):
            run = next(out.glob(f"runs/*{model}*/seed-{seed}"))
            records = json.loads((run / "eval.json").read_text())
            shape.append(next(r["metrics"]["top1"] for r in records if r["dataset"] == "shape"
                              and r["metrics"]["mode"] == "distance"))
        assert math.isclose(rows["shape top-1"][model]["mean"], statistics.mean(shape), abs_tol=1e-9)
        assert math.isclose(rows["shape top-1"][model]["std"], statistics.stdev(shape), abs_tol=1e-9)
    row = rows["shape top-1"]
    assert math.isclose(row["difference"]["effect"], row["multi"]["mean"] - row["sphere"]["mean"])


def test_a_second_call_trains_nothing_again(compared):
    out, first = compared
    again = compare(out, seeds=2, steps=3, preset="tiny", overrides=SMALL, log=lambda _: None)
    assert again["rows"] == first["rows"]


def test_difference_is_welchs_t():
    rows = comparison_rows({"m": {"multi": [10.0, 12.0, 11.0], "sphere": [1.0, 3.0, 2.0]},
                            "n": {"multi": [10.0, 12.0, 11.0], "sphere": [9.0, 12.0, 11.0]}})
    clear, unclear = (row["difference"] for row in rows)
    # equal variances and sizes: Welch's t is (9)/sqrt(2·1/3) with 4 degrees of freedom
    assert clear["effect"] == 9.0 and clear["df"] == 4.0 and clear["low"] > 0 and clear["p"] < 0.001
    assert unclear["low"] < 0 < unclear["high"] and unclear["p"] > 0.05
    assert "| m | 11.0 ± 1.0 | 2.0 ± 1.0 | +9.0 (" in markdown(rows, 3, 10)


def test_a_comparison_that_cannot_be_made_is_one_line_before_any_run(tmp_path, capsys):
    """From the hostile test of #61: `compare --seeds 1` trained every run and then ended in a traceback (Welch's t
    needs two a side); `--preset tiny` made both cells Multi(16, 4) and `--set model.topology=lorentz` both lorentz,
    compared under a header naming Multi(16, 8) and the sphere."""
    from topoclip.cli import main
    from topoclip.config import ConfigError
    from topoclip.experiments.compare import compare_grid

    assert main(["compare", "--seeds", "1", "--out", str(tmp_path / "one")]) == 2
    assert "--seeds: must be a whole number ≥ 2" in capsys.readouterr().err
    for setting in ("model.topology=lorentz", "model.spheres=1"):
        assert main(["compare", "--preset", "tiny", "--set", setting, "--out", str(tmp_path / "set")]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"--set {setting} would change both or blur them" in error, error
    for preset, model in (("cpu-sphere", "Sphere(128)"), ("euclidean-vit-s16", "Euclidean R^512")):
        assert main(["compare", "--preset", preset, "--out", str(tmp_path / "same")]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"--preset {preset} is {model}: give a product-sphere preset" in error, error
    assert not any((tmp_path / name).exists() for name in ("one", "set", "same"))
    with pytest.raises(ConfigError, match="at least 2 seeds"):
        compare_grid(1, [], None)
    # Under a base preset, its product of spheres against the one-token sphere of the same whole dimension (the
    # second review: the sphere was embed_dim wide, 16 beside cpu-multi's 8 × 16); the table names both
    models = {preset: compare_grid(2, [], preset)[1] for preset in (None, "cpu-multi", "tiny", "ps-inner-64x8-vit-s16")}
    assert models[None] == models["cpu-multi"] == {"multi": "Multi(16,8), ps-inner", "sphere": "Sphere(128), sphere"}
    assert models["tiny"] == {"multi": "Multi(16,4), ps-inner", "sphere": "Sphere(64), sphere"}
    assert models["ps-inner-64x8-vit-s16"]["sphere"] == "Sphere(512), sphere"
