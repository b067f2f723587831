"""Issue #61's runs, one run to a part, each landed into docs/results and committed as it finishes: the 2-core
machine's working folder does not always outlive a sitting, so a sitting's end loses at most the runs in flight (and
where the folder does survive, they resume from their newest checkpoint). One coordinator a sitting, started first
thing, with this checkout's python (it lands into this checkout):

    git clone -q /work/main /work/pin && git -C /work/pin checkout -q 96d9ed7      # the code the runs train with
    nohup python scripts/issue61.py --work /work/exp --pin /work/pin --until 2026-11-29T01:55 >> issue61.log 2>&1 &

It trains up to --cores runs at once, each an `ablate` of one run with the pinned clone's code (`--pin`: a clean
checkout of the commit both pre-registrations name, checked) on one thread, or on two where one would not end in time,
and starts only runs whose estimate (of the steps past a begun part's newest checkpoint, at the pace the runs in flight
show on this machine) ends by --until (leave the sitting's CI its cores): the parts begun in --work first, then the
queue's grids in order, within one those that need two threads first. Until --until, with --carry-over, a core no run
holds takes the next part anyway, on one thread and at the lowest priority, yielding it to CI and to any run that ends
in time: the run ends in a later sitting if --work outlives this one, as a part begun (a wiped folder costs it, and only
it). It lands each finished run itself, one at a time: the hierarchy analysis where asked (pinned code), `report land
--pool`, `report pack` and one commit of that part alone, so that HEAD only ever holds whole parts (a landing that fails
is undone and tried again; none while the documents have uncommitted edits, which would go in with it); then the
documents' blocks it changed, `report write`, in a commit of their own. What an earlier attempt left uncommitted is
removed at the start. The queue, as the pre-registrations order it (docs/results/preregistration-lorentz.md,
preregistration-38400.md):

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
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from topoclip.experiments.results import files
from topoclip.experiments.results.files import read_results

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
LRS, FAMILIES = ("5e-4", "1e-3", "2e-3"), ("lorentz", "lorentz-product")
POOLS = ["docs/results/lorentz-lr-9600.json", "docs/results/lorentz-19200.json",
         "docs/results/tau-range-full-scenes-38400.json"]
PIN = "96d9ed74bc15551737a319a5d19d21f5729d9ae1"  # the code every run trains with (both pre-registrations' amendments)
# Seconds a step takes on the 2-core development machine, one thread, the other core training too (measured: a
# lorentz stage-1 run 0.29-0.31 s a step and a product one 0.43-0.45 s beside another run, stop 73, from their
# metrics.jsonl; the sweep's Multi 0.47 s beside a product run, stop 75, which is 0.41 under the 1.15 below; the sphere
# at Multi's 0.81, its ratio in the full scenes' 19,200-step grid, ~3,500 s to ~4,300 s on a quiet machine). A run's
# estimate is 1.15 times its steps' (a busy sitting); on two threads 0.75 of that (two one-thread runs made ~1.5 times
# the images of one two-thread run, stop 69).
SECONDS_PER_STEP = {"lorentz": 0.27, "lorentz-product": 0.40, "multi": 0.41, "sphere": 0.33}
BUSY, TWO_THREADS = 1.15, 0.75
# The machine changes between sittings (stop 78's, an AMD EPYC with AVX-512, trained `lorentz` at 0.115 s a step beside
# another run, 0.37 of the 0.31 above), so the estimates are scaled by the pace the runs in flight show: the slowest
# ratio of the wall time since a run started to the constants' time for the steps it has logged since, once it has
# logged PACE_STEPS (its start-up counted in, which errs long); 1 until one has.
PACE_STEPS = 600
MARGIN_S = 600  # a run must end this long before the deadline: its landing, hierarchy analysis and commit
POLL_S = 30
LANDINGS = 5  # attempts at landing a finished part, one a poll, before it is left to a person


class Part:
    """One run of a pooled grid: `ablate --cells CELL --first-seed SEED --seeds 1 --out WORK/NAME`."""

    def __init__(self, name: str, grid: str, cell: str, seed: int, steps: int, pool: str, hierarchy: bool = False):
        self.name, self.grid, self.cell, self.seed, self.steps = name, grid, cell, seed, steps
        self.pool, self.hierarchy = pool, hierarchy

    def seconds(self, threads: int, steps: int) -> float:
        """SECONDS_PER_STEP's seconds for `steps` of this part's steps on `threads` threads, in a busy sitting."""
        family = self.cell.split("_lr-")[0].removesuffix("-entail").split("-default")[0]
        return BUSY * SECONDS_PER_STEP[family] * steps * (TWO_THREADS if threads == 2 else 1)

    def estimate(self, threads: int, work: Path | None = None, pace: float = 1.0) -> float:
        """Seconds to train the steps left (those past its newest checkpoint in `work`, where it was begun) on a
        machine whose steps take `pace` times SECONDS_PER_STEP's."""
        return pace * self.seconds(threads, self.steps - self.trained(work))

    def trained(self, work: Path | None) -> int:
        """The step of the part's newest checkpoint in `work` (0 where it has none): where its `ablate` resumes."""
        folder = work / self.name / "runs" / self.cell / f"seed-{self.seed}" / "checkpoints" if work else None
        names = [c.name for c in folder.glob("step-*")] if folder else []  # (checkpoints/step-000600, ...)
        return min(max((int(n[5:]) for n in names if re.fullmatch(r"step-[0-9]+", n)), default=0), self.steps)

    def logged(self, work: Path) -> int:
        """The step of the last whole line of the part's metrics.jsonl in `work` (0 where it has none): how far its
        run has trained, between checkpoints."""
        try:
            with open(work / self.name / "runs" / self.cell / f"seed-{self.seed}" / "metrics.jsonl", "rb") as metrics:
                start = metrics.seek(max(metrics.seek(0, os.SEEK_END) - 4096, 0))  # a line is ~300 bytes
                lines = metrics.read().split(b"\n")[1 if start else 0:-1]  # the first cut, the last not yet whole
        except OSError:
            return 0
        for line in reversed(lines):
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue
        return 0

    def command(self, work: Path) -> list[str]:
        """The pinned code's `topoclip ablate` of this run (PYTHONPATH names the pinned clone)."""
        return [sys.executable, "-m", "topoclip", "ablate", "--grid", self.grid, "--steps", str(self.steps), "--seeds",
                "1", "--first-seed", str(self.seed), "--cells", self.cell, "--out", str(work / self.name)]

    def committed(self) -> bool:
        return self.name in committed_parts()


