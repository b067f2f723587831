"""scripts/lorentz_specs.py (issue #61): the specs stage 1's rule writes before stage 2 is read are specs the report
draws (the tests the pre-registration names, the Holm family it names), and a spec once written is never changed."""
import importlib.util
import json
from pathlib import Path

import pytest

import topoclip.experiments.results as readme_results

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("lorentz_specs", ROOT / "scripts" / "lorentz_specs.py")
lorentz_specs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lorentz_specs)

HEADLINE = ("scenes-test/mean_recall", "scenes-test-ood/mean_recall", "composition-held-out/distance/top1")


def run(cell: str, seed: int, level: float) -> dict:
    """An ablation record of the fields the specs' tables read, its metrics `level` give or take the seed."""
    return {"cell": cell, "seed": seed, "final_t": 2.0, "skipped_steps": 0,
            "headline": {key: level + seed for key in HEADLINE},
            "curve": {"scale": [10.0, 20.0 + seed], "curvature": [1.0, 0.9]}}


def grid(folder: Path, cells: dict[str, float], seeds: int) -> None:
    folder.mkdir()
    runs = [run(cell, seed, level) for cell, level in cells.items() for seed in range(seeds)]
    (folder / "ablation.json").write_text(json.dumps({"analysis": "ablation", "steps": 19200, "seeds": seeds,
                                                      "runs": runs}))


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(readme_results.files, "RESULTS", tmp_path)
    monkeypatch.setattr(lorentz_specs, "RESULTS", tmp_path)
    grid(tmp_path / "lorentz-lr-9600", {f"{family}_lr-{lr}": 50.0 for family in ("lorentz", "lorentz-product")
                                        for lr in ("5e-4", "1e-3", "2e-3")}, 3)
    stage_1 = json.loads((tmp_path / "lorentz-lr-9600" / "ablation.json").read_text())
    diverged = [r for r in stage_1["runs"] if r["cell"] == "lorentz_lr-2e-3"]  # every seed stopped: still a row
    stage_1["runs"] = [r for r in stage_1["runs"] if r not in diverged]
    stage_1["stopped"] = [{"cell": r["cell"], "seed": r["seed"], "reason": "non-finite loss"} for r in diverged]
    (tmp_path / "lorentz-lr-9600" / "ablation.json").write_text(json.dumps(stage_1))
    grid(tmp_path / "lorentz-19200", {"lorentz_lr-1e-3": 60.0, "lorentz-entail_lr-1e-3": 61.0,
                                      "lorentz-product_lr-2e-3": 70.0, "lorentz-product-entail_lr-2e-3": 70.5}, 5)
    grid(tmp_path / "tau-range-full-scenes-19200", {"sphere-default-t": 59.0, "multi-default-t": 72.0}, 5)
    for precision in ("fp32", "bf16", "fp16"):
        for cell in ("lorentz_lr-1e-3", "lorentz-product_lr-2e-3"):
            grid(tmp_path / f"lorentz-precision-{precision}-{cell.split('_lr-')[0]}", {cell: 55.0}, 1)
    return tmp_path


def test_the_specs_name_the_rules_cells_and_the_report_draws_them(results):
    written = lorentz_specs.specs("lorentz_lr-1e-3", "lorentz-product_lr-2e-3")
    primary = readme_results.equivalence_table(written["lorentz-19200-equivalence.json"])
    assert "| `lorentz` − sphere, test in-domain mean recall, 19,200 steps | 5, 5 | +1.0 (" in primary
    secondary = readme_results.comparison_table(written["lorentz-19200-tests.json"])
    # The pre-registered family: 3 comparisons × 3 metrics, and lorentz − sphere on 2 (its in-domain is the primary).
    assert "over the table's 11 tests" in secondary and "| `lorentz` − sphere | — | +1.0 (" in secondary
    assert "| entailment loss: `lorentz-product-entail` − `lorentz-product` | +0.5 (" in secondary
    stage_1 = readme_results.stability_table(written["lorentz-lr-9600-stability.json"])
    assert stage_1.count("| `lorentz") == 6 and "| `lorentz_lr-2e-3` | 0 (+ 3 stopped on non-finite values) |" in stage_1
    stage_2 = readme_results.stability_table(written["lorentz-19200-stability.json"])
    assert "| Multi (`multi-default-t`) | 5 |" in stage_2 and "| `lorentz-entail_lr-1e-3` | 5 |" in stage_2
    precision = readme_results.stability_table(written["lorentz-precision-stability.json"])
    assert "| `lorentz-product_lr-2e-3`, fp16 (GPU) | 1 |" in precision and "| `lorentz_lr-1e-3`, fp32 (stage 1, CPU) | 3 |" in precision


def test_a_written_spec_is_never_rewritten_with_other_content(results, monkeypatch, capsys):
    monkeypatch.setattr(lorentz_specs, "lr_choice", lambda _: {"lorentz": "lorentz_lr-1e-3",
                                                              "lorentz-product": "lorentz-product_lr-2e-3"})
    assert lorentz_specs.main() == 0 and (results / "lorentz-19200-tests.json").is_file()
    assert lorentz_specs.main() == 0  # the same rule, the same specs: nothing changes
    monkeypatch.setattr(lorentz_specs, "lr_choice", lambda _: {"lorentz": "lorentz_lr-5e-4",
                                                              "lorentz-product": "lorentz-product_lr-2e-3"})
    before = (results / "lorentz-19200-equivalence.json").read_text()
    assert lorentz_specs.main() == 1
    assert "a pre-registered spec is written once" in capsys.readouterr().err
    assert (results / "lorentz-19200-equivalence.json").read_text() == before


def test_the_specs_wait_for_every_run_of_stage_1(results, capsys):
    """Stage 1 trained in parts may be landed in part: the rule is not applied to a cell short of its seeds, nor to a
    grid missing a cell (a pool knows only the cells that have landed)."""
    stage_1 = json.loads((results / "lorentz-lr-9600" / "ablation.json").read_text())
    for missing in ([r for r in stage_1["runs"] if r["cell"] == "lorentz-product_lr-5e-4" and r["seed"] == 2],
                    [r for r in stage_1["runs"] if r["cell"] == "lorentz-product_lr-1e-3"]):
        (results / "lorentz-lr-9600" / "ablation.json").write_text(json.dumps(
            {**stage_1, "runs": [r for r in stage_1["runs"] if r not in missing]}))
        assert lorentz_specs.main() == 1
        assert "stage 1 is not whole yet" in capsys.readouterr().err and not (results / "lorentz-19200-tests.json").exists()
