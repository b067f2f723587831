"""Issue #61's runs, one run to a part, each landed into docs/results and committed as it finishes: the 2-core
machine's working folder does not outlive a sitting, so a sitting's end loses at most the runs in flight. One
coordinator a sitting, started first thing:

    nohup python scripts/issue61.py --work /work/exp --hours 2.4 --train /work/pinvenv/bin/topoclip >> issue61.log 2>&1 &

It trains up to --cores runs at once (each an `ablate` of one run on one thread, or on two where one thread would not
end in time), starting only runs whose estimate ends inside --hours (leave the sitting's CI its cores): the parts
already begun in --work first, then the queue's grids in order, within one those that need two threads first. It lands each finished run itself, one at a time (`analyze hierarchy` where asked,
`report land --pool`, `report pack`, `report write`), and commits that part with the documents' blocks it changed, so
that HEAD only ever holds whole parts. --train: the `topoclip` that trains (a pinned clone's: the runs must not change
with the code under edit); landing and committing use this checkout. The queue, as the pre-registrations order it
(docs/results/preregistration-lorentz.md, preregistration-38400.md):

1. stage 1, `lorentz-lr-9600`: the lorentz family's lr grid, 9,600 steps, three seeds;
2. once stage 1 is committed whole, `scripts/lorentz_specs.py` (the rule's lrs into stage 2's specs), committed before
   any stage-2 run starts; then stage 2, `lorentz-19200`: the four cells at their family's lr, five seeds, 19,200 steps,
   each run's `analyze hierarchy --size 500` landed as docs/results/lorentz-hierarchy-19200/CELL-seed-K.json;
3. the convergence sweep, `tau-range-full-scenes-38400`: the full scenes' own-range cells, five seeds, 38,400 steps
   (first with --prefer sweep).
(The precision arm runs on a GPU task: bf16 and fp16 steps take 6 and 10 times fp32's on this CPU.)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from topoclip.experiments.results.files import read_results

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
LRS, FAMILIES = ("5e-4", "1e-3", "2e-3"), ("lorentz", "lorentz-product")
# Seconds a step takes on the 2-core development machine, one thread, the other core training too (measured: a
# lorentz stage-1 run 1,666-1,802 s, a product one 3,866 s at 9,600 steps; the full scenes' Multi ~4,300 s and the
# sphere ~3,500 s at 19,200 steps). A run's estimate is 1.15 times its steps' (a busy sitting); on two threads 0.75 of
# that (two one-thread runs made ~1.5 times the images of one two-thread run, stop 69).
SECONDS_PER_STEP = {"lorentz": 0.19, "lorentz-product": 0.40, "multi": 0.22, "sphere": 0.18}
BUSY, TWO_THREADS = 1.15, 0.75
MARGIN_S = 600  # a run must end this long before the deadline: its landing, hierarchy analysis and commit
POLL_S = 30


class Part:
    """One run of a pooled grid: `ablate --cells CELL --first-seed SEED --seeds 1 --out WORK/NAME`."""

    def __init__(self, name: str, grid: str, cell: str, seed: int, steps: int, pool: str, hierarchy: bool = False):
        self.name, self.grid, self.cell, self.seed, self.steps = name, grid, cell, seed, steps
        self.pool, self.hierarchy = pool, hierarchy

    def estimate(self, threads: int) -> float:
        family = self.cell.split("_lr-")[0].removesuffix("-entail").split("-default")[0]
        return BUSY * SECONDS_PER_STEP[family] * self.steps * (TWO_THREADS if threads == 2 else 1)

    def command(self, train: str, work: Path) -> list[str]:
        return [train, "ablate", "--grid", self.grid, "--steps", str(self.steps), "--seeds", "1", "--first-seed",
                str(self.seed), "--cells", self.cell, "--out", str(work / self.name)]

    def committed(self) -> bool:
        return self.name in committed_json(f"docs/results/{self.pool}.json").get("parts", [])


def git(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *arguments], cwd=ROOT, capture_output=True, text=True)


def committed_json(path: str) -> dict:
    """A file of HEAD (not of the working tree: what a part is is what has been committed), {} where HEAD lacks it."""
    shown = git("show", f"HEAD:{path}")
    return json.loads(shown.stdout) if shown.returncode == 0 else {}


def specs_committed() -> bool:
    return bool(committed_json("docs/results/lorentz-19200-tests.json"))


def queue(prefer_sweep: bool) -> list[Part]:
    stage_1 = [Part(f"lorentz-lr-9600-{family}_lr-{lr}-seed{seed}", "lorentz", f"{family}_lr-{lr}", seed, 9600,
                    "lorentz-lr-9600") for seed in range(3) for family in FAMILIES for lr in LRS]
    stage_2 = []
    if specs_committed():
        rows = committed_json("docs/results/lorentz-19200-tests.json")["rows"]
        lorentz, product = rows[0]["a"], rows[1]["a"]  # `lorentz` − sphere, `lorentz-product` − Multi: the rule's cells
        stage_2 = [Part(f"lorentz-19200-{cell}-seed{seed}", "lorentz", cell, seed, 19200, "lorentz-19200", True)
                   for seed in range(5) for cell in (lorentz, lorentz.replace("_lr-", "-entail_lr-"), product,
                                                     product.replace("_lr-", "-entail_lr-"))]
    sweep = [Part(f"tau-range-full-scenes-38400-{cell}-seed{seed}", "tau-range-full-scenes", cell, seed, 38400,
                  "tau-range-full-scenes-38400") for seed in range(5) for cell in ("multi-default-t", "sphere-default-t")]
    return sweep + stage_1 + stage_2 if prefer_sweep else stage_1 + stage_2 + sweep


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M')} {message}", flush=True)


def step(command: list[str]) -> bool:
    """Run one landing step in this checkout; False (its output logged) when it fails."""
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        log(f"failed: {' '.join(command)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.returncode == 0


def commit(paths: list[str], message: str) -> bool:
    """Commit `paths` alone (whatever else the index holds), retrying while another git command holds the index."""
    for _ in range(20):
        if git("add", "-A", "--", *paths).returncode == 0 and git("commit", "-q", "-m", message, "--", *paths).returncode == 0:
            return True
        if not git("status", "--porcelain", "--", *paths).stdout:
            return True  # nothing left to commit: committed already (by hand, say)
        time.sleep(15)
    log(f"could not commit {paths}")
    return False


def land(part: Part, work: Path) -> bool:
    """The finished part into HEAD: its hierarchy analysis first (where asked), then its landing (from HEAD's pool file,
    any uncommitted leftover of an earlier attempt removed), the results packed, the documents' blocks rewritten, and
    one commit of all of it."""
    topoclip = [sys.executable, "-m", "topoclip"]
    paths = [f"docs/results/{part.name}", f"docs/results/{part.pool}.json"]
    run_dir = work / part.name / "runs" / part.cell / f"seed-{part.seed}"
    if part.hierarchy and not (run_dir / "stopped.json").exists():
        out = work / part.name / "hierarchy"
        if not step([*topoclip, "analyze", "hierarchy", str(run_dir), "--size", "500", "--out", str(out)]):
            return False
        record = read_results(out / "hierarchy.json", out)
        record["checkpoint"] = str(Path(record["checkpoint"]).relative_to(work))  # no machine path in the repo
        target = RESULTS / "lorentz-hierarchy-19200" / f"{part.cell}-seed-{part.seed}.json"
        target.parent.mkdir(exist_ok=True)
        target.write_text(json.dumps(record, indent=1) + "\n")
        paths.append("docs/results/lorentz-hierarchy-19200")
    git("clean", "-fdq", "--", paths[0])
    git("checkout", "HEAD", "--", paths[1])
    if not (step([*topoclip, "report", "land", str(work / part.name), "--pool", part.pool])
            and step([*topoclip, "report", "pack"])):
        return False
    documents = [ROOT / "README.md", RESULTS / "headline.png", *sorted((ROOT / "docs").rglob("*.md"))]
    before = {path: path.read_bytes() for path in documents if path.is_file()}
    if not step([*topoclip, "report", "write"]):
        return False
    changed = [str(path.relative_to(ROOT)) for path in documents if path.is_file() and before.get(path) != path.read_bytes()]
    return commit(paths + changed, f"#61: {part.name} landed")  # with the blocks a whole cell changed (τ's late rise)


def write_specs() -> bool:
    """Stage 1 committed whole: the rule's lrs into stage 2's specs, committed before any stage-2 run starts."""
    if not step([sys.executable, "scripts/lorentz_specs.py"]):
        return False
    names = [f"docs/results/lorentz-{name}.json" for name in ("19200-equivalence", "19200-tests", "lr-9600-stability",
                                                               "19200-stability", "precision-stability")]
    return commit([name for name in names if (ROOT / name).exists()],
                  "#61: stage 1 whole; the rule's lrs written into stage 2's specs before any stage-2 run")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the working folder of the runs (not in the checkout)")
    parser.add_argument("--hours", type=float, required=True, help="start no run that would end later than this")
    parser.add_argument("--train", default="topoclip", help="the topoclip command that trains (a pinned clone's)")
    parser.add_argument("--cores", type=int, default=2, help="threads in use at once, over all runs (default 2)")
    parser.add_argument("--prefer", choices=["sweep"], help="take the convergence sweep's runs first")
    args = parser.parse_args(argv)
    deadline = time.time() + 3600 * args.hours
    args.work.mkdir(parents=True, exist_ok=True)
    running: dict[str, tuple[Part, subprocess.Popen, int]] = {}
    failed: set[str] = set()
    while True:
        for name, (part, process, _) in list(running.items()):
            if process.poll() is not None:
                del running[name]
                if process.returncode or not land(part, args.work):
                    failed.add(name)
                    log(f"{name} failed: see {args.work / name}.log, {args.work / name}/logs and this log")
                else:
                    log(f"{name} landed and committed")
        stage_1 = [p for p in queue(False) if p.pool == "lorentz-lr-9600"]
        if not specs_committed() and all(p.committed() for p in stage_1) and not write_specs():
            return 1  # stage 2 must not start without its specs in HEAD
        free, left = args.cores - sum(threads for *_, threads in running.values()), deadline - time.time() - MARGIN_S
        order = queue(args.prefer == "sweep")
        pools = list(dict.fromkeys(p.pool for p in order))
        fits = {p.name: next((n for n in (1, 2) if n <= args.cores and p.estimate(n) <= left), None) for p in order}
        # A part begun in --work resumes first; then the queue's grids in order, within one the parts that need two
        # threads first (only a sitting's start leaves them time and both cores), then the rest in order.
        todo = sorted((p for p in order if fits[p.name] and p.name not in running and p.name not in failed
                       and not p.committed()),
                      key=lambda p: (not (args.work / p.name).exists(), pools.index(p.pool), -fits[p.name]))
        for part in todo:
            threads = fits[part.name]
            if threads > free:
                continue
            log(f"{part.name}: {threads} thread(s), ~{part.estimate(threads) / 60:.0f} min")
            with open(args.work / f"{part.name}.log", "a") as output:
                running[part.name] = (part, subprocess.Popen(
                    part.command(args.train, args.work), cwd=args.work, stdout=output, stderr=subprocess.STDOUT,
                    env={**os.environ, "OMP_NUM_THREADS": str(threads)}), threads)
            free -= threads
        if not running:
            log("nothing left that ends in time" + (f"; failed: {', '.join(sorted(failed))}" if failed else ""))
            return 1 if failed else 0
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
