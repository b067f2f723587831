"""The README's figures are generated from docs/results/*.json (topoclip.experiments.results: `topoclip report`)."""
import importlib.util
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from topoclip.experiments import results as readme_results
from topoclip.experiments.results.benchmarks import lease_note
from topoclip.experiments import statistics

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_figures_equal_the_committed_results_files():
    readme = (ROOT / "README.md").read_text()
    assert "<!-- results:default-run -->" in readme and "<!-- results:compare -->" in readme
    assert readme_results.render_blocks(readme) == readme, "run: python scripts/readme_results.py write"


@pytest.mark.parametrize("page", sorted(path.name for path in (ROOT / "docs").glob("*.md")))
def test_each_page_of_the_docs_equals_the_committed_results_files(page):
    """The reference pages (docs/*.md, the README's sections since issue #60) keep their generated blocks current."""
    document = (ROOT / "docs" / page).read_text()
    assert readme_results.render_blocks(document) == document, "run: python scripts/readme_results.py write"


def test_the_default_run_results_are_the_default_command_on_the_built_in_sets():
    results = json.loads((ROOT / "docs" / "results" / "default-run.json").read_text())
    assert results["command"] == "topoclip train"
    top1 = {r["dataset"]: r["metrics"]["top1"] for r in results["records"]
            if r["task"] == "zeroshot_classification" and r["metrics"]["mode"] == "distance"}
    assert {"shape", "colour", "composition-held-out", "shape-ood", "colour-ood"} <= set(top1)


def test_a_table_row_shows_the_number_in_its_record():
    record = {"dataset": "shape", "domain": "in-domain", "task": "zeroshot_classification",
              "metrics": {"mode": "distance", "top1": 97.25, "top5": 100.0, "classes": 8}}
    results = {"command": "topoclip train", "machine": "m", "wall_seconds": 290.0, "torch": "2.13.0",
               "records": [record]}
    table = readme_results.default_run_table(results)
    assert "| shape | in-domain | 97.2 | 100.0 | 12.5 |" in table and "4.8 minutes" in table


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(path.name for path in (ROOT / "docs" / "results").glob("*.md")))
def test_each_page_of_the_report_equals_the_committed_results_files(page):
    document = (ROOT / "docs" / "results" / page).read_text()
    assert readme_results.render_blocks(document) == document, "run: python scripts/readme_results.py write"


def test_the_report_fits_a_reader_and_each_claim_row_a_screen():
    """Issue #44: the report's front page ≤ ~250 lines, with the headline figure and the short claims table; a claim
    row of the short table a few hundred characters (a screen), each linking a page that exists."""
    report = (ROOT / "docs" / "results" / "README.md").read_text()
    assert len(report.splitlines()) <= 250
    assert "![" in report and "(headline.png)" in report and "<!-- results:claims-summary -->" in report
    rows = readme_results.claims_summary_table(json.loads((ROOT / "docs" / "results" / "claims.json").read_text()))
    for row in rows.splitlines()[2:]:
        assert len(row) <= 600, row[:80]
        page = re.search(r"\]\(((?:\.\./)?[\w-]+\.md)\)", row).group(1)  # a report page, or a doc one level up
        assert (ROOT / "docs" / "results" / page).is_file(), page
    claims = (ROOT / "docs" / "results" / "claims.md").read_text()
    anchors = re.findall(r"\(claims\.md#(claim-\d+)\)", rows)
    assert len(anchors) == len(rows.splitlines()) - 2 and all(f'<a id="{anchor}"></a>' in claims for anchor in anchors)


def test_every_committed_plot_is_shown_and_any_other_drawn_on_demand(tmp_path):
    """docs/results stays small (issue #44): a PNG no page shows is not committed; a grid's curves are drawn from its
    JSON when wanted."""
    results = ROOT / "docs" / "results"
    shown = {match for document in readme_results.DOCUMENTS
             for match in re.findall(r"\]\(([\w./-]+\.png)\)", document.read_text())}
    committed = {str(path.relative_to(results)) for path in results.rglob("*.png")}
    assert committed - {name.removeprefix("docs/results/") for name in shown} == set()
    assert readme_results.plot_grid("tau-range-4800", tmp_path).stat().st_size > 10_000


FULL_SCENES_2X2 = "tau-range-full-scenes-19200-2x2"  # the 2 × 2 on the full scenes at 19,200 steps, trained in parts
AT_EITHER_RANGE = (("multi-sphere-s-range", "sphere-default-t"), ("multi-default-t", "sphere-multi-s-range"))


def in_domain_tests(source, *pairs):
    """Welch's t of test in-domain mean recall, cell a − cell b, for each (a, b) of docs/results/SOURCE."""
    return [readme_results.welch(*(readme_results.cell_values(source, cell, "headline:scenes-test/mean_recall")
                                   for cell in pair)) for pair in pairs]


def test_every_number_of_the_five_line_answer_is_its_json():
    """A reader's check (issue #44): each number the front page's answer quotes, recomputed here from the JSON it
    comes from and printed as the answer prints it; a number typed by hand, or one the JSON no longer gives, fails."""
    report = (ROOT / "docs" / "results" / "README.md").read_text().replace("−", "-")
    answer = " ".join(report[report.index("## The answer in five lines"):report.index("## The headline figure")].split())
    points = {(p["task"], p["lr"], p["noise"], p["steps"]): p for p in readme_results.headline_points()}
    best = points["built-in", 1e-3, 0, 9600]["in-domain"]
    assert f"{best['effect']:+.1f} points of mean recall, 95 % interval {best['low']:+.1f} to {best['high']:+.1f}" in answer
    assert f"({points['built-in', 2e-3, 0, 9600]['in-domain']['effect']:+.1f} at 9,600 steps)" in answer
    ceiling = json.loads((ROOT / "docs" / "results" / "ceiling.json").read_text())["ceiling"]["this_set"]["mean_recall"]
    hard = json.loads((ROOT / "docs" / "results" / "ceiling-hard.json").read_text())["ceiling"]["this_set"]["mean_recall"]
    assert f"on that test set ({ceiling:.1f})" in answer and f"ceiling {hard:.1f}" in answer
    (pilot,) = readme_results.load_results("hard-task-pilot")
    sphere = next(r for r in pilot["runs"]["sphere"] if r["dataset"] == "scenes-test")["metrics"]["mean_recall"]
    assert f"pilot at {sphere:.1f}" in answer
    noise = {(test["a"][1], test["metric"]): readme_results.difference(test) for claim in
             json.loads((ROOT / "docs" / "results" / "claims.json").read_text())["claims"] for test in claim["tests"]
             if test["a"][0] == "noise-lr1e-3-19200"}
    retrieval, shape = noise["multi_30", "headline:scenes-test/mean_recall"], noise["multi_50", "zero_shot_top1"]
    assert f"({retrieval.effect:+.1f} at 30 % and {shape.effect:+.1f} shape top-1 at 50 %" in answer
    rows = readme_results.tau_late_rise()
    rising = sum(row["p"] < 0.05 and row["change"] > 0 for row in rows)
    assert "in most long cells (the count, generated as cells land" in answer and rising > len(rows) / 2  # (#61's land)
    chosen = readme_results.lr_choice(readme_results.load_results("lr-choice-hard-lr-9600"))
    lrs = {family: cell.split("_lr-")[1] for family, cell in chosen.items()}
    assert f"(Multi {lrs['multi']}, the sphere {lrs['sphere']})" in answer
    lead, before = (points["full scenes", readme_results.EACH_FAMILYS_LR, 0, steps]["in-domain"]  # the 2 × 2's cells
                    for steps in (19200, 9600))  # at their own range: the pre-registered primary endpoint, at 19,200
    assert readme_results.lr_name(readme_results.EACH_FAMILYS_LR) == f"{lrs['multi']} multi, {lrs['sphere']} sphere"
    assert (f"at the end of 19,200 steps Multi is {lead['effect']:+.1f} points of mean recall ahead (95 % interval "
            f"{lead['low']:+.1f} to {lead['high']:+.1f}, five seeds a side; {before['effect']:+.1f} at 9,600 steps)") in answer
    assert lead["n_a"] == lead["n_b"] == before["n_a"] == before["n_b"] == 5
    geometry = in_domain_tests(FULL_SCENES_2X2, *AT_EITHER_RANGE)
    multi, sphere = in_domain_tests(FULL_SCENES_2X2, ("multi-sphere-s-range", "multi-default-t"),
                                    ("sphere-multi-s-range", "sphere-default-t"))
    # "≈": a − d = (a − c) + (c − d) holds exactly for the means, only to their rounding for the figures printed
    assert (f"Multi leads by {geometry[0].effect:+.1f} at the sphere's and {geometry[1].effect:+.1f} at Multi's; the "
            f"larger range adds the rest ({lead['effect']:.1f} ≈ {geometry[0].effect:.1f} + {-multi.effect:.1f} ≈ "
            f"{geometry[1].effect:.1f} + {sphere.effect:.1f}: Multi loses {-multi.effect:.1f} at the sphere's range, "
            f"the sphere gains {sphere.effect:.1f} at Multi's, p = {sphere.p:.3f}, not after Holm)") in answer
    assert multi.effect < 0 < sphere.effect and all(d.significant for d in (multi, sphere))  # "loses", "gains"
    page = (ROOT / "docs" / "results" / "full-scenes.md").read_text()
    table = page.split("<!-- results:tau-range-full-scenes-19200-tests -->")[1]
    in_domain = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[3] for line in table.splitlines()
                 if line.startswith("| range, ")}  # the generated table's † marks Holm's adjustment over its tests
    assert "†" not in in_domain["range, sphere: Multi's range − its own"]  # "not after Holm"
    shorter = in_domain_tests("tau-range-full-scenes-9600", *AT_EITHER_RANGE)
    assert f"the lead at either range was {shorter[0].effect:+.1f} and {shorter[1].effect:+.1f}" in answer
    assert all(d.significant and d.effect > 0 and d.n_a == d.n_b == 5 for d in geometry + shorter)  # "leads": both


