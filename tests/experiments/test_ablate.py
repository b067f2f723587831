"""Ablation grids: every shipped grid resolves, cells are what the grid says, and `topoclip ablate`
trains, tabulates and resumes (finished runs are not trained again, killed ones are resumed)."""
import datetime
import json
import math
import os
import shutil
import subprocess

import pytest

import topoclip
from topoclip.experiments import grid as grids
from topoclip.experiments.runner import code_info
from topoclip.experiments.report import curve_metrics, late_rise, still_rising
from topoclip.cli import main
from topoclip.config import ConfigError, to_dict
from topoclip.model.clip import describe_model

# Tiny runs with small evaluation sets: what a smoke test of a grid looks like.
FAST = ["--preset", "tiny", "--seeds", "2", "--steps", "3", "--probe-size", "16", "--set", "train.num_workers=0",
        "--set", "train.batch_size=16", "--set", "train.log_every=1", "--set", "evaluate.size=8",
        "--set", 'evaluate.template_modes=["distance"]', "--set", "data.scenes.train_size=256",
        "--set", "data.scenes.val_size=16", "--set", "data.scenes.test_size=16"]


def test_every_shipped_grid_resolves(tmp_path):
    assert {"table3", "table4", "noise", "tau-range"} <= set(grids.grid_names())
    for name in grids.grid_names():
        grid = grids.load_grid(name)
        specs = grids.plan(grid, tmp_path / name, seeds=2)
        assert len(specs) == 2 * len(grid.cells()) and len({s.run_dir for s in specs}) == len(specs)
        assert [s.config["train"]["seed"] for s in specs[:2]] == [0, 1]


def test_table3_cells():
    grid = grids.load_grid("table3")
    configs = {grids.cell_name(levels): grids.cell_config(grid, levels, [], seed=0) for levels in grid.cells()}
    assert len(configs) == 16
    fixed = configs["ps-geodesic_t-0-fixed"].model
    assert fixed.topology == "ps-geodesic" and fixed.sphere_count == 8 and fixed.class_tokens == 1
    assert fixed.temperature.init == 0.0 and not fixed.temperature.learnable
    high = configs["sphere_t-5.31"].model.temperature
    assert high.init == 5.31 and math.exp(high.init) < high.max_scale  # not clamped at construction


def test_table4_shapes():
    grid = grids.load_grid("table4")
    shapes = [describe_model(grids.cell_config(grid, levels, [], 0).model) for levels in grid.cells()]
    assert shapes == ["Sphere(128)", "PS(64,2)", "PS(16,8)", "PS(4,32)", "PS(2,64)", "Multi(16,8)", "Sphere(256)"]


def test_tau_range_matches_logit_ranges():
    grid = grids.load_grid("tau-range")
    configs = {levels[0].label: grids.cell_config(grid, levels, [], 0).model for levels in grid.cells()}
    m = configs["multi, default t"].sphere_count
    assert m > 1
    assert configs["multi, default t"].temperature.init == configs["sphere, default t"].temperature.init == 2.659
    assert configs["multi, sphere's range"].temperature.init == pytest.approx(2.659 - math.log(m))
    assert configs["sphere, multi's range"].temperature.init == pytest.approx(2.659 + math.log(m))
    # The matched cells start with the same logit range τ · (s_max − s_min) / 2.
    for matched, reference in [("multi, sphere's range", "sphere, default t"), ("sphere, multi's range", "multi, default t")]:
        ranges = [math.exp(configs[c].temperature.init) * grids.half_range(configs[c]) for c in (matched, reference)]
        assert ranges[0] == pytest.approx(ranges[1])


def test_default_cells_of_every_grid_are_the_compare_runs():
    """The cells that train the presets as they are resolve to the compare runs' configs (name aside), which is
    what lets `--reuse` share those runs between grids; they would differ if a grid set τ's clamp for every cell."""
    def configs(name):
        grid = grids.load_grid(name)
        return {grids.cell_name(levels): to_dict(grids.cell_config(grid, levels, [], seed=1))
                for levels in grid.cells()}

    compare, table3, table4 = configs("compare"), configs("table3"), configs("table4")
    tau_range, noise = configs("tau-range"), configs("noise")
    same = [(compare["multi"], table4["multi"]), (compare["multi"], tau_range["multi-default-t"]),
            (compare["multi"], noise["multi_0"]), (compare["sphere"], table4["sphere-128"]),
            (compare["sphere"], table3["sphere_t-2.659"]), (compare["sphere"], tau_range["sphere-default-t"]),
            (compare["sphere"], noise["sphere_0"]), (table3["ps-inner_t-2.659"], table4["ps-16x8"])]
    for a, b in same:
        assert a["name"] != b["name"] and grids.config_differences(a, b) == []
    assert grids.config_differences(compare["sphere"], table3["sphere_t-5.31"]) != []
    raised = tau_range["sphere-multi-s-range"]["model"]["temperature"]
    assert math.exp(raised["init"]) < raised["max_scale"]  # starts at the multi-token range, not clamped


