"""Issue #61's runs, one run to a part, each landed into docs/results and committed as it finishes: the 2-core
machine's working folder does not outlive a sitting, so a sitting's end loses at most the runs in flight. Start one
worker a core at a sitting's start (they share one queue); each starts only a run that its estimate says ends before
--until, so that the sitting's end (and its CI, which needs the cores) cuts none short:

    nohup python scripts/issue61.py --work /work/exp --until 02:05 --train /work/pinvenv/bin/topoclip >> w1.log 2>&1 &
    nohup python scripts/issue61.py --work /work/exp --until 02:05 --train /work/pinvenv/bin/topoclip \\
        --prefer sweep >> w2.log 2>&1 &

--train: the `topoclip` that trains (a pinned clone's: the runs must not change with the code under edit); landing,
the specs and the commits use this checkout. The queue, as the pre-registrations order it
(docs/results/preregistration-lorentz.md, preregistration-38400.md):

1. stage 1, `lorentz-lr-9600` (pooled): the lorentz family's lr grid, 9,600 steps, three seeds;
2. once stage 1 is whole, `scripts/lorentz_specs.py` (the rule's lrs; the specs of stage 2), committed before any
   stage-2 run starts; then the precision arm (`lorentz-precision-P-FAMILY`, bf16 and fp16, seed 0) and stage 2,
   `lorentz-19200` (pooled: the four cells at their family's lr, five seeds, 19,200 steps), each stage-2 run's
   `analyze hierarchy --size 500` landed as docs/results/lorentz-hierarchy-19200/CELL-seed-K.json;
3. the convergence sweep, `tau-range-full-scenes-38400` (pooled): the full scenes' own-range cells, five seeds,
   38,400 steps (first with --prefer sweep).
"""
from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import shutil
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
# sphere ~3,500 s at 19,200 steps); a run's estimate is 1.15 times its steps' (a busy sitting), twice that in bf16 or
# fp16 on a CPU (not yet measured).
SECONDS_PER_STEP = {"lorentz": 0.19, "lorentz-product": 0.40, "multi": 0.22, "sphere": 0.18}
MARGIN_S = 600  # a run must end this long before --until: landing, the hierarchy analysis and the commit


class Part:
    def __init__(self, name: str, grid: str, cell: str, seed: int, steps: int, pool: str | None = None,
                 settings: tuple[str, ...] = (), hierarchy: bool = False):
        self.name, self.grid, self.cell, self.seed, self.steps = name, grid, cell, seed, steps
        self.pool, self.settings, self.hierarchy = pool, settings, hierarchy

    def estimate(self) -> float:
        family = self.cell.split("_lr-")[0].removesuffix("-entail").split("-default")[0]
        return 1.15 * SECONDS_PER_STEP[family] * self.steps * (2 if self.settings else 1)

    def command(self, train: str, work: Path) -> list[str]:
        return [train, "ablate", "--grid", self.grid, "--steps", str(self.steps), "--seeds", "1", "--first-seed",
                str(self.seed), "--cells", self.cell, *(f"--set={s}" for s in self.settings), "--out",
                str(work / self.name)]

    def landed(self) -> bool:
        if self.pool:
            return self.name in read_results(RESULTS / f"{self.pool}.json", RESULTS)["parts"]
        return (RESULTS / self.name).is_dir()


def specs_written() -> bool:
    return (RESULTS / "lorentz-19200-tests.json").is_file()


def queue(prefer_sweep: bool) -> list[Part]:
    stage_1 = [Part(f"lorentz-lr-9600-{family}_lr-{lr}-seed{seed}", "lorentz", f"{family}_lr-{lr}", seed, 9600,
                    "lorentz-lr-9600") for seed in range(3) for family in FAMILIES for lr in LRS]
    later = []
    if specs_written():
        chosen = [row["a"] for row in read_results(RESULTS / "lorentz-19200-tests.json", RESULTS)["rows"]]
        lorentz, product = chosen[0], chosen[1]  # `lorentz` − sphere, `lorentz-product` − Multi: the rule's cells
        later += [Part(f"lorentz-precision-{p}-{cell.split('_lr-')[0]}", "lorentz", cell, 0, 9600,
                       settings=(f"train.precision={p}",)) for p in ("bf16", "fp16") for cell in (lorentz, product)]
        later += [Part(f"lorentz-19200-{cell}-seed{seed}", "lorentz", cell, seed, 19200, "lorentz-19200", hierarchy=True)
                  for seed in range(5) for cell in (lorentz, lorentz.replace("_lr-", "-entail_lr-"), product,
                                                    product.replace("_lr-", "-entail_lr-"))]
    sweep = [Part(f"tau-range-full-scenes-38400-{cell}-seed{seed}", "tau-range-full-scenes", cell, seed, 38400,
                  "tau-range-full-scenes-38400") for seed in range(5) for cell in ("multi-default-t", "sphere-default-t")]
    return sweep + stage_1 + later if prefer_sweep else stage_1 + later + sweep


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    print(f"{time.strftime('%H:%M')} $ {' '.join(command)}", flush=True)
    return subprocess.run(command, cwd=ROOT, **kwargs)