def test_the_front_pages_figures_of_multi_against_the_sphere_are_their_json():
    """The project README (and claims.md's summary) quote the same Multi − sphere figures as the report's answer: each
    recomputed here."""
    readme = " ".join((ROOT / "README.md").read_text().replace("−", "-").split())
    points = {(p["task"], p["lr"], p["noise"], p["steps"]): p["in-domain"] for p in readme_results.headline_points()}
    best, lead = points["built-in", 1e-3, 0, 9600], points["full scenes", readme_results.EACH_FAMILYS_LR, 0, 19200]
    assert f"({best['effect']:+.1f}, interval {best['low']:+.1f} to {best['high']:+.1f}, ten seeds a side;" in readme
    assert best["n_a"] == best["n_b"] == 10 and lead["n_a"] == lead["n_b"] == 5
    said = (f"leads by {lead['effect']:+.1f} points of mean recall at the end of 19,200 steps (interval "
            f"{lead['low']:+.1f} to {lead['high']:+.1f}, five seeds a side")
    assert f"it {said})" in readme
    claims = " ".join((ROOT / "docs" / "results" / "claims.md").read_text().replace("−", "-").split())
    assert said in claims
    geometry = in_domain_tests(FULL_SCENES_2X2, *AT_EITHER_RANGE)
    assert all(d.significant and d.effect > 0 and d.n_a == d.n_b == 5 for d in geometry)
    ranges = [d.effect for d in in_domain_tests(FULL_SCENES_2X2, ("multi-default-t", "multi-sphere-s-range"),
                                                ("sphere-multi-s-range", "sphere-default-t"))]
    assert min(ranges) > 0  # the larger range (Multi's) adds, for either model
    said = (f"its larger logit range adding {math.floor(min(ranges))}–{math.ceil(max(ranges))} points: with both started at "
            f"the same initial range, Multi leads by {geometry[0].effect:+.1f} at the sphere's and "
            f"{geometry[1].effect:+.1f} at Multi's at 19,200 steps")
    assert said in readme and said in claims
    for name in ("ceiling", "ceiling-hard"):
        value = json.loads((ROOT / "docs" / "results" / f"{name}.json").read_text())["ceiling"]["this_set"]["mean_recall"]
        assert f"ceiling{',' if name == 'ceiling' else ''} {value:.1f})" in readme


def test_the_count_of_comparisons_is_the_tables_shown():
    """methods.md's count of the comparisons in the report's tables: each row × metric of every comparison table a page
    shows, so a table that lands (or a row added to a spec) changes it."""
    shown = {name for document in readme_results.DOCUMENTS
             for name in re.findall(r"<!-- results:([\w-]+-tests) -->", document.read_text())}
    count = sum(len(spec["rows"]) * len(spec["metrics"]) for spec in map(readme_results.load_results, shown))
    assert f"({count} in its comparison tables alone)" in (ROOT / "docs" / "results" / "methods.md").read_text()


def test_the_headline_points_are_welch_of_multi_against_the_sphere_at_the_grids_lr(tmp_path, monkeypatch):
    for task, lr, noise, grids, multi, sphere in readme_results.HEADLINE:
        for grid in (grids,) if isinstance(grids, str) else grids:
            path = readme_results.results_file(ROOT / "docs" / "results" / grid, "ablation.json")  # plain or packed
            if grid.startswith("hard-lr"):  # an lr grid: each cell names its lr
                assert readme_results.lr_name(lr) in multi and readme_results.lr_name(lr) in sphere
            elif not path.is_file():
                continue
            elif lr == readme_results.EACH_FAMILYS_LR:  # each family at its preset's lr, which no --set overrides
                results = readme_results.read_results(path)
                assert results["grid"] == "tau-range-full-scenes" and "train.lr" not in results["command"], grid
            else:  # a grid at one lr: its command sets it, or it is the preset's 2e-3
                command = readme_results.read_results(path)["command"]
                assert (f"train.lr={lr:g}" in command) if lr != 2e-3 else ("train.lr" not in command), grid
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)
    monkeypatch.setattr(readme_results.headline, "HEADLINE", (("t", 1e-3, 0, "g", "m", "s"), ("t", 1e-3, 0, "missing", "m", "s"),
                                                     ("t", 1e-3, 0, ("g", "more"), "m", "s"), ("t", 1e-3, 0, ("g", "missing"), "m", "s")))

    def grid(name, values, first_seed):
        runs = [{"cell": cell, "seed": first_seed + k, "headline": {"scenes-test/mean_recall": v, "scenes-test-ood/mean_recall": v / 2}}
                for cell, cell_values in values for k, v in enumerate(cell_values)]
        (tmp_path / name).mkdir()
        (tmp_path / name / "ablation.json").write_text(json.dumps({"steps": 9600, "runs": runs}))
    grid("g", (("m", (12.0, 14.0, 13.0)), ("s", (10.0, 10.0, 13.0))), 0)
    grid("more", (("m", (15.0,)), ("s", (9.0,))), 3)
    point, pooled = readme_results.headline_points()  # a grid not in docs/results leaves its point out, pooled or not
    assert point["steps"] == 9600 and point["in-domain"]["effect"] == pytest.approx(2.0)
    assert point["out-of-domain"]["effect"] == pytest.approx(1.0)
    assert "| t | 1e-3 | 0 % | 9,600 | 3, 3 | +2.0 (" in readme_results.headline_table([point])
    assert pooled["in-domain"]["effect"] == pytest.approx(13.5 - 10.5)  # the four seeds a side, seed 3 from "more"
    assert re.search(r"\| 4, 4 \| (\*\*)?\+3\.0(\*\*)? \(", readme_results.headline_table([pooled]))
    assert "[g](g/ablation.json), [more](more/ablation.json) |" in readme_results.headline_table([pooled])
    assert "copied with" not in readme_results.headline_table([pooled])
    more = json.loads((tmp_path / "more" / "ablation.json").read_text())  # its Multi run a copy of another grid's
    more["runs"][0]["reused_from"] = "../lr-grid/runs/m_lr-1e-3/seed-3"
    (tmp_path / "more" / "ablation.json").write_text(json.dumps(more))
    assert ("| 4, 4 |" in readme_results.headline_table([pooled]) and " 1 of the 2 runs of more's row are lr-grid's (the "
            "same recipe and seed, copied with `ablate --reuse`)." in readme_results.headline_table([pooled]))
    # The full scenes' 2 × 2 (each family at its preset's lr) is one more line, labelled with the presets' lrs.
    each = {**point, "lr": readme_results.EACH_FAMILYS_LR}
    assert "| t | 1e-3 multi, 5e-4 sphere | 0 % |" in readme_results.headline_table([point, each])
    figure = readme_results.plot_headline([point, each], tmp_path / "headline.png")
    assert figure.stat().st_size > 10_000
    # The figure carries what it was drawn from: another point's effect changes it; a last-bit difference does not.
    assert readme_results.drawn_from(figure) == readme_results.fingerprint([point, each])
    nudged = {**each, "in-domain": {**each["in-domain"], "effect": math.nextafter(each["in-domain"]["effect"], math.inf)}}
    assert readme_results.fingerprint([point, nudged]) == readme_results.drawn_from(figure)
    moved = {**each, "in-domain": {**each["in-domain"], "effect": each["in-domain"]["effect"] + 0.1}}
    assert readme_results.fingerprint([point, moved]) != readme_results.drawn_from(figure)


def test_the_committed_headline_figure_is_drawn_from_the_committed_results():
    figure = ROOT / "docs" / "results" / "headline.png"
    assert readme_results.drawn_from(figure) == readme_results.fingerprint(readme_results.headline_points()), \
        "run: python scripts/readme_results.py write"


def test_the_lr_choice_is_the_highest_mean_validation_recall_at_the_end_whatever_the_test_says():
    """The pre-registered rule of preregistration-hard-task.md: validation at the schedule's last step decides; a cell
    better on the test split, or at an earlier evaluation, is not picked. A run whose trainer stopped validating one
    eval_every short of the end takes scripts/final_validation.py's value; without one it is refused."""
    key = readme_results.CHOICE_METRIC

    def run(cell, seed, early, last, test, last_step=9600):
        return {"cell": cell, "seed": seed, "zero_shot_top1": 50.0,
                "evaluations": [{"step": 800, key: early}, {"step": last_step, key: last}],
                "headline": {"scenes-test/mean_recall": test, "scenes-test-ood/mean_recall": test / 2}}
    runs = [run("multi_lr-1e-3", 0, 10, 70, 40), run("multi_lr-1e-3", 1, 10, 72, 40), run("multi_lr-2e-3", 0, 90, 73, 60),
            run("multi_lr-2e-3", 1, 90, 68, 60), run("sphere_lr-5e-4", 0, 10, 50, 30, last_step=8800)]
    final = {"runs": [{"cell": "sphere_lr-5e-4", "seed": 0, "step": 9600, "eval": {key: 51.0}}]}
    results = {"steps": 9600, "runs": runs, "final_validation": final}
    assert readme_results.lr_choice(results) == {"multi": "multi_lr-1e-3", "sphere": "sphere_lr-5e-4"}
    table = readme_results.lr_choice_table(results)
    assert "| multi | **1e-3** | 2 | 71.0 ± 1.4 | 40.0 ± 0.0 | 20.0 ± 0.0 | 50.0 ± 0.0 |" in table
    assert "| multi | 2e-3 | 2 | 70.5 ± 3.5 | 60.0 ± 0.0 |" in table and "| sphere | **5e-4** | 1 | 51.0 ± 0.0 |" in table
    with pytest.raises(ValueError, match="scripts/final_validation.py"):
        readme_results.lr_choice({"steps": 9600, "runs": runs})