@pytest.mark.slow
def test_reuse_copies_runs_with_the_same_config(tmp_path, capsys):
    source = tmp_path / "compare"
    assert main(["ablate", "--grid", "compare", *FAST, "--out", str(source)]) == 0
    out = tmp_path / "table4"
    args = ["ablate", "--grid", "table4", *FAST, "--cells", "multi", "ps-16x8", "--out", str(out)]
    capsys.readouterr()
    assert main([*args, "--reuse", str(source)]) == 0
    assert capsys.readouterr().out.count("reused") == 2
    result = json.loads((out / "ablation.json").read_text())
    assert result["trained_now"] == 2 and result["reused_now"] == 2 and result["reused"] == 2  # ps-16x8 trained
    for seed in (0, 1):
        copy, original = out / "runs" / "multi" / f"seed-{seed}", source / "runs" / "multi" / f"seed-{seed}"
        assert (copy / "eval.json").read_bytes() == (original / "eval.json").read_bytes()
        assert (copy / "probe.json").is_file()  # probed at this grid's --probe-size
    # recorded relative to the ablation folder: the JSON names no path of this machine
    assert read_runs(out)[("multi", 0)]["reused_from"] == os.path.relpath(source / "runs" / "multi" / "seed-0", out)
    assert "2 of the 4 runs are copies" in (out / "table.md").read_text()
    # Nothing to reuse for a cell with another config; a folder without runs is refused.
    assert main([*args, "--reuse", str(tmp_path / "nothing")]) == 2
    assert "no finished run" in capsys.readouterr().err
    # More seeds of a grid in a folder of their own: --first-seed 1 --seeds 1 plans seed 1 alone, with the config
    # of the source's seed 1 (so it is copied, not trained).
    more = tmp_path / "more"
    assert main(["ablate", "--grid", "compare", *FAST, "--seeds", "1", "--first-seed", "1", "--out", str(more),
                 "--reuse", str(source)]) == 0
    result = json.loads((more / "ablation.json").read_text())
    assert result["first_seed"] == 1 and result["trained_now"] == 0 and result["reused_now"] == 2
    assert sorted(p.name for p in (more / "runs" / "multi").iterdir()) == ["seed-1"]
    assert {run["seed"] for run in result["runs"]} == {1}
    assert read_runs(more)[("multi", 1)]["reused_from"] == os.path.relpath(source / "runs" / "multi" / "seed-1", more)
    assert json.loads((more / "runs" / "multi" / "seed-1" / "config.json").read_text())["train"]["seed"] == 1
    assert "(train.seed 1 … 1)" in (more / "table.md").read_text()


@pytest.mark.slow
def test_runs_saved_before_a_setting_existed_still_match_their_cell(tmp_path, capsys):
    """main: adding a setting (e.g. train.report_to) made every earlier ablation folder "made with other settings"."""
    out = tmp_path / "compare"
    assert main(["ablate", "--grid", "compare", *FAST, "--out", str(out)]) == 0
    saved = out / "runs" / "multi" / "seed-0" / "config.json"
    values = json.loads(saved.read_text())
    del values["train"]["report_to"], values["model"]["vision"]["eval_resize"]  # as written before they existed
    saved.write_text(json.dumps(values))
    assert main(["ablate", "--grid", "compare", *FAST, "--out", str(out)]) == 0  # tabulated again, nothing retrained
    values["train"]["lr"] = 1.0
    saved.write_text(json.dumps(values))
    assert main(["ablate", "--grid", "compare", *FAST, "--out", str(out)]) == 2
    assert "made with other settings (train.lr differ)" in capsys.readouterr().err