def git(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *arguments], cwd=ROOT, capture_output=True, text=True)


def committed_json(path: str) -> dict:
    """A file of HEAD (not of the working tree: what a part is is what has been committed), {} where HEAD lacks it."""
    shown = git("show", f"HEAD:{path}")
    return json.loads(shown.stdout) if shown.returncode == 0 else {}


def committed_parts() -> set[str]:
    """The parts HEAD's pool files list: the runs landed and committed."""
    return {part for pool in POOLS for part in committed_json(pool).get("parts", [])}


def specs_committed() -> bool:
    return bool(committed_json("docs/results/lorentz-19200-tests.json"))


def queue(prefer_sweep: bool) -> list[Part]:
    stage_1 = [Part(f"lorentz-lr-9600-{family}_lr-{lr}-seed{seed}", "lorentz", f"{family}_lr-{lr}", seed, 9600,
                    "lorentz-lr-9600") for seed in range(3) for family in FAMILIES for lr in LRS]
    stage_2 = []
    if specs_committed():
        rows = committed_json("docs/results/lorentz-19200-tests.json")["rows"]
        lorentz, product = rows[0]["a"], rows[1]["a"]  # `lorentz` − sphere, `lorentz-product` − Multi: the rule's
        stage_2 = [Part(f"lorentz-19200-{cell}-seed{seed}", "lorentz", cell, seed, 19200, "lorentz-19200", True)
                   for seed in range(5) for cell in (lorentz, lorentz.replace("_lr-", "-entail_lr-"), product,
                                                     product.replace("_lr-", "-entail_lr-"))]
    sweep = [Part(f"tau-range-full-scenes-38400-{cell}-seed{seed}", "tau-range-full-scenes", cell, seed, 38400,
                  "tau-range-full-scenes-38400")
             for seed in range(5) for cell in ("multi-default-t", "sphere-default-t")]
    return sweep + stage_1 + stage_2 if prefer_sweep else stage_1 + stage_2 + sweep


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M')} {message}", flush=True)