def test_an_equivalence_row_pools_each_sides_seeds_and_tost_decides_only_without_a_difference(tmp_path, monkeypatch):
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)
    for grid, first, values in (("old", 0, {"m": [45.0, 46.0], "s": [45.5, 44.5], "far": [40.0, 41.0],
                                            "tight": [45.0, 45.1], "near": [44.0, 44.1]}),
                                ("new", 2, {"m": [45.5, 46.5, 44.5], "s": [45.0, 46.0, 45.0], "far": [40.5, 41.5, 39.5],
                                            "tight": [45.0, 45.1, 45.05], "near": [44.0, 44.1, 44.05]})):
        (tmp_path / grid).mkdir()
        runs = [{"cell": cell, "seed": first + k, "headline": {"x": v}} for cell, vs in values.items() for k, v in enumerate(vs)]
        (tmp_path / grid / "ablation.json").write_text(json.dumps({"steps": 9600, "runs": runs}))
    def row(b, a="m"):
        return {"label": "x", "metric": "headline:x", "a": [["old", a], ["new", a]], "b": [["old", b], ["new", b]]}
    table = readme_results.equivalence_table({"about": "A.", "margin": 2.0,
                                              "rows": [row("s"), row("far"), row("near", a="tight")]})
    same, differ, small = table.splitlines()[4:7]
    a, s = [45.0, 46.0, 45.5, 46.5, 44.5], [45.5, 44.5, 45.0, 46.0, 45.0]
    e = readme_results.tost(a, s, 2.0)
    assert same.startswith("| x | 5, 5 | +0.3 (") and f"{e.low:+.1f} to {e.high:+.1f}" in same
    assert e.equivalent and same.endswith("**equivalent within ±2** |")
    assert differ.endswith("**a > b** |")
    assert small.endswith("**a > b, by less than ±2** |")  # +1.0 ± 0.1: a difference, and one inside the margin
    with pytest.raises(ValueError, match="counted twice"):  # the same grid twice: its seeds would count twice
        readme_results.pooled_values([["old", "m"], ["old", "m"]], "headline:x")
    with pytest.raises(ValueError, match="5 and 5 runs of the 6"):  # registered with 6 a side: a grid still runs
        readme_results.equivalence_table({"about": "A.", "margin": 2.0, "seeds": 6, "rows": [row("s")]})


def test_the_papers_table_10_stands_beside_our_k_with_the_same_share_of_sub_spheres():
    """Issue #44: the paper's k = 8 is half of its 16 sub-spheres, so it stands under our k = 4 of 8, not k = 8."""
    runs = [{"draws": 1, "size": 10, "mode": "distance",
             "sets": {"shape": {"classes": 8, "subsets": [{"k": k, "mean": 10.0 * k} for k in (1, 2, 4, 8)]}}}]
    header, _, shape, paper = readme_results.experts_table(runs).splitlines()[2:6]
    assert header.split(" | ")[2:] == ["k = 1 of 8", "k = 2 of 8", "k = 4 of 8", "k = 8 of 8 |"]
    assert paper.split(" | ")[2:] == ["*21.5 ± 14.3*", "*27.7 ± 20.4*", "*62.1 ± 4.4*", "*76.4 (Table 2)* |"]


def test_a_retrieval_table_shows_every_metric_beside_its_ceiling(tmp_path, monkeypatch):
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)
    keys = [key for _, key in readme_results.CEILING_ROWS + readme_results.RANK_ROWS]
    runs = [{"cell": "c", "retrieval": {"t": {key: value + i for i, key in enumerate(keys)}}} for value in (10.0, 12.0)]
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "ablation.json").write_text(json.dumps({"runs": runs}))
    ceiling = {key: 50.0 + i for i, key in enumerate(keys[:len(readme_results.CEILING_ROWS)])}
    (tmp_path / "roof.json").write_text(json.dumps({"ceiling": {"this_set": ceiling}}))
    table = readme_results.retrieval_table({"about": "A.", "ceiling": "roof", "set": "t",
                                            "cells": [{"label": "C", "source": "g", "cell": "c"}]})
    assert "| text → image R@1 | 50.0 | 11.0 ± 1.4 |" in table and "| mean recall | 56.0 | 17.0 ± 1.4 |" in table
    assert "| text → image R-Precision | — | 21.0 ± 1.4 |" in table


def test_convergence_needs_both_curves_flat_and_the_longer_schedule_no_better(tmp_path, monkeypatch):
    """The pre-registered rule: a cell whose validation recall or τ still moves over the last quarter, or whose longer
    schedule is better, is "at the end of the schedule"; only a cell that passes all three is "converged"."""
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)
    key = readme_results.CHOICE_METRIC
    jitter = (0.1, -0.1, 0.0)  # per seed: a change that is no change

    def run(cell, seed, test=50.0, recall_rise=0.0, tau_rise=0.0):
        recall, tau = 60.0 + 2 * seed, 10.0 + seed  # the seeds spread by 2 and 1 at the end
        return {"cell": cell, "seed": seed, "headline": {"scenes-test/mean_recall": test + seed},
                "evaluations": [{"step": 14400, key: recall - recall_rise - jitter[seed]}, {"step": 19200, key: recall}],
                "curve": {"steps": [9600, 14400, 19200], "scale": [tau, tau - tau_rise - jitter[seed] / 10, tau]}}
    long = [run("flat", k) for k in range(3)] + [run("tau", k, tau_rise=1.0) for k in range(3)] \
        + [run("recall", k, recall_rise=1.0) for k in range(3)] + [run("better", k, test=60.0) for k in range(3)] \
        + [run("drift", k, recall_rise=(3.0, 0.0, 6.0)[k]) for k in range(3)]  # +3.0: not significant, but > sd 2
    short = [run(cell, k) for cell in ("flat", "tau", "recall", "better", "drift") for k in range(3)]
    for name, runs, steps in (("long", long, 19200), ("short", short, 9600)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ablation.json").write_text(json.dumps({"steps": steps, "runs": runs}))
    table = readme_results.convergence_table({"about": "A.", "short": "short", "long": "long",
                                              "cells": ["flat", "tau", "recall", "better", "drift"]})
    verdicts = [line.rsplit(" | ", 1)[1] for line in table.splitlines()[4:9]]
    assert verdicts == ["**converged** |"] + ["**at the end of the schedule** |"] * 4
    assert "| drift | +3.0 (" in table and "p = 0.2" in table.splitlines()[8]
    assert "19,200 − 9,600 steps" in table and "| flat | +0.0 (" in table and "(2.0) |" in table
    with pytest.raises(ValueError, match="no validation evaluation at step 19,200"):
        readme_results.last_quarter([{**long[0], "evaluations": long[0]["evaluations"][:1]}], 19200)
    (tmp_path / "long" / "ablation.json").write_text(json.dumps({"steps": 19200, "runs": long[:3]}))
    table = readme_results.convergence_table({"about": "A.", "short": "short", "long": "long", "cells": ["flat", "tau"]})
    assert "| flat | +0.0 (" in table and "| tau | | | | not run yet |" in table  # (its runs under way)
    (tmp_path / "long" / "ablation.json").write_text(json.dumps({"steps": 19200, "runs": long[:1]}))
    with pytest.raises(ValueError, match="cell flat has 1 runs"):
        readme_results.convergence_table({"about": "A.", "short": "short", "long": "long", "cells": ["flat"]})


def test_a_stability_row_counts_skipped_steps_and_fp16s_halvings_and_spans_tau_and_curvature(tmp_path, monkeypatch):
    """#61's stability measures from the run records `ablate` writes: non-finite skips summed (and the runs with any),
    fp16's overflow skips counted from the loss scale's halvings, τ and c at the end (mean ± sd) and over the run."""
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)
    assert readme_results.overflow_skips([65536.0, 32768.0, 65536.0, 8192.0, 8192.0]) == 1 + 3
    assert readme_results.overflow_skips([16384.0, 16384.0]) == 2  # halved twice before the first logged step

    def run(cell, seed, skipped=0, **curve):
        return {"cell": cell, "seed": seed, "skipped_steps": skipped, "curve": {"steps": [1, 2], **curve}}
    runs = [run("lorentz", 0, skipped=2, scale=[10.0, 20.0], curvature=[1.0, 0.5]),
            run("lorentz", 1, scale=[10.0, 30.0], curvature=[0.8, 0.7]),
            run("half", 0, scale=[10.0, 12.0], curvature=[1.0, 1.2], loss_scale=[65536.0, 16384.0]),
            run("sphere", 0, scale=[10.0, 11.0])]
    del runs[-1]["skipped_steps"]  # a record from before the count was kept
    (tmp_path / "g").mkdir()
    stopped = [{"cell": "half", "seed": 1, "stopped": "training stopped at step 7: …"},
               {"cell": "wild", "seed": 0, "stopped": "training stopped at step 3: …"}]
    (tmp_path / "g" / "ablation.json").write_text(json.dumps({"steps": 2, "seeds": 2, "runs": runs, "stopped": stopped,
                                                              "unfinished": {"later": 0}}))
    rows = [{"label": label, "source": "g", "cell": cell} for label, cell in
            (("L", "lorentz"), ("H", "half"), ("S", "sphere"), ("W", "later"), ("X", "wild"))]
    table = readme_results.stability_table({"about": "A.", "rows": rows}).splitlines()
    assert table[4] == "| L | 2 | 2 (1) | — (not fp16) | 25.0 ± 7.1 | 10.0–30.0 | 0.600 ± 0.141 | 0.500–1.000 |"
    assert table[5] == ("| H | 1 (+ 1 stopped on non-finite values) | 0 (0) | 2 | 12.0 (one run) | 10.0–12.0 | "
                        "1.200 (one run) | 1.000–1.200 |")
    assert table[6] == "| S | 1 | — (not recorded) | — (not fp16) | 11.0 (one run) | 10.0–11.0 | — | — |"
    assert table[7] == "| W | 0 of 2 so far | | | | | | |"
    assert table[8] == "| X | 0 (+ 1 stopped on non-finite values) | | | | | | |"