def test_the_full_scenes_grid_reuses_the_lr_grids_runs_at_each_familys_lr():
    """tau-range-full-scenes' cells at their own range and 9,600 steps are the pre-registered lr grid's runs at the
    lr the family's preset carries (hard-lr-9600: `--grid lr` with the settings below), so `--reuse` copies them;
    the cells at the other's range start at the other's logit range."""
    full, lr_grid = grids.load_grid("tau-range-full-scenes"), grids.load_grid("lr")
    cells = {grids.cell_name(levels): levels for grid in (full, lr_grid) for levels in grid.cells()}
    lr_settings = ["data.scenes.max_objects=3", "data.scenes.object_scale=1.0", "train.eval_every=800", "train.steps=9600"]
    for family in ("multi", "sphere"):
        own = grids.cell_config(full, cells[f"{family}-default-t"], [], seed=1)
        lr = format(own.train.lr, ".0e").replace("e-0", "e-")  # 1e-3, as the lr grid names its cells
        trained = grids.cell_config(lr_grid, cells[f"{family}_lr-{lr}"], lr_settings, seed=1)
        assert grids.config_differences(to_dict(own), to_dict(trained)) == []
        assert (own.data.scenes.max_objects, own.data.scenes.object_scale, own.train.steps) == (3, 1.0, 9600)
    configs = {name: grids.cell_config(full, levels, [], seed=0) for name, levels in cells.items() if "-" in name
               and "_" not in name}
    for matched, reference in [("multi-sphere-s-range", "sphere-default-t"), ("sphere-multi-s-range", "multi-default-t")]:
        ranges = [math.exp(configs[c].model.temperature.init) * grids.half_range(configs[c].model) for c in (matched, reference)]
        assert ranges[0] == pytest.approx(ranges[1])
        assert configs[matched].train.lr == configs[matched.split("-")[0] + "-default-t"].train.lr  # the family's lr


def test_unknown_grid_and_cells_are_user_errors(tmp_path, capsys):
    with pytest.raises(ConfigError):
        grids.load_grid("no-such-grid")
    assert main(["ablate", "--grid", "table3", "--cells", "nothing*", "--out", str(tmp_path)]) == 2
    assert "matches no cell" in capsys.readouterr().err


def test_still_rising_names_a_rise_without_spread():
    # seeds that each gained exactly one image of 200 (+0.5 points) leave a paired t nothing to test: the
    # column says so instead of printing a zero-width interval; a spread rise keeps its interval
    key = curve_metrics("shape")["zero-shot top-1 (shape)"]

    def row(gains):
        runs = [{"evaluations": [{"step": 3, key: 90.0 + k}, {"step": 4, key: 90.0 + k + gain}, {"step": 5, key: 0.0}]}
                for k, gain in enumerate(gains)]  # the last step's validation (5) is left out
        return {"late_rise": {key: late_rise(runs, key, steps=5)}}

    assert still_rising(row([0.5, 0.5, 0.5]), "shape") == "yes +0.5 (every seed the same)"
    assert still_rising(row([0.0, 0.0, 0.0]), "shape") == "no +0.0 (every seed the same)"
    assert still_rising(row([0.0, 1.0, 2.0]), "shape") == "no +1.0 (-1.5 to +3.5)"  # 1 ± t(0.975, 2)·1/√3


def test_rows_a_hidden_axis_tells_apart_are_named_by_their_cell():
    """From the hostile test of #61: the lorentz grid hides its model axis, whose levels differ by the entailment loss
    (a training setting the model's description does not show), so two rows read `| Lorentz H^128 | lr 1e-3 |`."""
    from topoclip.experiments.report import markdown_table

    grid = grids.load_grid("lorentz")
    numbers = {key: {"values": [1.0]} for key in ("final_t", "convergence_step", "i2t_r1", "t2i_r1", "zero_shot_top1",
                                                  "linear_probe_top1")}
    rows = [{"cell": cell, "model": model, "columns": {"learning rate": "lr 1e-3"}, "t_init": 2.659, "learnable": True,
             **numbers} for cell, model in (("lorentz_lr-1e-3", "L"), ("lorentz-entail_lr-1e-3", "L"),
                                            ("lorentz-product_lr-1e-3", "P"))]
    meta = {"cells": "all", "seeds": 1, "preset": grid.preset, "steps": 3, "command": "topoclip ablate"}
    table = [line for line in markdown_table(grid, rows, meta).splitlines() if line.startswith("| ")][1:]
    assert [line.split(" | ")[0] for line in table] == ["| L (`lorentz_lr-1e-3`)", "| L (`lorentz-entail_lr-1e-3`)", "| P"]


