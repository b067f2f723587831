"""The README's figures are generated from docs/results/*.json (scripts/readme_results.py)."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("readme_results", ROOT / "scripts" / "readme_results.py")
readme_results = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme_results)


def test_the_readme_figures_equal_the_committed_results_files():
    readme = (ROOT / "README.md").read_text()
    assert "<!-- results:default-run -->" in readme and "<!-- results:compare -->" in readme
    assert readme_results.render_blocks(readme) == readme, "run: python scripts/readme_results.py write"


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


@pytest.mark.parametrize("name", sorted(readme_results.RENDERERS))
def test_each_generated_block_has_a_results_file(name):
    assert (ROOT / "docs" / "results" / f"{name}.json").is_file()