def test_the_full_scenes_presets_are_the_preregistered_task_at_each_familys_chosen_lr():
    """cpu-{multi,sphere}-full-scenes train the task whose ceiling ceiling-hard.json gives, at the lr the
    pre-registered rule chose for the family; apart from the scenes and the schedule they are the family's preset."""
    from topoclip.config import load_config, to_dict
    from topoclip.experiments.grid import config_differences

    ceiling = json.loads((ROOT / "docs" / "results" / "ceiling-hard.json").read_text())
    task = load_config(ceiling["preset"], ceiling["overrides"]).data.scenes
    chosen = readme_results.lr_choice(readme_results.load_results("lr-choice-hard-lr-9600"))
    for family in ("multi", "sphere"):
        preset = load_config(f"cpu-{family}-full-scenes")
        assert preset.data.scenes == task
        assert readme_results.lr_name(preset.train.lr) == chosen[family].split("_lr-")[1]
        assert sorted(config_differences(to_dict(preset), to_dict(load_config(f"cpu-{family}")))) == [
            "data.scenes.max_objects", "data.scenes.object_scale", "train.lr", "train.steps"]  # the name aside


BLOCKS = sorted({name for document in readme_results.DOCUMENTS
                 for name in re.findall(r"<!-- results:([\w-]+) -->", document.read_text())})


@pytest.mark.parametrize("name", BLOCKS)
def test_each_generated_block_has_a_results_file(name):
    assert readme_results.load_results(name)


def test_a_claim_shows_mean_and_std_of_its_cells_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)
    runs = [{"cell": "a", "final_t": math.log(2.0), "zero_shot_top1": 50.0, "headline": {"x/mean_recall": 10.0}},
            {"cell": "a", "final_t": math.log(4.0), "zero_shot_top1": 70.0, "headline": {"x/mean_recall": 20.0}},
            {"cell": "b", "final_t": 0.0, "zero_shot_top1": 0.0, "headline": {"x/mean_recall": 0.0}}]
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "ablation.json").write_text(json.dumps({"runs": runs}))
    item = {"source": "grid", "cell": "a", "label": "a:"}
    assert readme_results.measured({**item, "metric": "tau"}) == "a: 3.0 ± 1.4"  # τ = 2 and 4
    assert readme_results.measured({**item, "metric": "zero_shot_top1"}) == "a: 60.0 ± 14.1"
    assert readme_results.measured({**item, "metric": "headline:x/mean_recall", "digits": 2}) == "a: 15.00 ± 7.07"
    with pytest.raises(KeyError):
        readme_results.measured({**item, "cell": "c", "metric": "tau"})


def test_a_rerun_row_is_the_prediction_interval_cut_to_the_metrics_bounds(tmp_path, monkeypatch):
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)
    runs = [{"cell": "a", "final_t": 0.0, "zero_shot_top1": v} for v in (90.0, 99.0, 96.0)]
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "ablation.json").write_text(json.dumps({"runs": runs}))
    # mean 95, sd √21, t(0.975, 2) = 4.302652729749462 (SciPy): 95 ± 4.3027·√21·√(4/3) = 95 ± 22.8
    table = readme_results.rerun_table("grid", ["a"], [{"metric": "zero_shot_top1", "label": "top-1"},
                                                      {"metric": "zero_shot_top1", "label": "cut", "bounds": [0, 100]}])
    assert "| a | 95.0 (72.2 to 117.8) | 95.0 (72.2 to 100.0) |" in table and "n = 3 runs" in table
    spec = {"about": "Where one more seed lands.", "source": "grid", "cells": ["a"],
            "metrics": [{"metric": "zero_shot_top1", "label": "cut", "bounds": [0, 100]}]}
    (tmp_path / "grid-reruns.json").write_text(json.dumps(spec))  # a block named NAME-reruns draws its spec file
    drawn = readme_results.render_blocks("<!-- results:grid-reruns -->\n<!-- /results:grid-reruns -->")
    assert "Where one more seed lands.\n\n| one more seed of | cut |" in drawn and "| a | 95.0 (72.2 to 100.0) |" in drawn


def test_a_rerun_check_reads_a_new_seed_on_another_machine_against_its_intervals(tmp_path, monkeypatch):
    """NAME-rerun-check.json: each landed re-run's values inside the -reruns spec's intervals or not, the decider's
    verdict; one that stopped on non-finite values fails; one that is not the registered seed, was not trained by the
    call that tabulated it, trained with other code or otherwise than the cell's runs (the machine's settings aside,
    however spelled), on a GPU with TF32 on, or on the cell's own kernel does not count, and says why, as does one
    whose results cannot be read; one not landed shows as such; presets changed since the registration are refused."""
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)
    cell = "lorentz_lr-5e-4"  # a shipped grid's cell: a re-run's config is resolved from its recorded command

    def grid(name, platform, runs, options="", cuda=False, stopped=(), **more):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ablation.json").write_text(json.dumps({
            "analysis": "ablation", "steps": 100, "stopped": [{"cell": cell, "seed": s} for s in stopped], "runs": runs,
            "command": f"topoclip ablate --grid lorentz --steps 100 --cells {cell} --out X/{name}{options}",
            "machine": {"platform": f"{platform}-with-glibc2.36", "cpus": 2, "torch": "2.13.0", "cuda": cuda}, **more}))

    def run(seed, top1, t=0.0, **more):
        return {"cell": cell, "seed": seed, "final_t": t, "zero_shot_top1": top1, **more}

    grid("g", "Linux-A", [run(0, 90.0), run(1, 99.0), run(2, 96.0)])  # 95 ± 22.8 (as above), cut to 72.2–100
    metrics = [{"metric": "zero_shot_top1", "label": "top-1", "bounds": [0, 100]}, {"metric": "tau", "label": "τ"}]
    (tmp_path / "g-reruns.json").write_text(json.dumps({"about": "", "source": "g", "cells": [cell], "metrics": metrics}))
    registered = readme_results.trained_config(readme_results.load_result("g"), cell, 5)
    spec = {"about": "The check.", "reruns": "g-reruns", "seed": 5, "decides": "zero_shot_top1", "code_sha256": "pin",
            "config": registered, "runs": []}

    def column(options="", platform="Linux-B", top1=80.0, t=0.0, cuda=False, seed=5, results=None, **more):
        shutil.rmtree(tmp_path / "r", ignore_errors=True)
        grid("r", platform, [run(seed, top1, t, **more)] if top1 is not None else [], options, cuda,
             [seed] if top1 is None else (), **(results or {}))
        table = readme_results.rerun_check_table({**spec, "runs": [{"label": "r", "source": "r"}]})
        return [line.rsplit(" | ", 1)[-1].rstrip(" |") for line in table.splitlines() if line.startswith("| ")][1:]

    gpu = " --first-seed 5 --seeds 1 --set train.device=cuda --set train.precision=fp32 --set train.allow_tf32=false"
    assert column(gpu, t=1.0, cuda=True) == ["80.00 inside", "2.72 **outside**", "**passes** (1 of 2 inside)"]
    assert column(top1=70.0) == ["70.00 **outside**", "1.00 inside", "**fails** (1 of 2 inside)"]
    assert column(top1=72.23) == ["72.23 **outside**", "1.00 inside", "**fails** (1 of 2 inside)"]  # 72.2295… shows 72.23
    assert column(top1=None) == ["stopped on non-finite values"] * 2 + ["**fails** (0 of 2 inside)"]
    # the settings a cell's runs had, spelled otherwise, are the same recipe; the pinned code's digest, or none
    assert column(" --set train.lr=5.0e-4 --set train.allow_tf32=true --preset cpu-sphere-full-scenes",
                  results={"code": {"sha256": "pin"}})[-1].startswith("**passes**")
    assert column(platform="Linux-B-with-glibc2.39")[-1].startswith("**passes**")  # another C library, not machine
    for options, more, why in (
            ("", {"platform": "Linux-A"}, "does not count: Linux-A is a machine the cell's runs trained on"),
            ("", {"seed": 6}, "does not count: is lorentz_lr-5e-4 seed 6, not the registered lorentz_lr-5e-4 seed 5"),
            ("", {"reused_from": "X/other"}, "does not count: not trained by the call that tabulated it"),
            ("", {"results": {"trained_now": 0}}, "does not count: not trained by the call that tabulated it"),
            ("", {"results": {"code": {"sha256": "other"}}}, "does not count: trained with other code than the pinned"),
            (" --set train.lr=0.1", {}, "does not count: trained otherwise than the cell's runs (train.lr)"),
            (" --set train.precision=bf16", {}, "does not count: trained otherwise than the cell's runs (train.precision)"),
            (" --steps 200", {}, "does not count: trained otherwise than the cell's runs (train.steps)"),
            (" --set train.device=cuda", {"cuda": True}, "does not count: trained on a GPU with TF32 on"),
            ("", {"cuda": True}, "does not count: trained on a GPU with TF32 on"),  # device auto: the GPU
            ("", {"results": {"command": None}}, "does not count: r's results cannot be read")):
        assert column(options, **more)[-1].startswith(why), (options, more)
    assert column(" --set train.device=cpu", cuda=True)[-1].startswith("**passes**")  # TF32 is a GPU's only
    shutil.rmtree(tmp_path / "r")
    grid("r", "Linux-B", [])  # no run, none stopped either
    table = readme_results.rerun_check_table({**spec, "runs": [{"label": "r", "source": "r"}, {"label": "later",
                                                                                              "source": "later"}]})
    assert "| top-1 (decides) | 95.00 (72.23 to 100.00) | — | not run yet |" in table
    assert "| verdict | | does not count: holds 0 runs, not one (`--seeds 1`) | — |" in table
    (tmp_path / "g-rerun-check.json").write_text(json.dumps(spec))  # a block named NAME-rerun-check draws its spec
    assert "| verdict |" in readme_results.render_blocks("<!-- results:g-rerun-check -->\n<!-- /results:g-rerun-check -->")
    with pytest.raises(ValueError, match="must name one cell"):
        readme_results.rerun_check_table({**spec, "decides": "headline:x"})
    drifted = {**registered, "train": {**registered["train"], "lr": 0.1}}  # a preset changed since the registration
    with pytest.raises(ValueError, match=r"otherwise than when its re-run check was registered \(train.lr\)"):
        readme_results.rerun_check_table({**spec, "config": drifted})
    newer = {**registered, "train": {key: value for key, value in registered["train"].items() if key != "lr"}}
    assert "| verdict |" in readme_results.rerun_check_table({**spec, "config": newer})  # a setting added since