def step(command: list[str], **options) -> bool:
    """Run one command in this checkout; False (its output logged) when it fails."""
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, **options)
    if done.returncode:
        log(f"failed: {' '.join(command)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.returncode == 0


def commit(paths: list[str], message: str) -> bool:
    """Commit `paths` alone (whatever else the index holds), retrying while another git command holds the index."""
    for _ in range(20):
        added = git("add", "-A", "--", *paths).returncode == 0
        if added and git("commit", "-q", "-m", message, "--", *paths).returncode == 0:
            return True
        if not git("status", "--porcelain", "--", *paths).stdout:
            return True  # nothing left to commit: committed already (by hand, say)
        time.sleep(15)
    log(f"could not commit {paths}")
    return False


def undo(paths: list[str]) -> None:
    """What a landing wrote and HEAD lacks, removed; the pool files back to HEAD's (only this process writes them)."""
    git("clean", "-fdq", "--", *paths)
    git("checkout", "HEAD", "--", *POOLS)


def land(part: Part, work: Path, pin: Path) -> bool:
    """The finished part into HEAD in one commit: its hierarchy analysis (the pinned code's) where asked, its landing
    and the packing; then, apart, the documents' blocks it changed (τ's late rise gains a cell once all its seeds are
    in). False, with nothing of it left behind, when any of it fails: the caller tries again at its next poll."""
    paths = [f"docs/results/{part.name}"]
    run_dir = work / part.name / "runs" / part.cell / f"seed-{part.seed}"
    try:
        if part.hierarchy and not (run_dir / "stopped.json").exists():
            out = work / part.name / "hierarchy"
            if not step([sys.executable, "-m", "topoclip", "analyze", "hierarchy", str(run_dir), "--size", "500",
                         "--out", str(out)], env={**os.environ, "PYTHONPATH": str(pin / "src")}):
                return False
            record = read_results(out / "hierarchy.json", out)
            record["checkpoint"] = os.path.relpath(record["checkpoint"], work)  # no machine path in the repo
            target = RESULTS / "lorentz-hierarchy-19200" / f"{part.cell}-seed-{part.seed}.json"
            target.parent.mkdir(exist_ok=True)
            target.write_text(json.dumps(record, indent=1) + "\n")
            paths += [f"docs/results/lorentz-hierarchy-19200/{target.name}{end}" for end in ("", ".gz")]
        files.land(work / part.name, pool=part.pool)
        files.pack(RESULTS)
        landed = [path for path in paths if (ROOT / path).exists()] + [f"docs/results/{part.pool}.json"]  # (packed)
        if not (commit(landed, f"#61: {part.name} landed") and part.committed()):
            raise RuntimeError("the commit did not take")
    except Exception as error:  # noqa: BLE001 (any failure: undone, tried again)
        log(f"{part.name}: landing failed ({type(error).__name__}: {error}); undone, to be tried again")
        undo(paths)
        return False
    documents = [ROOT / "README.md", RESULTS / "headline.png", *sorted((ROOT / "docs").rglob("*.md"))]
    before = {path: path.read_bytes() for path in documents if path.is_file()}
    if step([sys.executable, "-m", "topoclip", "report", "write"]):
        changed = [str(path.relative_to(ROOT)) for path in documents
                   if path.is_file() and before.get(path) != path.read_bytes()]
        if not changed or commit(changed, f"#61: the blocks {part.name} changed"):
            return True
    log("the documents' blocks are stale at HEAD: run `topoclip report write` and commit them")
    return True


def write_specs() -> bool:
    """Stage 1 committed whole: the rule's lrs into stage 2's specs, committed before any stage-2 run starts."""
    names = [f"docs/results/lorentz-{name}.json" for name in ("19200-equivalence", "19200-tests", "lr-9600-stability",
                                                               "19200-stability", "precision-stability")]
    if step([sys.executable, "scripts/lorentz_specs.py"]) and commit(
            [name for name in names if (ROOT / name).exists()],
            "#61: stage 1 whole; the rule's lrs written into stage 2's specs before any stage-2 run"):
        return specs_committed()
    git("clean", "-fdq", "--", *names)
    return False


def pinned(pin: Path) -> str:
    """'' when `pin` is a clean checkout of PIN (the commit the pre-registrations train from), else the problem."""
    head = subprocess.run(["git", "-C", str(pin), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if head != PIN:
        return (f"{pin} is at {head or 'no commit'}, not {PIN[:7]}: git clone {ROOT} {pin} && "
                f"git -C {pin} checkout {PIN[:7]}")
    if subprocess.run(["git", "-C", str(pin), "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                      text=True).stdout:
        return f"{pin} has uncommitted changes: the runs would not be {PIN[:7]}'s"
    return ""


def lowest_priority() -> None:
    """In a carried run's child process, before it starts: a session of its own, whose autogroup (the scheduler shares
    the cores out between autogroups first, a process's nice counts only inside its own) and itself at nice 19, so
    that CI and the runs that end in time take the cores whenever they want them."""
    os.setsid()
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:
        pass  # a kernel without autogroups: the nice alone is the priority
    os.nice(19)


def measured_pace(running: dict, work: Path, pace: float) -> float:
    """The slowest pace of the `running` runs that end in time (part, process, threads, carried, when it started, from
    which logged step) that have logged PACE_STEPS since they started; `pace` where none has."""
    return max(((time.time() - since) / part.seconds(threads, logged - start)
                for part, _, threads, carried, since, start in running.values()
                if not carried and (logged := part.logged(work)) - start >= PACE_STEPS), default=pace)


def choose(order: list[Part], busy: set[str], free: int, idle: int, left: float, cores: int, work: Path,
           carry: bool, pace: float = 1.0) -> list[tuple[Part, int, bool]]:
    """The parts to start now, each with its thread count and whether it is carried over: of `order`'s parts not
    `busy`, those whose estimate ends within `left` seconds, on one thread or else on two, while `free` threads (those
    no run that ends in time holds) last; a part begun in `work` first, then the grids in `order`'s order, within one
    the parts that need two threads first (only a sitting's start leaves them time and both cores). With `carry`, each
    of the `idle` threads (those no run at all holds) that is still idle then takes the next part that will not end
    in time, on one thread: a carried run yields its thread to any run that ends in time (`lowest_priority`), so it
    is not counted in `free`. Estimates are at `pace` (see PACE_STEPS)."""
    fits = {p.name: next((n for n in (1, 2) if n <= cores and p.estimate(n, work, pace) <= left), None) for p in order}
    pools = list(dict.fromkeys(p.pool for p in order))
    todo = sorted((p for p in order if p.name not in busy),
                  key=lambda p: (not fits[p.name], not (work / p.name).exists(), pools.index(p.pool),
                                 -(fits[p.name] or 1)))
    chosen = []
    for part in todo:
        carried = fits[part.name] is None  # (the parts that fit come first)
        if carried and not carry:
            break
        threads = fits[part.name] or 1
        if threads > (idle if carried else free):
            continue
        chosen.append((part, threads, carried))
        free, idle = free - (0 if carried else threads), idle - threads
    return chosen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the working folder of the runs (not in the checkout)")
    parser.add_argument("--until", required=True, type=datetime.fromisoformat,
                        help="UTC, e.g. 2026-11-29T01:55: start no run that would end later (leave CI its cores)")
    parser.add_argument("--pin", type=Path, required=True, help=f"a clean clone at {PIN[:7]}, whose code trains")
    parser.add_argument("--cores", type=int, default=2, help="threads in use at once, over all runs (default 2)")
    parser.add_argument("--prefer", choices=["sweep"], help="take the convergence sweep's runs first")
    parser.add_argument("--carry-over", action="store_true",
                        help="until --until, give a core no run holds the next part anyway, on one thread at the "
                             "lowest priority: it resumes in a later sitting if --work outlives this one")
    args = parser.parse_args(argv)
    deadline = args.until.replace(tzinfo=args.until.tzinfo or timezone.utc).timestamp()
    problem = pinned(args.pin) or ("" if files.RESULTS == RESULTS else f"this python's topoclip lands into "
                                   f"{files.RESULTS}, not {RESULTS}: run this checkout's python")
    if problem:
        print(f"issue61: {problem}", file=sys.stderr)
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    with open(ROOT / ".git" / "issue61.lock", "w") as lock:  # one coordinator a checkout: a second would undo the
        try:                                                # first one's landings and start its runs again beside it
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"issue61: another coordinator lands into {ROOT}: one a sitting", file=sys.stderr)
            return 2
        return coordinate(args, deadline)


def coordinate(args: argparse.Namespace, deadline: float) -> int:
    """The loop: finished runs landed, then the runs that fit (or are carried over) started, every POLL_S seconds."""
    done = committed_parts()
    undo([f"docs/results/{p.name}" for p in queue(False) if p.name not in done]
         + ["docs/results/lorentz-hierarchy-19200"])  # what an earlier attempt left uncommitted
    train = {**os.environ, "PYTHONPATH": str(args.pin / "src")}
    # part, process, threads, carried, and when it started from which logged step (its pace's measure)
    running: dict[str, tuple[Part, subprocess.Popen, int, bool, float, int]] = {}
    pace = 1.0
    landing: list[Part] = []
    failed: set[str] = set()
    attempts: dict[str, int] = {}  # landings left to a part
    said = ""
    while True:
        for name, (part, process, *_) in list(running.items()):
            if process.poll() is not None:
                del running[name]
                if process.returncode:
                    failed.add(name)  # its folder stays in --work, its log beside it; not started again
                    log(f"{name} failed: see {args.work / name}.log and {args.work / name}/logs")
                else:
                    landing.append(part)
        waiting = git("status", "--porcelain", "--", "README.md", "docs").stdout
        if waiting and landing and waiting != said:
            log(f"{len(landing)} part(s) wait to land until the documents' edits are committed:\n{waiting}")
        said = waiting
        for part in list(landing):  # not while someone's edits of the documents are uncommitted: they'd go in
            if waiting:
                break
            if land(part, args.work, args.pin):
                landing.remove(part)
                log(f"{part.name} landed and committed")
            elif attempts.setdefault(part.name, LANDINGS) == 1:
                landing.remove(part)
                failed.add(part.name)
                log(f"{part.name} did not land after {LANDINGS} attempts: its run is in {args.work / part.name}; "
                    f"land it by hand (topoclip report land OUT --pool {part.pool}) before the sitting ends")
            else:
                attempts[part.name] -= 1
        done = committed_parts()
        stage_1 = [p for p in queue(False) if p.pool == "lorentz-lr-9600"]
        if not specs_committed() and all(p.name in done for p in stage_1) and not write_specs():
            log("the specs of stage 2 could not be committed: stage 2 does not start")
        pace, was = measured_pace(running, args.work, pace), pace
        if abs(pace / was - 1) > 0.1:
            log(f"pace {pace:.2f}: this machine's steps take {pace:.2f} times the estimates' constants")
        idle = args.cores - sum(threads for _, _, threads, *_ in running.values())
        free = args.cores - sum(threads for _, _, threads, carried, *_ in running.values() if not carried)
        busy, left = set(running) | failed | {q.name for q in landing} | done, deadline - time.time() - MARGIN_S
        carry = args.carry_over and time.time() < deadline
        for part, threads, carried in choose(queue(args.prefer == "sweep"), busy, free, idle, left, args.cores,
                                             args.work, carry, pace):
            log(f"{part.name}: {threads} thread(s), ~{part.estimate(threads, args.work, pace) / 60:.0f} min"
                + (", carried over past --until at the lowest priority" if carried else ""))
            # (a resumed run logs again the steps its killed one logged past the checkpoint: not counted as done)
            since, start = time.time(), max(part.trained(args.work), part.logged(args.work))
            with open(args.work / f"{part.name}.log", "a") as output:
                running[part.name] = (part, subprocess.Popen(
                    part.command(args.work), cwd=args.work, stdout=output, stderr=subprocess.STDOUT,
                    env={**train, "OMP_NUM_THREADS": str(threads)},
                    preexec_fn=lowest_priority if carried else None), threads, carried, since, start)
        if not running and not landing:
            log("nothing left that ends in time" + (f"; failed: {', '.join(sorted(failed))}" if failed else ""))
            return 1 if failed else 0
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