def commit(paths: list[Path], message: str) -> None:
    """Commit `paths` alone (whatever else the index holds), retrying while another git command holds the index."""
    names = [str(path.relative_to(ROOT)) for path in paths]
    for _ in range(30):
        if (run(["git", "add", "--", *names]).returncode == 0
                and run(["git", "commit", "-q", "-m", message, "--", *names]).returncode == 0):
            return
        time.sleep(10)
    print(f"could not commit {names}: commit them by hand", flush=True)


def finish(part: Part, train: str, work: Path) -> bool:
    """Train (or resume, or only tabulate) the part, land it, analyse its run where asked, pack, commit. False on
    failure."""
    if run(part.command(train, work)).returncode != 0:
        return False
    topoclip = [sys.executable, "-m", "topoclip"]
    land = run([*topoclip, "report", "land", str(work / part.name), *(["--pool", part.pool] if part.pool else [])])
    if land.returncode != 0:
        return False
    paths = [RESULTS / part.name] + ([RESULTS / f"{part.pool}.json"] if part.pool else [])
    if part.hierarchy:
        out = work / part.name / "hierarchy"
        run_dir = work / part.name / "runs" / part.cell / f"seed-{part.seed}"
        if not (run_dir / "stopped.json").exists():
            if run([*topoclip, "analyze", "hierarchy", str(run_dir), "--size", "500", "--out", str(out)]).returncode:
                return False
            target = RESULTS / "lorentz-hierarchy-19200" / f"{part.cell}-seed-{part.seed}.json"
            target.parent.mkdir(exist_ok=True)
            record = read_results(out / "hierarchy.json", out)
            record["checkpoint"] = str(Path(record["checkpoint"]).relative_to(work))  # no machine path in the repo
            target.write_text(json.dumps(record, indent=1) + "\n")
            paths.append(target.parent)
    if run([*topoclip, "report", "pack"]).returncode:  # gzip what landed, as docs/results keeps it
        return False
    commit(paths, f"#61: {part.name} landed")
    return True


def write_specs(work: Path) -> None:
    """Stage 1 whole: the rule's lrs into stage 2's specs, committed before stage 2 starts (one worker does it)."""
    with open(work / "specs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not specs_written() and run([sys.executable, "scripts/lorentz_specs.py"]).returncode == 0:
            commit(sorted(RESULTS.glob("lorentz-*-equivalence.json")) + sorted(RESULTS.glob("lorentz-*-tests.json"))
                   + sorted(RESULTS.glob("lorentz-*-stability.json")), "#61: stage 1 whole; the rule's lrs written "
                                                                         "into stage 2's specs before any stage-2 run")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the working folder of the runs (not in the checkout)")
    parser.add_argument("--until", required=True, help="HH:MM (UTC, `date`'s clock): start no run that would end later")
    parser.add_argument("--train", default="topoclip", help="the topoclip command that trains (a pinned clone's)")
    parser.add_argument("--prefer", choices=["sweep"], help="take the convergence sweep's runs first")
    args = parser.parse_args(argv)
    now = datetime.datetime.now(datetime.timezone.utc)
    until = now.replace(hour=int(args.until[:2]), minute=int(args.until[3:5]), second=0, microsecond=0)
    until += datetime.timedelta(days=until < now)
    args.work.mkdir(parents=True, exist_ok=True)
    failed: set[str] = set()
    while True:
        if not specs_written() and all(p.landed() for p in queue(False) if p.pool == "lorentz-lr-9600"):
            write_specs(args.work)
        left = (until - datetime.datetime.now(datetime.timezone.utc)).total_seconds() - MARGIN_S
        for part in queue(args.prefer == "sweep"):
            if part.name in failed or part.landed() or part.estimate() > left:
                continue
            claim = open(args.work / f"{part.name}.claim", "w")
            try:
                fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the other worker's part: theirs
            except BlockingIOError:
                claim.close()
                continue
            with claim:
                if not part.landed() and not finish(part, args.train, args.work):
                    failed.add(part.name)
                    print(f"{part.name} failed: see its logs in {args.work / part.name}", flush=True)
            break
        else:  # nothing this worker can start: another holds the rest, or none ends in time
            print(f"{time.strftime('%H:%M')} nothing left that ends before {args.until}", flush=True)
            return 0


if __name__ == "__main__":
    sys.exit(main())