def test_a_landed_grid_is_its_ablation_json_in_a_folder_of_its_name(tmp_path, monkeypatch):
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path / "results")
    out = tmp_path / "sweep" / "grid-19200"
    out.mkdir(parents=True)
    results = {"analysis": "ablation", "description": "2 × 2", "runs": [{"cell": "a", "seed": 0}]}
    (out / "ablation.json").write_text(json.dumps(results, indent=1))
    landed = readme_results.land(out)
    assert landed == tmp_path / "results" / "grid-19200" / "ablation.json"
    assert landed.read_text(encoding="utf-8") == '{"analysis":"ablation","description":"2 × 2","runs":[{"cell":"a","seed":0}]}'
    (out / "ablation.json").write_text(json.dumps({"analysis": "compare"}))
    with pytest.raises(ValueError, match="not what `topoclip ablate` writes"):
        readme_results.land(out)


@pytest.mark.parametrize("command", [None, 7, ["topoclip", "ablate"], "topoclip ablate --grid 'lorentz"])
def test_a_recorded_command_that_is_not_a_command_line_is_refused_never_read_from_stdin(command, monkeypatch):
    """run_settings reads the command a results file records (a pool's parts, a re-run check): a value that is no
    string is refused, where shlex.split(None) would wait on standard input."""
    monkeypatch.setattr("sys.stdin", io.StringIO("topoclip ablate --grid lorentz\n"))  # what it must never take
    with pytest.raises(ValueError, match="not a `topoclip ablate` command line|No closing quotation"):
        readme_results.run_settings(command)


def test_a_grid_trained_in_parts_is_one_grid_to_its_readers(tmp_path, monkeypatch):
    """docs/results/NAME.json {"parts": [...], "seeds"}: `ablate` runs of one grid, each into its own folder, read as
    one ablation by a comparison, the convergence rule and τ's late rise (one cell, each run once), each cell only once
    all its registered seeds have landed; what would pool runs of other recipes, or count a run twice, is refused."""
    results, out = tmp_path / "results", tmp_path / "out"  # docs/results, and where `ablate` wrote the parts to land
    monkeypatch.setattr(readme_results.files, "RESULTS", results)
    key = readme_results.CHOICE_METRIC

    def run(cell, seed, value):
        return {"cell": cell, "seed": seed, "run_dir": f"runs/{cell}/seed-{seed}", "zero_shot_top1": value,
                "headline": {"scenes-test/mean_recall": value},
                "evaluations": [{"step": 7200, key: value}, {"step": 9600, key: value + 0.1 * seed}],
                "curve": {"steps": [2400, 7200, 9600], "scale": [10.0, 10.0, 11.0 + 0.1 * seed]}}

    def part(name, runs, command="topoclip ablate --grid g --steps 9600 --set train.lr=0.001 --seeds 2 --out X/p",
             where=results, **meta):
        (where / name).mkdir(parents=True, exist_ok=True)
        (where / name / "ablation.json").write_text(json.dumps(
            {"analysis": "ablation", "grid": "g", "steps": 9600, "preset": "cpu", "command": command, "runs": runs, **meta}))
    # The same recipe however the options that only choose runs, the option order or the --opt=value form differ.
    part("own", [run("a", k, 50.0 + k) for k in range(3)], "topoclip ablate --grid g --seeds 3 --jobs 1 --steps 9600 "
         "--set=train.lr=0.001 --reuse X/lr --out X/own")
    part("b-seeds0-1", [run("b", k, 40.0 + k) for k in range(2)], "topoclip ablate --grid g --cells b --steps 9600 "
         "--set train.lr=0.001 --first-seed 0 --seeds 2 --jobs 2 --out X/b-seeds0-1")
    part("b-seed2", [run("b", 2, 42.0)], where=out)
    part("short", [run(c, k, 30.0 + k) for c in "ab" for k in range(3)], steps=4800)
    (results / "whole.json").write_text(json.dumps({"about": "A.", "seeds": 3, "parts": ["own", "b-seeds0-1"]}))
    convergence = {"about": "A.", "short": "short", "long": "whole", "cells": ["a", "b"]}
    comparison = {"source": "whole", "rows": [{"label": "a − b", "a": "a", "b": "b"}],
                  "metrics": [{"metric": "zero_shot_top1", "label": "top-1"}]}
    assert "| b | | | | 2 of its 3 seeds so far |" in readme_results.convergence_table(convergence)
    with pytest.raises(ValueError, match="whole's b has 2 of its 3 seeds so far"):  # its grid still running
        readme_results.comparison_table(comparison)
    with pytest.raises(ValueError, match="b has 2 of its 3 seeds so far: the lr rule waits"):  # reads whole cells
        readme_results.lr_choice(readme_results.load_results("whole"))
    assert [(row["grid"], row["cell"]) for row in readme_results.tau_late_rise()] == [("whole", "a")]

    assert readme_results.land(out / "b-seed2", pool="whole") == results / "b-seed2" / "ablation.json"
    assert json.loads((results / "whole.json").read_text())["parts"] == ["own", "b-seeds0-1", "b-seed2"]
    whole = readme_results.load_results("whole")
    assert whole["steps"] == 9600 and whole["unfinished"] == {} and [(r["cell"], r["seed"]) for r in whole["runs"]] == [
        ("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)]
    assert "| a − b | **+10.0**" in readme_results.comparison_table(comparison)
    assert "| b | +0.1 (" in readme_results.convergence_table(convergence)
    assert [(row["grid"], row["cell"], row["n"]) for row in readme_results.tau_late_rise()] == [  # short: < 9,600 steps
        ("whole", "a", 3), ("whole", "b", 3)]
    with pytest.raises(ValueError, match="parts of one grid, each with its own table"):
        readme_results.ablation_table(whole)
    assert readme_results.land(out / "b-seed2", pool="whole")  # landed again: the same part, listed once
    assert json.loads((results / "whole.json").read_text())["parts"] == ["own", "b-seeds0-1", "b-seed2"]

    landed = (results / "b-seed2" / "ablation.json").read_text()
    for runs, meta, problem in (([run("b", 1, 41.0)], {}, "b seed 1 is in two of its parts"),
                                ([run("b", 3, 43.0)], {}, "b seed 3 is not one of the 3 seeds registered"),
                                ([run("b", 2, 43.0)], {"steps": 19200}, "differs from own in steps"),
                                ([run("b", 2, 43.0)], {"preset": "gpu"}, "differs from own in preset"),
                                ([run("b", 2, 43.0)], {"command": "topoclip ablate --grid g --steps 9600 --set "
                                                                  "train.lr=0.002 --out X/p"}, "differs from own in settings"),
                                ([run("b", 2, 43.0)], {"command": "topoclip ablate --grid g --steps 9600 --set train.lr=0.001 "
                                                                  "--probe-size 10 --out X/p"}, "differs from own in settings")):
        part("b-seed2", runs, where=out, **meta)  # b-seed2 landed again, or as a new part, each refused
        for name in ("b-seed2", "b-more"):
            if name == "b-more":
                (out / "b-seed2").rename(out / "b-more")
            with pytest.raises(ValueError, match=problem):
                readme_results.land(out / name, pool="whole")
            assert not (results / "b-more").exists() and (results / "b-seed2" / "ablation.json").read_text() == landed
            assert json.loads((results / "whole.json").read_text())["parts"] == ["own", "b-seeds0-1", "b-seed2"]
        shutil.rmtree(out / "b-more")
    (results / "other.json").write_text(json.dumps({"parts": ["b-seed2"]}))
    with pytest.raises(ValueError, match="b-seed2 is a part of both other and whole"):
        readme_results.tau_late_rise()
    (results / "other.json").unlink()
    part("b-seed2", [run("b", 2, 42.0)], where=out)
    with pytest.raises(ValueError, match="b-seed2 is a part of whole: land it with --pool whole"):
        readme_results.land(out / "b-seed2")  # landing a pooled part outside its pool
    (results / "other.json").write_text(json.dumps({"seeds": 3, "parts": []}))  # registered before its first part
    assert readme_results.load_results("other")["runs"] == [] and readme_results.tau_late_rise()
    assert "| a | | | | not run yet |" in readme_results.convergence_table({**convergence, "long": "other"})
    for parts, problem in ((["own", "own"], "must list its parts, each once"),
                           (["missing"], "part missing is not an ablation folder"),
                           (["whole"], "part whole is not an ablation folder")):
        (results / "other.json").write_text(json.dumps({"parts": parts}))
        with pytest.raises(ValueError, match=problem):
            readme_results.load_results("other")
    part("new", [run("c", 0, 1.0)], where=out)
    (results / "spec-tests.json").write_text(json.dumps({"rows": []}))
    for pool in ("nowhere", "spec-tests"):
        with pytest.raises(ValueError, match=f"{pool}.json is not a grid in parts"):
            readme_results.land(out / "new", pool=pool)
        assert not (results / "new").exists()
    part("whole", [], where=out)
    with pytest.raises(ValueError, match="whole.json exists and would hide"):
        readme_results.land(out / "whole")
    monkeypatch.setattr(sys, "argv", ["readme_results.py", "land", str(out / "whole")])
    assert readme_results.main() == 1  # a refused landing: one line, no traceback


def test_a_run_that_stopped_completes_its_cell_of_a_grid_in_parts(tmp_path, monkeypatch):
    """A run that stopped on non-finite values (ablate's "stopped") is done, not trained again: its cell is no longer
    waiting for it, and its numbers are in no table; listed in two parts, it would count twice."""
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)
    command = "topoclip ablate --grid g --steps 9600 --out X/p"
    for name, runs, stopped in (("p1", [{"cell": c, "seed": k, "zero_shot_top1": 50.0 + k + 10 * (c == "b")}
                                         for c, seeds in (("a", (0, 1)), ("b", (0, 1, 2))) for k in seeds], []),
                                ("p2", [], [{"cell": "a", "seed": 2, "stopped": "training stopped at step 9: …"}])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ablation.json").write_text(json.dumps({"analysis": "ablation", "grid": "g", "steps": 9600,
                                                                   "preset": "cpu", "command": command, "runs": runs,
                                                                   "stopped": stopped}))
    (tmp_path / "whole.json").write_text(json.dumps({"about": "A.", "seeds": 3, "parts": ["p1", "p2"]}))
    whole = readme_results.load_results("whole")
    assert whole["unfinished"] == {} and [(r["cell"], r["seed"]) for r in whole["stopped"]] == [("a", 2)]
    assert readme_results.cell_values("whole", "a", "zero_shot_top1") == [50.0, 51.0]
    # every table of the cell leaves it out, says so, and counts it as done (reported, not re-run)
    comparison = readme_results.comparison_table({"source": "whole", "rows": [{"label": "a − b", "a": "a", "b": "b"}],
                                                  "metrics": [{"metric": "zero_shot_top1", "label": "top-1"}]})
    equivalence = readme_results.equivalence_table({"about": "A.", "margin": 2.0, "seeds": 3, "rows": [
        {"label": "e", "metric": "zero_shot_top1", "a": [["whole", "a"]], "b": [["whole", "b"]]}]})
    assert "n = 2 and 3 runs" in comparison and "| e | 2, 3 |" in equivalence
    assert all(table.endswith("Left out, stopped on non-finite values: a seed 2 (whole).")
               for table in (comparison, equivalence))
    with pytest.raises(ValueError, match="every run of p2's a stopped on non-finite values"):
        readme_results.cell_values("p2", "a", "zero_shot_top1")
    (tmp_path / "whole.json").write_text(json.dumps({"about": "A.", "seeds": 3, "parts": ["p1", "p2", "p3"]}))
    shutil.copytree(tmp_path / "p2", tmp_path / "p3")
    with pytest.raises(ValueError, match="a seed 2 is in two of its parts"):
        readme_results.load_results("whole")
    # checked as its runs are (the third review): a seed beyond the registered ones, entries of other types
    for stopped, problem in (([{"cell": "a", "seed": 7, "stopped": "…"}], "a seed 7 is not one of the 3 seeds"),
                             ([1], "part p3 is not an ablation folder"), (None, "part p3 is not an ablation folder"),
                             ([{"cell": "a"}], "part p3 is not an ablation folder")):
        values = json.loads((tmp_path / "p2" / "ablation.json").read_text())
        (tmp_path / "p3" / "ablation.json").write_text(json.dumps({**values, "stopped": stopped}))
        (tmp_path / "whole.json").write_text(json.dumps({"about": "A.", "seeds": 3, "parts": ["p1", "p3"]}))
        with pytest.raises(ValueError, match=problem):
            readme_results.load_results("whole")


