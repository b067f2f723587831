"""scripts/issue61.py: its queue is the runs the pre-registrations name, one to a part, each pool's parts one recipe
(so that landing them never refuses one), stage 2 only once its specs exist, every part's estimate computable; its
loop lands every part in a commit of its own, and stage 2 only after its specs are committed."""
import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

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


def test_a_begun_part_is_estimated_from_its_newest_checkpoint(tmp_path):
    part = issue61.queue(prefer_sweep=False)[0]
    assert part.trained(tmp_path) == part.trained(None) == 0
    checkpoints = tmp_path / part.name / "runs" / part.cell / f"seed-{part.seed}" / "checkpoints"
    for name in ("step-000600", f"step-{part.steps // 4:06d}", "step-000400.tmp", "latest"):
        (checkpoints / name).mkdir(parents=True)
    assert part.trained(tmp_path) == part.steps // 4
    assert part.estimate(1, tmp_path) == pytest.approx(0.75 * part.estimate(1))
    (checkpoints / f"step-{part.steps:06d}").mkdir()
    assert part.estimate(2, tmp_path) == 0  # trained: its ablate only reports it


def test_what_starts_fits_first_and_a_carried_over_run_only_fills_an_idle_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(issue61, "committed_json", lambda path: {})  # HEAD before stage 2's specs, whatever it holds
    order = issue61.queue(prefer_sweep=False)
    stage_1, sweep = order[:18], order[18:]
    hour = 3600

    def choose(free, idle, left, carry, busy=()):
        return [(part.name, threads, carried)
                for part, threads, carried in issue61.choose(order, set(busy), free, idle, left, 2, tmp_path, carry)]

    # A long sitting: stage 1's first two, one thread each; carrying over changes nothing.
    assert choose(2, 2, 10 * hour, False) == choose(2, 2, 10 * hour, True) == [(p.name, 1, False) for p in stage_1[:2]]
    # A part begun in the working folder goes first.
    (tmp_path / stage_1[5].name).mkdir()
    assert choose(1, 1, 10 * hour, False) == [(stage_1[5].name, 1, False)]
    # Near the deadline nothing fits: none starts, or, carried over, the next parts on one idle thread each, the begun
    # one first.
    assert choose(2, 2, 60, False) == []
    assert choose(2, 2, 60, True) == [(stage_1[5].name, 1, True), (stage_1[0].name, 1, True)]
    assert choose(2, 1, 60, True) == [(stage_1[5].name, 1, True)] and choose(2, 0, 60, True) == []
    # Stage 1 done and about 4 h left: the sweep's runs fit only on two threads. With one thread free the first waits
    # for the second, and a carried run may fill the idle one: it does not count against a run that ends in time,
    # which starts on both threads, carried runs on them or not.
    left, done = min(p.estimate(1) for p in sweep) - 1, [p.name for p in stage_1]
    assert all(p.estimate(2) <= left for p in sweep)
    assert choose(1, 1, left, False, done) == []
    assert choose(1, 1, 10, True, done) == [(sweep[0].name, 1, True)]
    assert choose(2, 0, left, True, done) == choose(2, 2, left, True, done) == [(sweep[0].name, 2, False)]