def read_runs(out):
    return {(r["cell"], r["seed"]): r for r in json.loads((out / "ablation.json").read_text())["runs"]}


@pytest.mark.slow
def test_ablate_writes_table_and_resumes(tmp_path, capsys):
    out = tmp_path / "table3"
    # evaluations at steps 1, 2 and 3 of 3 (the last step too): the curves and the "still rising?" column have points
    cells = ["--cells", "sphere_t-2.659", "ps-inner_t-0-fixed", "--set", "train.eval_every=1"]
    assert main(["ablate", "--grid", "table3", *FAST, *cells, "--out", str(out)]) == 0
    table = (out / "table.md").read_text().splitlines()
    rows = [line for line in table if line.startswith("| ") and "model" not in line and "*paper" not in line]
    assert len(rows) == 2 and "Sphere(16)" in rows[0] and "| no |" in rows[1] and "| fixed |" in rows[1]
    # each cell's row is followed by the paper's (Table 6) for that cell
    assert [line.split(" | ")[0] for line in table if "*paper" in line] == ["| *paper: Sphere(512)*", "| *paper: Ob(64,8)*"]
    assert all("—" not in row.split("|", 6)[-1] for row in rows)  # every metric column filled
    assert all(" ± " in row for row in rows)  # two seeds
    assert (out / "temperature.png").is_file() and (out / "curves.png").is_file()
    result = json.loads((out / "ablation.json").read_text())
    rise = result["rows"][0]["late_rise"]["shape/distance/top1"]
    runs = [r for r in result["runs"] if r["cell"] == "sphere_t-2.659"]
    # the still-rising test leaves out the last step's validation (runs trained before it existed have none)
    assert (rise["from_step"], rise["to_step"]) == (1, 2) and [e["step"] for e in runs[0]["evaluations"]] == [1, 2, 3]
    gains = [run["evaluations"][1]["shape/distance/top1"] - run["evaluations"][0]["shape/distance/top1"] for run in runs]
    assert rise["effect"] == pytest.approx(sum(gains) / 2, abs=1e-12)  # values in %: 1e-12 is far above rounding
    assert result["trained_now"] == 4 and len(result["rows"]) == 2
    assert result["code"]["topoclip"] == topoclip.__version__  # the commit: test_code_info_names_this_checkouts_commit
    assert datetime.datetime.fromisoformat(result["started"]).utcoffset() == datetime.timedelta(0)
    first = read_runs(out)
    assert all(r["i2t_r1"] is not None and r["linear_probe_top1"] is not None for r in first.values())
    # every retrieval metric of eval.json, per set: R@K beside mAP@R and R-Precision, which count every true caption
    for run in first.values():
        retrieval = run["retrieval"]["scenes-test"]
        assert retrieval["text_retrieval_recall@1"] == run["i2t_r1"]
        assert {"image_to_text_mAP@R", "text_to_image_R-Precision", "mean_recall"} <= set(retrieval)
        assert run["retrieval"]["scenes-test-ood"]["mean_recall"] == run["headline"]["scenes-test-ood/mean_recall"]

    # A run killed after its last checkpoint (no eval.json) and one never started (no folder):
    # re-running trains exactly those two; the finished runs are untouched.
    killed = out / "runs" / "sphere_t-2.659" / "seed-1"
    (killed / "eval.json").unlink()
    shutil.rmtree(out / "runs" / "ps-inner_t-0-fixed" / "seed-0")
    untouched = out / "runs" / "sphere_t-2.659" / "seed-0" / "eval.json"
    stamp = untouched.stat().st_mtime_ns
    capsys.readouterr()
    assert main(["ablate", "--grid", "table3", *FAST, *cells, "--out", str(out)]) == 0
    log = capsys.readouterr().out
    assert "2 to run" in log and "sphere_t-2.659 seed 1: killed -> finished" in log
    assert json.loads((out / "ablation.json").read_text())["trained_now"] == 2
    assert untouched.stat().st_mtime_ns == stamp
    again = read_runs(out)
    assert again[("sphere_t-2.659", 0)]["i2t_r1"] == first[("sphere_t-2.659", 0)]["i2t_r1"]
    # Resuming after the last checkpoint evaluates the same weights: the same numbers.
    assert again[("sphere_t-2.659", 1)]["i2t_r1"] == first[("sphere_t-2.659", 1)]["i2t_r1"]

    # Other settings in the same folder are refused, not mixed into the table.
    assert main(["ablate", "--grid", "table3", *FAST, *cells, "--set", "train.lr=0.1", "--out", str(out)]) == 2
    assert "other settings" in capsys.readouterr().err