def test_a_cell_of_a_grid_in_parts_without_its_newer_metrics_names_the_part(tmp_path, monkeypatch):
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)
    for name, runs in (("new", [{"cell": "a", "seed": 0, "retrieval": {"t": {"m": 1.0}}}]),
                       ("old", [{"cell": "a", "seed": 1}])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ablation.json").write_text(json.dumps(
            {"analysis": "ablation", "steps": 1, "command": "topoclip ablate --grid g", "runs": runs}))
    (tmp_path / "both.json").write_text(json.dumps({"parts": ["new", "old"]}))
    with pytest.raises(KeyError, match="old's ablation.json predates the runs' retrieval metrics"):
        readme_results.cell_values("both", "a", "retrieval:t/m")


def test_a_comparison_of_unvaried_cells_is_marked_not_tested(tmp_path, monkeypatch):
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)
    runs = [{"cell": cell, "final_t": 0.0, "zero_shot_top1": top1} for cell, top1 in
            [("a", 30.0), ("a", 50.0), ("b", 10.0), ("b", 20.0)]]  # t fixed at 0 in every run
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "ablation.json").write_text(json.dumps({"runs": runs}))
    table = readme_results.comparison_table({"source": "grid", "rows": [{"label": "a − b", "a": "a", "b": "b"}],
                                             "metrics": [{"metric": "zero_shot_top1", "label": "top-1"},
                                                         {"metric": "final_t", "label": "t", "digits": 2}]})
    assert "| a − b | +25.0 (" in table and "| +0.00 (no spread) |" in table and "nothing to test" in table


def test_a_comparison_table_marks_what_survives_holm_over_the_table(tmp_path, monkeypatch):
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)
    values = {"big": (100.0, 101.0, 102.0), "mid": (2.5, 3.5, 4.5), "base": (0.0, 1.0, 2.0)}
    runs = [{"cell": cell, "zero_shot_top1": v} for cell, vs in values.items() for v in vs]
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "ablation.json").write_text(json.dumps({"runs": runs}))
    rows = [{"label": f"{a} − {b}", "a": a, "b": b} for a, b in [("big", "base"), ("mid", "base"), ("base", "base")]]
    table = readme_results.comparison_table({"source": "grid", "rows": rows,
                                             "metrics": [{"metric": "zero_shot_top1", "label": "top-1"}]})
    # p = 2.7e-8, 0.0376 and 1 (Welch's t, df 4); Holm over 3: 8e-8, 2·0.0376 = 0.075, 1. Both of the first two
    # are bold (significant alone); only the first keeps its † (significant after the adjustment).
    assert "| big − base | **+100.0**† (" in table and "| mid − base | **+2.5** (" in table
    assert "over the table's 3 tests (1 of the 2 bold ones)" in table


def test_a_row_limited_to_some_metrics_leaves_the_others_out_of_holm(tmp_path, monkeypatch):
    """A primary endpoint tested in its own table is "—" in the secondaries' and not one of their Holm family."""
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)
    values = {"big": (100.0, 101.0, 102.0), "mid": (2.5, 3.5, 4.5), "base": (0.0, 1.0, 2.0)}
    runs = [{"cell": cell, "zero_shot_top1": v, "i2t_r1": v} for cell, vs in values.items() for v in vs]
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "ablation.json").write_text(json.dumps({"runs": runs}))
    metrics = [{"metric": "zero_shot_top1", "label": "top-1"}, {"metric": "i2t_r1", "label": "I2T R@1"}]
    rows = [{"label": "big − base", "a": "big", "b": "base", "metrics": ["i2t_r1"]},
            {"label": "mid − base", "a": "mid", "b": "base"}]
    table = readme_results.comparison_table({"source": "grid", "rows": rows, "metrics": metrics})
    # Three tests, not four: p = 2.7e-8 (big, I2T), 0.0376 twice (mid); Holm: 8e-8, 2 · 0.0376 = 0.075, 0.075.
    assert "| big − base | — | **+100.0**† (" in table and "over the table's 3 tests (1 of the 3 bold ones)" in table
    assert "\"—\": not a test of this table." in table
    with pytest.raises(ValueError, match="not among the table's"):
        readme_results.comparison_table({"source": "grid", "metrics": metrics,
                                         "rows": [{**rows[0], "metrics": ["zero_shot"]}]})


def test_a_bimodal_metric_gets_its_seeds_and_the_exact_permutation_test(tmp_path, monkeypatch):
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)
    values = {"a": (60.0, 0.0, 61.0), "b": (1.0, 0.5, 0.0)}  # a learns the held-out pair in two of three seeds
    runs = [{"cell": cell, "zero_shot_top1": v} for cell, vs in values.items() for v in vs]
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "ablation.json").write_text(json.dumps({"runs": runs}))
    table = readme_results.comparison_table({"source": "grid", "rows": [{"label": "a − b", "a": "a", "b": "b"}],
                                             "metrics": [{"metric": "zero_shot_top1", "label": "held-out",
                                                          "permutation": True}]})
    # Of the C(6, 3) = 20 labellings, those putting 60 and 61 together with any one of the 4 others (4) and their
    # mirrors (4) are as extreme as the observed one: p = 8/20.
    assert "held-out, a − b, seed by seed: a = 60.0, 0.0, 61.0; b = 1.0, 0.5, 0.0; exact permutation test" in table
    assert table.endswith(f"{readme_results.format_p(0.4)}.")