def test_the_pace_is_the_slowest_run_in_flight_and_scales_what_fits(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(issue61, "committed_json", lambda path: {})
    order = issue61.queue(prefer_sweep=False)
    lorentz, product = order[0], next(p for p in order if p.cell.startswith("lorentz-product_"))
    for part in (lorentz, product):
        assert part.logged(tmp_path) == 0  # no metrics yet
        run = tmp_path / part.name / "runs" / part.cell / f"seed-{part.seed}"
        run.mkdir(parents=True)
        lines = [json.dumps({"step": step, "loss": 1.0, "pad": "x" * 200}) for step in range(20, 2001, 20)]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 2020, "lo')  # > 4 KiB, last line cut
        assert part.logged(tmp_path) == 2000
    now = time.time()
    seconds = lorentz.seconds(1, 2000 - 400)  # the constants' time for the 1,600 steps logged since its start
    running = {lorentz.name: (lorentz, None, 1, False, now - 0.4 * seconds, 400),
               product.name: (product, None, 1, False, now - 0.3 * product.seconds(1, 2000 - 1800), 1800)}
    # The product run has logged only 200 steps since it started: not yet a measure; the lorentz run's is 0.4 (rel
    # 1e-3: the wall time between `now` and the call, milliseconds, over `seconds`, hundreds of seconds).
    assert issue61.measured_pace(running, tmp_path, 1.0) == pytest.approx(0.4, rel=1e-3)
    running[product.name] = (product, None, 2, False, now - 0.9 * product.seconds(2, 1600), 400)
    assert issue61.measured_pace(running, tmp_path, 1.0) == pytest.approx(0.9, rel=1e-3)  # the slowest
    del running[product.name]
    running[lorentz.name] = (lorentz, None, 1, True, now - 0.4 * seconds, 400)  # a carried run is no measure
    assert issue61.measured_pace(running, tmp_path, 0.7) == 0.7 == issue61.measured_pace({}, tmp_path, 0.7)
    # A sweep part that only two threads end in time at the constants' pace ends in time on one at 0.5 of it.
    sweep = order[18]
    left = sweep.estimate(2) + 1
    assert [(p.name, n) for p, n, _ in issue61.choose([sweep], set(), 2, 2, left, 2, tmp_path, False)] == [
        (sweep.name, 2)]
    assert [(p.name, n) for p, n, _ in issue61.choose([sweep], set(), 2, 2, left, 2, tmp_path, False, 0.5)] == [
        (sweep.name, 1)]
    assert issue61.choose([sweep], set(), 2, 2, left, 2, tmp_path, False, 1.5) == []


FAKE_ABLATE = '''
import json, pathlib, sys
grid, cell, seed, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), pathlib.Path(sys.argv[5])
with open(out.parent / "trained.txt", "a") as trained:
    print(out.name, file=trained)
if (cell, seed) == ("lorentz_lr-2e-3", 1) and not (out.parent / "failed-once").exists():
    (out.parent / "failed-once").touch()
    sys.exit(1)  # the first sitting: this run fails (its ablate exits 1)
value = 50.0 + seed + (5.0 if "_lr-1e-3" in cell else 0.0)
run = {"cell": cell, "seed": seed, "run_dir": f"runs/{cell}/seed-{seed}", "learnable": True, "final_t": 2.0,
       "skipped_steps": 0, "evaluations": [{"step": steps, "scenes-val/mean_recall": value}],
       "headline": {"scenes-test/mean_recall": value}, "curve": {"steps": [steps], "scale": [10.0], "curvature": [1.0]}}
out.mkdir(parents=True, exist_ok=True)
(out / "ablation.json").write_text(json.dumps({"analysis": "ablation", "grid": grid, "steps": steps, "preset": "p",
    "command": f"topoclip ablate --grid {grid} --steps {steps} --seeds 1 --first-seed {seed} --cells {cell} "
               f"--out X/{out.name}",
    "runs": [run]}))
'''


@pytest.mark.slow
def test_the_coordinator_lands_every_part_in_its_own_commit_and_stage_2_only_after_its_specs(tmp_path, monkeypatch):
    """issue61.py's loop over the whole queue with an instant fake `ablate`, in a git repository of its own: a run that
    fails is reported and not landed; a landing that fails once is undone and lands at the next poll; a second sitting
    trains what the first left, writes stage 2's specs and commits them before any stage-2 part; HEAD holds every
    part, each with its pool entry, and the tree is clean. A sitting too short for any run starts none, unless
    told to carry runs over into a later one."""
    import subprocess
    import sys
    import time
    from datetime import datetime, timezone

    from topoclip.experiments.results import files

    root, work = tmp_path / "repo", tmp_path / "work"
    results = root / "docs" / "results"
    results.mkdir(parents=True)
    for pool in ("lorentz-lr-9600", "lorentz-19200", "tau-range-full-scenes-38400"):
        (results / f"{pool}.json").write_text(json.dumps({"about": "A.", "seeds": 5 if "lr-9600" not in pool else 3,
                                                          "parts": []}))
    (tmp_path / "fake.py").write_text(FAKE_ABLATE)
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "start"], check=True)
    monkeypatch.setenv("GIT_AUTHOR_NAME", "t"), monkeypatch.setenv("GIT_AUTHOR_EMAIL", "t@t")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "t"), monkeypatch.setenv("GIT_COMMITTER_EMAIL", "t@t")
    for module in (issue61, files, lorentz_specs):
        monkeypatch.setattr(module, "RESULTS", results)
    monkeypatch.setattr(issue61, "ROOT", root)
    monkeypatch.setattr(issue61, "POLL_S", 0)
    monkeypatch.setattr(issue61, "pinned", lambda pin: "")
    monkeypatch.setattr(issue61.Part, "command", lambda self, work: [
        sys.executable, str(tmp_path / "fake.py"), self.grid, self.cell, str(self.seed), str(self.steps),
        str(work / self.name)])
    packs, pack = [], files.pack

    def pack_failing_once(folder):
        packs.append(folder)
        if len(packs) == 3:
            raise OSError("disk full")  # the third landing fails half-way: undone, tried again, not retrained
        return pack(folder)

    monkeypatch.setattr(issue61.files, "pack", pack_failing_once)
    real_step = issue61.step

    def step(command, **options):  # the pinned analysis, the specs script and `report write`, in this process
        if "hierarchy" in command:
            out = Path(command[command.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "hierarchy.json").write_text(json.dumps({"checkpoint": str(work / "x" / "checkpoints"), "size": 1}))
            return True
        if command[-1].endswith("lorentz_specs.py"):
            return lorentz_specs.main() == 0
        return True if command[-2:] == ["report", "write"] else real_step(command, **options)

    monkeypatch.setattr(issue61, "step", step)
    until = "2100-01-01T00:00"
    soon = datetime.fromtimestamp(time.time() + issue61.MARGIN_S + 120, timezone.utc).isoformat()  # no run fits
    assert issue61.main(["--work", str(work), "--pin", str(tmp_path), "--until", soon]) == 0
    assert issue61.main(["--work", str(work), "--pin", str(tmp_path), "--until", "2000-01-01", "--carry-over"]) == 0
    assert not (work / "trained.txt").exists()  # no run ends in time: none starts, nor, past --until, a carried one
    assert issue61.main(["--work", str(work), "--pin", str(tmp_path), "--until", until]) == 1  # one run failed
    assert len(packs) > 3 and not issue61.specs_committed()  # stage 1 is not whole: no specs, no stage 2
    # The next sitting, too short for any run: carried over, each still trains (here at once) and lands.
    assert issue61.main(["--work", str(work), "--pin", str(tmp_path), "--until", soon, "--carry-over"]) == 0
    order = [p.name for p in issue61.queue(False)]
    assert len(order) == 48 and all(p.committed() for p in issue61.queue(False))
    trained = Counter((work / "trained.txt").read_text().split())  # each part once, the failed one again
    assert trained == {name: 1 + (name == "lorentz-lr-9600-lorentz_lr-2e-3-seed1") for name in order}
    log = subprocess.run([*git, "log", "--format=%s", "--reverse"], capture_output=True, text=True).stdout.splitlines()
    specs = log.index("#61: stage 1 whole; the rule's lrs written into stage 2's specs before any stage-2 run")
    assert all(line.startswith("#61: lorentz-19200-") for line in log[specs + 1:]) and len(log[specs + 1:]) == 20
    landed = sorted(line for line in log if line not in ("start", log[specs]))
    assert landed == sorted(f"#61: {name} landed" for name in order)  # one commit each
    chosen = json.loads((results / "lorentz-19200-tests.json").read_text())["rows"][0]["a"]
    assert chosen == "lorentz_lr-1e-3"  # the fake's best lr, by the pre-registered rule
    hierarchy = subprocess.run([*git, "ls-files", "docs/results/lorentz-hierarchy-19200"], capture_output=True,
                               text=True).stdout.split()
    assert len(hierarchy) == 20 and all(name.endswith(".json.gz") for name in hierarchy)
    assert subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout == ""


def test_a_second_coordinator_on_the_same_checkout_is_refused(tmp_path, capsys, monkeypatch):
    import subprocess
    import sys

    from topoclip.experiments.results import files

    (tmp_path / ".git").mkdir()
    monkeypatch.setattr(issue61, "ROOT", tmp_path)
    monkeypatch.setattr(issue61, "pinned", lambda pin: "")
    monkeypatch.setattr(issue61, "RESULTS", files.RESULTS)  # (the checks before this one pass)
    monkeypatch.setattr(issue61, "coordinate", lambda args, deadline: 0)  # what the one that holds the lock does
    holds = "import fcntl, sys; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); print(flush=True); input()"
    other = subprocess.Popen([sys.executable, "-c", holds, str(tmp_path / ".git" / "issue61.lock")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    argv = ["--work", str(tmp_path / "work"), "--pin", str(tmp_path), "--until", "2000-01-01"]
    try:
        other.stdout.readline()  # it holds the lock
        assert issue61.main(argv) == 2
        assert "another coordinator lands into" in capsys.readouterr().err
    finally:
        other.kill()
        other.wait()
    assert issue61.main(argv) == 0  # the lock died with its process