def test_code_info_names_this_checkouts_commit(tmp_path, monkeypatch):
    """ablation.json's "code": a digest of the package's files, whoever installed them, and the commit of a checkout
    of this project the package runs from, and whether its files differ from it; no commit from another repository
    the package happens to lie in, nor outside any."""
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))  # the user's config aside (signing, ...),
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    (tmp_path / "gitconfig").write_text("[status]\n\tshowUntrackedFiles = no\n")  # ... but for one code_info overrides

    def git(folder, *args):
        return subprocess.run(["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              capture_output=True, text=True, check=True).stdout.strip()

    checkout = tmp_path / "checkout"
    package = checkout / "src" / "topoclip"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    git(checkout, "init", "-q")
    git(checkout, "add", ".")
    git(checkout, "commit", "-q", "-m", "a")
    monkeypatch.setattr(topoclip, "__file__", str(package / "__init__.py"))
    first = code_info()
    assert first["commit"] == git(checkout, "rev-parse", "HEAD") and first["modified"] is False
    assert first["topoclip"] == topoclip.__version__
    (package / "geometry.py").write_text("")  # a file the commit lacks
    second = code_info()
    assert second["modified"] is True and second["sha256"] != first["sha256"]
    copy = tmp_path / "site-packages" / "topoclip"  # the same files outside any checkout: the same digest, no commit
    shutil.copytree(package, copy)
    monkeypatch.setattr(topoclip, "__file__", str(copy / "__init__.py"))
    assert code_info() == {**second, "commit": None, "modified": None}
    (copy / "geometry.py").unlink()
    assert code_info()["sha256"] == first["sha256"]
    outside = tmp_path / "elsewhere"  # a folder of the package linked in (a develop install's), read through the link
    outside.mkdir()
    (outside / "losses.py").write_text("a")
    (copy / "core").symlink_to(outside, target_is_directory=True)
    (copy / "gone.py").symlink_to(tmp_path / "missing.py")  # a broken link counts by its name, never stops a run
    linked = code_info()["sha256"]
    (outside / "losses.py").write_text("b")
    assert code_info()["sha256"] != linked
    (checkout / "src" / "other").mkdir()  # the same repository, another package: its commit is not topoclip's
    monkeypatch.setattr(topoclip, "__file__", str(checkout / "src" / "other" / "__init__.py"))
    assert code_info()["commit"] is None


@pytest.mark.slow
def test_ablate_whole_table3_after_a_subset(tmp_path, capsys):
    out = tmp_path / "table3"
    # Half the grid first (as if the run had been killed half-way), then the whole grid.
    assert main(["ablate", "--grid", "table3", *FAST, "--cells", "sphere_*", "euclidean_*", "--out", str(out)]) == 0
    assert main(["ablate", "--grid", "table3", *FAST, "--out", str(out)]) == 0
    result = json.loads((out / "ablation.json").read_text())
    assert result["trained_now"] == 16 and len(result["rows"]) == 16 and len(result["runs"]) == 32
    rows = [line for line in (out / "table.md").read_text().splitlines()
            if line.startswith("| ") and "model" not in line and "*paper:" not in line]  # the paper's rows in italics
    assert len(rows) == 16 and sum("| fixed |" in row for row in rows) == 4


def test_an_ablation_folder_has_one_owner(tmp_path, capsys):
    """Before: two ablate on one --out both ran (a "new" run folder was deleted before the trainer took its
    lock) and ablation.json mixed one process's settings with the other's results."""
    from topoclip.core.locks import claim_folder

    out = tmp_path / "grid"
    with claim_folder(out, "ablation folder"):  # as a first ablate holds it
        assert main(["ablate", "--grid", "tau-range", "--out", str(out), *FAST]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "ablation folder" in error and "is in use by process" in error
    assert not (out / "runs").exists()


PARENT = """
import os, sys, time
from concurrent.futures import ProcessPoolExecutor
import multiprocessing
from topoclip.experiments.runner import die_with_parent

if __name__ == "__main__":
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=die_with_parent,
                               initargs=(os.getpid(),))
    print(pool.submit(os.getpid).result(), flush=True)
    pool.submit(time.sleep, 120)
    time.sleep(120)
"""


@pytest.mark.slow
def test_jobs_children_end_with_a_killed_parent(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    pytest.fail(f"the --jobs child {child} outlived its killed parent")


def test_recorded_command_names_no_machine_path(monkeypatch, tmp_path):
    from topoclip.cli.experiments import recorded_command

    monkeypatch.setattr("sys.argv", ["topoclip", "ablate", "--grid", "table3", "--out", str(tmp_path / "exp" / "table3"),
                                     f"--reuse={tmp_path / 'compare'}", "--cells", "*_t-0-fixed", "--set", "train.lr=1e-3"])
    assert recorded_command() == ("topoclip ablate --grid table3 --out X/table3 --reuse=X/compare "
                                  "--cells '*_t-0-fixed' --set train.lr=1e-3")


def test_skipped_steps_add_up_over_resumes_that_restarted_the_count():
    """A run resumed by a topoclip whose checkpoints did not carry the count logged it from 0 again: 3 before, 2 after
    is 5, not the largest logged (3); a count that only grows is its last."""
    from topoclip.experiments.runner import skipped_steps

    def log(*counts):
        return [{"step": k, "loss": 1.0, **({"skipped_steps": c} if c else {})} for k, c in enumerate(counts)]

    assert skipped_steps(log(0, 3, 3, 0, 1, 2) + [{"step": 9, "eval": {}}]) == 5
    assert skipped_steps(log(0, 1, 1, 4)) == 4 and skipped_steps(log(0, 0)) == 0 and skipped_steps([]) == 0


@pytest.mark.slow
def test_a_run_that_stops_on_non_finite_values_leaves_the_grid_going(tmp_path, capsys):
    """From the review of #61's stability table: one diverging run ended the whole ablate (and the sweep script
    around it), and every later ablate trained it again and ended again. Now the run is marked (RUN/stopped.json, with
    the trainer's reason), left out of the table with a line saying why, listed under "stopped", and not trained
    again; the grid's other runs train and tabulate. τ = exp(101) makes the loss non-finite (test_run_folder)."""
    grid = {"preset": "tiny", "settings": ["train.num_workers=0", "train.batch_size=16", "evaluate.size=8",
                                           'evaluate.template_modes=["distance"]', "data.scenes.train_size=256",
                                           "data.scenes.val_size=16", "data.scenes.test_size=16"],
            "axes": [{"name": "start", "levels": [
                {"label": "fine", "set": []},
                {"label": "wild", "set": ["model.temperature.max_scale=1e44", "model.temperature.init=101"]}]}]}
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(grid))
    out, command = tmp_path / "out", ["ablate", "--grid", str(path), "--seeds", "1", "--steps", "12", "--probe-size", "0"]
    assert main([*command, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "wild seed 0: new -> stopped on non-finite values" in said and "left out of the table" in said
    result = json.loads((out / "ablation.json").read_text())
    assert [run["cell"] for run in result["runs"]] == ["fine"]
    assert [(run["cell"], run["seed"]) for run in result["stopped"]] == [("wild", 0)]
    assert result["stopped"][0]["stopped"].startswith("training stopped at step ")
    assert json.loads((out / "runs" / "wild" / "seed-0" / "stopped.json").read_text())["reason"] == \
        result["stopped"][0]["stopped"]
    assert "Left out: wild seed 0, which stopped on non-finite values (training stopped at step" in \
        (out / "table.md").read_text()
    assert main([*command, "--out", str(out)]) == 0  # not trained again
    assert "2 already done, 0 to run" in capsys.readouterr().out
    assert main([*command, "--cells", "wild", "--out", str(out)]) == 0  # a grid whose every run stopped: tabulated
    result = json.loads((out / "ablation.json").read_text())  # (the third review: a traceback, no ablation.json)
    assert result["runs"] == [] and [run["cell"] for run in result["stopped"]] == ["wild"]
    capsys.readouterr()
    # compare compares every seed of both models or none: a stopped run is one line, not a table of the survivors
    wild = ["--set", "model.temperature.max_scale=1e44", "--set", "model.temperature.init=101"]
    assert main(["compare", "--preset", "tiny", "--seeds", "2", "--steps", "12", *wild, "--set", "train.num_workers=0",
                 "--set", "evaluate.size=8", "--out", str(tmp_path / "compare")]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # (after the trainer's own lines on each skipped step)
    assert last.startswith("topoclip: error: compare: multi seed 0 stopped on non-finite values (training stopped at "
                           "step 5: the loss was non-finite"), last
    assert not (tmp_path / "compare" / "compare.md").exists()