def test_experts_and_equilibrium_tables_average_over_runs():
    def experts(k1, k2):
        return {"draws": 10, "size": 500, "mode": "distance",
                "sets": {"shape": {"classes": 8, "subsets": [{"k": 1, "mean": k1}, {"k": 2, "mean": k2}]}}}

    table = readme_results.experts_table([experts(30.0, 80.0), experts(40.0, 80.0)])
    assert "| shape | 12.5 | 35.0 ± 7.1 | 80.0 ± 0.0 |" in table

    def equilibrium(learned, best):
        return {"file": f"multi-seed-{learned}", "topology": "ps-inner", "model_scale": learned, "draws": 8,
                "scales": [1.0, 10.0],
                "curves": [{"batch_size": 128, "fraction": 0.0, "best_scale": best},
                           {"batch_size": 128, "fraction": 0.5, "best_scale": 1.0},
                           {"batch_size": 32, "fraction": 0.0, "best_scale": 99.0}]}

    table = readme_results.equilibrium_table([equilibrium(9.0, 10.0), equilibrium(11.0, 10.0)])
    assert "| multi | ps-inner | 2 | 10.0 ± 1.4 | 10.0 ± 0.0 | 1.0 ± 0.0 |" in table
    assert table.startswith("Batches of 128 built-in test pairs")  # files from before `--split` are the test split's
    trained_on = readme_results.equilibrium_table([{**equilibrium(9.0, 10.0), "split": "train"}])
    assert trained_on.startswith("Batches of 128 built-in training pairs")


@pytest.mark.slow
def test_the_false_negatives_file_is_what_the_script_computes(monkeypatch, capsys):
    committed = json.loads((ROOT / "docs" / "results" / "false-negatives.json").read_text())
    spec = importlib.util.spec_from_file_location("false_negatives", ROOT / "scripts" / "false_negatives.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr("sys.argv", ["false_negatives.py", "--preset", committed["preset"], "--batches",
                                     str(committed["batches"]), "--batch-size", str(committed["batch_size"]),
                                     "--seed", str(committed["seed"])])
    script.main()
    # Counting and means of booleans over the same seeded batches: the same floats on any machine.
    assert json.loads(capsys.readouterr().out) == committed


def test_no_committed_result_names_a_machine_path():
    """Failed on main: equilibrium-4800's files named the checkpoint at /work/exp/…, and the 2,400-step grids'
    table.md their command's --out /work/exp/sweep/… (the report writes X/…)."""
    machine_path = re.compile(r'(?:^|[\s"`(=])(?:/work|/home|/Users|/mnt|/data|/srv|/tmp)/', re.MULTILINE)
    results = ROOT / "docs" / "results"
    offenders = [str(path.relative_to(ROOT)) for path in sorted([*results.rglob("*.json"), *results.rglob("*.md")])
                 if machine_path.search(path.read_text(encoding="utf-8"))]
    assert offenders == []


def test_no_comparison_spec_asks_the_same_comparison_twice():
    """Failed on main: table3-lr1e-3-4800-tests.json listed six of its rows twice, so the report printed them twice."""
    repeated = {}
    for path in sorted((ROOT / "docs" / "results").glob("*-tests.json")):
        rows = json.loads(path.read_text(encoding="utf-8"))["rows"]
        keys = [json.dumps([row["a"], row["b"]]) for row in rows]
        labels = [row["label"] for row in rows]
        if len(set(keys)) < len(keys) or len(set(labels)) < len(labels):
            repeated[path.name] = len(keys) - len(set(keys))
    assert repeated == {}


@pytest.mark.slow
def test_final_validation_is_the_trainers_own_evaluation_at_the_last_step(tmp_path, capsys):
    """scripts/final_validation.py gives a run trained before the trainer validated at the last step what the trainer
    now logs there: the same sets, code and weights."""
    import torch

    from topoclip.config import load_config
    from topoclip.run.training.logger import read_metrics
    from topoclip.run.training.trainer import train

    spec = importlib.util.spec_from_file_location("final_validation", ROOT / "scripts" / "final_validation.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    run = train(load_config("tiny", ["train.steps=4", "train.eval_every=2", "train.threads=1", "train.num_workers=0",
                                     "evaluate.size=16", "evaluate.validation_size=16", "data.scenes.train_size=256"]),
                out_dir=tmp_path / "runs" / "cell" / "seed-0", progress=False)
    logged = [r for r in read_metrics(run / "metrics.jsonl") if "eval" in r and not r.get("final")]
    assert [r["step"] for r in logged] == [2, 4]  # the schedule's end is validated too
    capsys.readouterr()  # the run's own summary
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the run evaluated: one thread, the same float sums, so the same ranks
    try:
        script.main(str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    (measured,) = json.loads(capsys.readouterr().out)["runs"]
    assert (measured["cell"], measured["seed"], measured["step"]) == ("cell", 0, 4)
    assert measured["eval"] == logged[-1]["eval"]


def test_the_late_rise_counts_each_run_once_in_its_largest_cell(tmp_path, monkeypatch):
    """τ's late rise over the long cells: three seeds that another grid extended to five (`--reuse` and two new
    seeds) count once, as the five; a cell copied whole counts where it was trained."""
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)

    def run(cell, seed, rise, reused_from=None):
        return {"cell": cell, "seed": seed, "run_dir": f"runs/{cell}/seed-{seed}", "reused_from": reused_from,
                "curve": {"steps": [2400, 7200, 9600], "scale": [10.0, 10.0, 10.0 + rise]}}
    grids = {"lr": [run("a", seed, 1.0 + 0.1 * seed) for seed in range(3)],
             "extended": [run("b", seed, 1.0 + 0.1 * seed, f"../lr/runs/a/seed-{seed}") for seed in range(3)]
             + [run("b", seed, 1.0 + 0.1 * seed) for seed in (3, 4)],
             "copy": [run("c", seed, 1.0 + 0.1 * seed, f"../lr/runs/a/seed-{seed}") for seed in range(3)],
             "short": [run("d", seed, 1.0) for seed in range(3)]}
    for name, runs in grids.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "ablation.json").write_text(json.dumps({"steps": 4800 if name == "short" else 9600, "runs": runs}))
    (row,) = readme_results.tau_late_rise()  # lr's a and copy's c are runs of extended's b; short is not long
    assert (row["grid"], row["cell"], row["n"]) == ("extended", "b", 5)
    assert row["change"] == pytest.approx(1.2)
    shutil.rmtree(tmp_path / "extended")
    (row,) = readme_results.tau_late_rise()  # the same three runs in two grids: where they were trained
    assert (row["grid"], row["cell"], row["n"]) == ("lr", "a", 3)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the benchmark reads /proc")
def test_the_csv_rows_benchmark_writes_the_file_the_readme_table_is_drawn_from(tmp_path):
    out = tmp_path / "csv-rows.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "csv_rows.py"), "--rows", "2000", "--workers", "1",
                    "--out", str(out)], check=True, capture_output=True, timeout=120)
    result = json.loads(out.read_text())
    strings, packed = result["results"]
    assert packed["in-process MiB"] < strings["in-process MiB"]  # 2,000 rows: ~0.5 MiB of str objects, ~0.2 packed
    assert packed["peak while reading MiB"] < strings["peak while reading MiB"]  # never held as strings
    table = readme_results.csv_rows_table(result).splitlines()
    assert table[0].startswith("Measured: `python benchmarks/csv_rows.py --rows 2000 --workers 1` (2,000 rows)")
    assert [line.split(" | ")[0] for line in table[4:]] == ["| list of str tuples", "| PackedRows"]


@pytest.mark.slow
def test_the_lora_benchmark_writes_the_file_the_docs_table_is_drawn_from(tmp_path):
    """benchmarks/lora.py at a few steps and two seeds: both arms trained in processes of their own at each seed, the
    means and the paired LoRA − full drawn from the seeds' own figures, and the table drawn."""
    pytest.importorskip("peft")
    out = tmp_path / "lora.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lora.py"), "--pretrain-steps", "20", "--steps", "10",
                    "--rows", "80", "--batch", "16", "--seeds", "2", "--count-presets", "tiny", "--quiet-machine", "no",
                    "--out", str(out)], check=True, capture_output=True, timeout=900)
    result = json.loads(out.read_text())
    full, lora = result["arms"]["full"], result["arms"]["lora"]
    assert 0 < lora["trainable"] < full["trainable"] and full["peak_mib"] > 0 and lora["images_per_s"] > 0
    assert [run["seed"] for run in result["runs"]] == [0, 1]
    for key in ("retained", "learnt"):  # the means and the paired difference are the seeds' own figures
        by_arm = {arm: [run["arms"][arm][key] for run in result["runs"]] for arm in ("full", "lora")}
        assert result["arms"]["lora"][key] == round(sum(by_arm["lora"]) / 2, 2)
        expected = statistics.paired(by_arm["lora"], by_arm["full"])
        assert result["lora_minus_full"][key] == expected.as_dict()
    table = readme_results.lora_table(result).splitlines()
    assert table[0].startswith("Measured: `python benchmarks/lora.py --pretrain-steps 20") and "busy machine" in table[0]
    assert "Each of 2 seeds (from 0)" in table[0]
    assert [line.split(" | ")[0] for line in table[4:7]] == ["| pretrained", "| full fine-tuning, lr 0.0001",
                                                             "| LoRA rank 8, lr 0.001"]
    assert " ± " in table[5] and table[8].startswith("LoRA − full fine-tuning, paired over the seeds: retained ")
    (tiny,) = result["counted"]  # the trainer's count of the same model, and the state: 4 fp32 numbers a trained weight
    assert (tiny["weights"], tiny["lora_trainable"]) == (full["trainable"], lora["trainable"])
    assert tiny["full_state_mib"] == round(16 * tiny["weights"] / 2**20, 1) and table[-1].startswith("| `tiny` |")
    one_seed = {key: value for key, value in result.items() if key not in ("sd", "lora_minus_full")}
    one_seed["settings"] = {**result["settings"], "seeds": 1}
    assert "One seed." in readme_results.lora_table(one_seed) and " ± " not in readme_results.lora_table(one_seed)


