"""scripts/issue61.py's queue: the runs the pre-registrations name, one to a part, each pool's parts one recipe (so
that landing them never refuses one), stage 2 only once its specs exist, and every part's estimate computable."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


issue61, lorentz_specs = load("issue61"), load("lorentz_specs")


def test_the_queue_is_the_pre_registered_runs_and_stage_2_waits_for_its_specs(tmp_path, monkeypatch):
    from topoclip.experiments.results.files import run_settings

    def committed_json(path: str) -> dict:  # HEAD's file, here tmp_path's
        file = tmp_path / Path(path).name
        return json.loads(file.read_text()) if file.exists() else {}

    monkeypatch.setattr(issue61, "committed_json", committed_json)
    parts = issue61.queue(prefer_sweep=False)
    stage_1 = [(p.cell, p.seed) for p in parts if p.pool == "lorentz-lr-9600"]
    assert sorted(stage_1) == sorted((cell, seed) for cell in lorentz_specs.STAGE_1_CELLS for seed in range(3))
    sweep = [(p.cell, p.seed, p.steps) for p in parts if p.pool == "tau-range-full-scenes-38400"]
    assert sorted(sweep) == sorted((c, s, 38400) for c in ("multi-default-t", "sphere-default-t") for s in range(5))
    assert [p.pool for p in parts] == ["lorentz-lr-9600"] * 18 + ["tau-range-full-scenes-38400"] * 10  # no stage 2 yet
    assert not any(p.committed() for p in parts)
    assert issue61.queue(prefer_sweep=True)[0].pool == "tau-range-full-scenes-38400"

    monkeypatch.setattr(lorentz_specs, "load_result", lambda name: {"runs": [], "stopped": []})
    tests = lorentz_specs.specs("lorentz_lr-1e-3", "lorentz-product_lr-2e-3")["lorentz-19200-tests.json"]
    (tmp_path / "lorentz-19200-tests.json").write_text(json.dumps(tests))  # what stage 1's rule would write
    parts = issue61.queue(prefer_sweep=False)
    stage_2 = sorted({p.cell for p in parts if p.pool == "lorentz-19200"})
    assert stage_2 == ["lorentz-entail_lr-1e-3", "lorentz-product-entail_lr-2e-3", "lorentz-product_lr-2e-3",
                       "lorentz_lr-1e-3"]
    assert len([p for p in parts if p.pool == "lorentz-19200"]) == 20
    pools: dict = {}
    for part in parts:
        assert 0 < part.estimate(2) < part.estimate(1)  # every cell's family has its measured step time
        command = "topoclip " + " ".join(part.command(Path("/w"))[3:])  # python -m topoclip ablate ...
        pools.setdefault(part.pool, set()).add(json.dumps(run_settings(command), sort_keys=True))
    assert all(len(recipes) == 1 for pool, recipes in pools.items() if pool)  # one recipe a pool: every part lands