def test_the_hyperbolic_gpu_table_sets_each_step_against_its_twin_of_the_same_mode():
    """docs/results/gpu-hyperbolic.json's table: a hyperbolic row's cost is against its preset's own topology timed the
    same way (eager against eager, compiled against compiled); a mode not timed says so."""
    def step(preset, compiled, images, topology=None):
        overrides = [f"model.topology={topology}", "train.entailment_weight=0.2"] if topology else []
        return {"preset": preset, "overrides": overrides, "compile": "default" if compiled else False, "batch": 256,
                "precision": "bf16",
                "median_images_per_s": images, "rounds_images_per_s": [images - 10, images, images + 5]}

    result = {"gpu": "a GPU", "machine": "a machine", "torch": "2.x", "date": "2026-11-28 15:15:58 UTC",
              "steps": [step("sphere-vit-b16", False, 2000.0), step("multi-32x16-vit-b16", False, 1800.0),
                        step("sphere-vit-b16", False, 1900.0, "lorentz"), step("sphere-vit-b16", True, 3000.0),
                        step("sphere-vit-b16", True, 2400.0, "lorentz"),
                        step("multi-32x16-vit-b16", False, 1710.0, "lorentz-product")]}
    table = readme_results.gpu_hyperbolic_table(result).splitlines()
    assert ", 2026-11-28: " in table[0]
    rows = table[4:]
    assert rows == ["| `sphere-vit-b16` | as the preset | 2,000 (1,990–2,005) | 3,000 (2,990–3,005) |",
                    "| `sphere-vit-b16` | `lorentz` | 1,900 (1,890–1,905), -5.0% | 2,400 (2,390–2,405), -20.0% |",
                    "| `multi-32x16-vit-b16` | as the preset | 1,800 (1,790–1,805) | not timed |",
                    "| `multi-32x16-vit-b16` | `lorentz-product` | 1,710 (1,700–1,715), -5.0% | not timed |"]
    later = [{**step("multi-32x16-vit-b16", True, 2500.0), "date": "2026-11-30 18:43 UTC"},
             {**step("multi-32x16-vit-b16", True, 2250.0, "lorentz-product"), "date": "2026-11-30 18:43 UTC"}]
    table = readme_results.gpu_hyperbolic_table({**result, "steps": result["steps"] + later}).splitlines()
    assert ", 2026-11-28 or 2026-11-30: " in table[0]  # a later lease's steps say so
    assert table[-1] == "| `multi-32x16-vit-b16` | `lorentz-product` | 1,710 (1,700–1,715), -5.0% | 2,250 (2,240–2,255), -10.0% |"


def test_the_gpu_feeding_table_says_each_rows_epochs_and_lease():
    """docs/results/gpu-feeding.json's shards-against-random rows: a row from before the field (32-batch epochs, the
    workers started again each), a steady-state row (an epoch longer than every step it times) and 32-batch epochs with
    the workers kept, each with its lease."""
    row = {"batch": 256, "steps": 30, "rounds": 3, "num_workers": 8, "batches_in_flight": 8, "threads": 16,
           "random_images_per_s": 3000.0, "shards_images_per_s": 2000.0, "shard_to_random": 0.667,
           "ratio_range": [0.66, 0.67], "cpu_count": 16, "preset": "sphere-vit-b16"}
    later = "2026-11-30 18:39 UTC (another machine)"
    result = {"gpu": "a GPU", "torch": "2.x", "date": "2026-11-28 00:00:37 UTC", "nccl": {}, "profiles": [],
              "fsdp_memory": [{"batch": 64, "parallelism": "ddp", "per_rank": [{"peak_device": 2**30}]}],
              "loader": {"command": "loader.py", "batch": 256, "rows": [], "cut": "none cut"},
              "shards_vs_random": [row, {**row, "samples_per_epoch": 10**8, "workers_kept": True, "lease": later},
                                   {**row, "samples_per_epoch": 8192, "workers_kept": True, "lease": later}]}
    lines = readme_results.gpu_feeding_table(result).splitlines()
    assert [line.split(" | ")[:2] for line in lines[4:7]] == [
        ["| 2026-11-28 00:00", "32 batches, workers started again"], ["| 2026-11-30 18:39", "longer than the run"],
        ["| 2026-11-30 18:39", "32 batches, workers kept"]]
    assert "- The lease of 2026-11-30 18:39: another machine." in lines
    # A lease recorded in another form is said as it is, not lost or misparsed.
    assert lease_note("2026-11-30 18:39:12 UTC (code of (abc))") == (
        "- The lease of 2026-11-30 18:39: code of (abc).")
    assert lease_note("the second lease") == "- A lease: the second lease."


@pytest.mark.slow
def test_the_loader_benchmark_writes_the_file_the_readme_table_is_drawn_from(tmp_path):
    """benchmarks/loader.py on a few small pictures, one worker, one round: the results file's shape, and its table."""
    out = tmp_path / "loader.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loader.py"), "--sizes", "64", "--samples", "32",
                    "--batch", "8", "--batches", "2", "--rounds", "1", "--workers", "1", "--image-size", "32",
                    "--unpinned", "--shards", str(tmp_path / "shards"), "--note", "a test", "--out", str(out)],
                   check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    entry = result["sizes"]["64"]
    assert entry["paths"]["topoclip"]["batch_dtype"] == "uint8" and entry["paths"]["topoclip"]["per_worker"] > 0
    for path in ("topoclip", "topoclip-unpinned"):  # the taking and the normalisation timed apart from the rate
        assert entry["paths"][path]["device_ms_per_batch"] > 0 and entry["paths"][path]["main_ms_per_batch"] > 0
    assert not entry["paths"]["topoclip-unpinned"]["pinned"]
    assert len(list((tmp_path / "shards" / "64").glob("*.tar"))) == 1  # 32 pictures: one shard of 128
    assert not list((tmp_path / "shards" / "64").glob("*.partial"))  # each shard renamed whole into place
    stats = json.loads((tmp_path / "shards" / "64" / "bits_per_pixel.json").read_text())
    assert (stats["samples"], stats["per_shard"]) == (32, 128)  # reused only for the same layout
    assert 1.5 < entry["bits_per_pixel"] < 8  # photo-like: JPEG q90 of photos spends 2–4 bits a pixel
    table = readme_results.loader_table(result).splitlines()
    assert table[0].startswith("Measured: `python benchmarks/loader.py --sizes 64") and "a test" in table[0]
    assert table[4].startswith("| 64 px (")


def test_docs_results_stays_under_ten_megabytes():
    """Issue #60: docs/results was 18 MB; its per-run files are packed (`topoclip report pack`)."""
    total = sum(path.stat().st_size for path in (ROOT / "docs" / "results").rglob("*") if path.is_file())
    assert total <= 10_000_000, f"{total:,} bytes: run `topoclip report pack`"


def test_a_packed_results_file_reads_as_its_json(tmp_path, monkeypatch):
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path / "results")
    results = {"analysis": "ablation", "steps": 10, "runs": [{"cell": "a", "seed": 0}],
               "command": "topoclip ablate --grid g --out X/grid"}
    (tmp_path / "results" / "grid").mkdir(parents=True)
    (tmp_path / "results" / "grid" / "ablation.json").write_text(json.dumps(results))
    (tmp_path / "results" / "analysis").mkdir()
    (tmp_path / "results" / "analysis" / "run-0.json").write_text(json.dumps({"value": 1}))
    before = readme_results.load_result("grid"), readme_results.load_result("analysis")
    assert sorted(path.name for path in readme_results.pack(tmp_path / "results")) == ["ablation.json.gz", "run-0.json.gz"]
    assert not list((tmp_path / "results").glob("*/*.json"))
    assert (readme_results.load_result("grid"), readme_results.load_result("analysis")) == before
    out = tmp_path / "sweep" / "grid"
    out.mkdir(parents=True)
    (out / "ablation.json").write_text(json.dumps(results))
    assert readme_results.land(out).name == "ablation.json.gz"  # the same results: nothing to land
    (tmp_path / "results" / "pool.json").write_text(json.dumps({"parts": []}))  # a pool that lost it (a landing undone)
    assert readme_results.land(out, pool="pool").name == "ablation.json.gz"  # the same results, listed again
    assert json.loads((tmp_path / "results" / "pool.json").read_text())["parts"] == ["grid"]
    (tmp_path / "results" / "pool.json").unlink()
    (out / "ablation.json").write_text(json.dumps({**results, "steps": 20}))
    with pytest.raises(ValueError, match="holds other results"):
        readme_results.land(out)
    assert readme_results.load_result("grid") == before[0]
    assert readme_results.land(out, replace=True).name == "ablation.json"
    assert readme_results.load_result("grid")["steps"] == 20 and not (tmp_path / "results" / "grid" / "ablation.json.gz").exists()
