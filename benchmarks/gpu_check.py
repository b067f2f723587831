"""The GPU path checked end to end in one prepared run, and its CPU rehearsal: one JSON and a short text report.

    python benchmarks/gpu_check.py --out gpu-check/                      # on one GPU: at most ~8 minutes
    python benchmarks/gpu_check.py --device cpu --tiny --out rehearsal/  # every step on a CPU, in about 2 minutes

Steps, each in its own process with a time limit, each recorded as passed / failed / skipped with its output's tail:
1. `pytest --run-gpu -m gpu`: every test marked gpu (on a CPU they skip, and the step says so).
2. A real `topoclip train` in bf16 (fp32 on a CPU) with periodic evaluation, LiT locking, TensorBoard and W&B
   (offline), on WebDataset shards written by `topoclip data make-shards`: killed with SIGKILL after its first
   checkpoint, resumed with `--resume`, and its losses compared with an uninterrupted run of the same seed
   (equal on a CPU, where the run is deterministic; on a GPU the largest difference is reported against a bound
   of 1e-2 relative, bf16's rounding of a loss summed over a few hundred steps of an order-one loss);
   a short run with a metric-learning loss (max-hinge); `topoclip embed` of the shards' images.
3. The ViT-B/16 step (benchmarks/mfu.py), sphere and Multi(32, 16), batch 256, bf16, eager (then, last, compiled):
   images/s, FLOPs, MFU against a matmul peak measured in the same run, and OpenCLIP's own model when it imports.
4. Shards against random tensors (benchmarks/shard_throughput.py) with the default workers.
Issue #59's steps, chosen with --only (each also in the full check, after the above):
5. `loader`: benchmarks/loader.py alone, one worker, 8 and 15 (train.num_workers=auto on 16 cores) on 256 px JPEGs:
   the rate per worker on this node, and whether the loader alone feeds the step.
6. `shards_workers`: shards against random tensors with 8 workers, the step compiled (the goal: ≥ 0.95), and the
   time a step waited for the loader; `shards_epochs` the same in epochs of 32 batches (what an epoch's start
   costs); `shards_in_flight` the same with four batches queued a worker; `epoch_start` (benchmarks/epoch_start.py)
   what an epoch's start is spent on: the gap before its first batch, and one worker's epoch start.
7. `profile`: benchmarks/profile_step.py, both ViT-B/16 presets compiled: the top kernels and the idle share.
8. `nccl`: `topoclip train` over NCCL in one process: FSDP (its group of one) and DDP under torchrun (world 1).
9. `fsdp_memory`: benchmarks/fsdp_memory.py on CUDA, one process each of DDP and FSDP: the GPU's peak bytes.
Issue #61's (also with --only):
10. `step_lorentz`, `step_lorentz_product`: the ViT-B/16 step of step 3 with MERU's hyperboloid (sphere-vit-b16 as
   `lorentz`) and PHyCLIP's product (multi-32x16-vit-b16 as `lorentz-product`), entailment loss at 0.2, eager:
   what the hyperbolic families cost beside step_eager's sphere and Multi on the same GPU.
With --tiny every size is the tiny preset's and every count a few steps, so the whole path runs on a laptop.
--budget bounds the whole check (a GPU is lent for minutes): each step's limit is cut to what is left, and a step
with too little left is recorded as skipped. check.json and report.txt are rewritten after every step.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESUME_BOUND_GPU = 1e-2  # relative: bf16 (8 significant bits) over a few hundred steps; a CPU run must be equal
MIN_STEP_SECONDS = 20  # a step given less than this is skipped: too short for even the CUDA context to start
DEADLINE = [float("inf")]  # perf_counter() by which every step must end (--budget), shared by run()


def run(command: list[str], limit: int, env: dict | None = None, cwd: Path = ROOT) -> dict:
    """One step's process: status, seconds, the tail of its output and the JSON lines it printed. Its limit is cut
    to what is left of --budget; a step with less than MIN_STEP_SECONDS left is skipped and says so."""
    start = time.perf_counter()
    limit = int(min(limit, DEADLINE[0] - start))
    if limit < MIN_STEP_SECONDS:
        return {"command": " ".join(command), "status": "skipped", "seconds": 0.0, "json": [],
                "tail": "skipped: the --budget was spent by the steps before"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit, cwd=cwd,
                              env={**os.environ, **(env or {})})
        status = "passed" if done.returncode == 0 else "failed"
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        status, output = "failed", f"timed out after {limit} s\n{(expired.stdout or b'')[-2000:]!r}"
    lines = [line for line in output.splitlines() if line.startswith("{")]
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:
            pass
    return {"command": " ".join(command), "status": status, "seconds": round(time.perf_counter() - start, 1),
            "json": parsed, "tail": output[-1500:]}


def cpu() -> dict:
    """The host's processor as /proc/cpuinfo states it: the model, the logical cores, and the hardware threads a core
    runs (2 where 16 logical cores are 8 cores: loader workers beside the step then share them)."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    threads = (int(fields["siblings"]) // int(fields["cpu cores"]) if fields.get("siblings", "").isdigit()
               and fields.get("cpu cores", "").isdigit() and int(fields["cpu cores"]) else None)
    return {"model": fields.get("model name"), "logical_cores": os.cpu_count(), "threads_per_core": threads}


def topoclip(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "topoclip", *arguments]


def losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} of a run's metrics.jsonl."""
    found = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            found[record["step"]] = record["loss"]
    return found


def training(args, out: Path, result: dict, save) -> None:
    """Step 2 into `result`: shards, an uninterrupted run, a killed and resumed run, a metric-learning run, embed;
    `save()` after each."""
    device, tiny = args.device, args.tiny
    precision = "bf16" if device != "cpu" else "fp32"
    steps, every = (24, 8) if tiny else (300, 100)
    shards = out / "shards"
    result["make_shards"] = run(topoclip("data", "make-shards", "--preset", "tiny" if tiny else "cpu-multi",
                                         "--count", "512" if tiny else "20000", "--samples-per-shard", "128",
                                         "--out", str(shards)), 300)
    pattern = sorted(str(path) for path in shards.glob("*.tar"))
    spec = f"{shards}/{{{Path(pattern[0]).stem}..{Path(pattern[-1]).stem}}}.tar" if pattern else str(shards / "x.tar")
    settings = ["--preset", "tiny" if tiny else "cpu-multi", "--quiet",
                "--set", f"train.device={device}", "--set", f"train.precision={precision}",
                "--set", f"train.steps={steps}", "--set", f"train.eval_every={every}",
                "--set", f"train.checkpoint_every={every}", "--set", "train.keep_checkpoints=5",
                "--set", "data.source=shards", "--set", f"data.train_data={spec}",
                "--set", "train.lock_image=true", "--set", "train.lock_image_unlocked_groups=2",
                "--set", 'train.report_to=["tensorboard","wandb"]', "--set", "evaluate.size=64",
                "--set", "evaluate.validation_size=32", "--set", "train.log_every=2"]
    if tiny:
        settings += ["--set", "train.batch_size=32", "--set", "train.num_workers=1"]
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(out)}
    save()
    result["uninterrupted"] = run(topoclip("train", *settings, "--out", str(out / "whole")), 150, env)
    save()
    # The same run killed with SIGKILL once its first checkpoint is written, then resumed.
    killed = out / "killed"
    if DEADLINE[0] - time.perf_counter() >= MIN_STEP_SECONDS:
        process = subprocess.Popen(topoclip("train", *settings, "--out", str(killed)), cwd=ROOT,
                                   env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while (time.perf_counter() < DEADLINE[0] and process.poll() is None
               and not list((killed / "checkpoints").glob("step-*"))):
            time.sleep(0.2)
        process.send_signal(signal.SIGKILL)
        process.wait()
    result["resumed"] = run(topoclip("train", "--resume", str(killed), "--quiet",
                                     "--set", 'train.report_to=["tensorboard","wandb"]'), 150, env)
    if result["uninterrupted"]["status"] == result["resumed"]["status"] == "passed":
        whole, again = losses(out / "whole"), losses(killed)
        common = sorted(set(whole) & set(again))
        worst = max((abs(whole[s] - again[s]) / max(abs(whole[s]), 1e-12) for s in common), default=None)
        bound = 0.0 if device == "cpu" else RESUME_BOUND_GPU
        result["resume_losses"] = {"steps_compared": len(common), "largest_relative_difference": worst,
                                   "bound": bound, "status": "passed" if common and worst <= bound else "failed"}
    save()
    metric = settings + ["--set", "train.loss=max-hinge", "--set", "train.margin=0.2", "--set", "train.lock_image=false",
                         "--set", "train.lock_image_unlocked_groups=0", "--set", f"train.steps={every}"]
    result["metric_learning"] = run(topoclip("train", *metric, "--out", str(out / "max-hinge")), 150, env)
    save()
    result["embed"] = run(topoclip("embed", str(out / "whole"), "--images", spec, "--out", str(out / "embeddings"),
                                   "--device", device, "--quiet"), 90)
    save()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny preset and a few steps everywhere (rehearsal)")
    parser.add_argument("--out", required=True, help="a new folder for check.json, report.txt and the runs")
    parser.add_argument("--budget", type=float, default=480.0,
                        help="seconds for the whole check; steps in order, each cut to what is left, the rest skipped")
    parser.add_argument("--only", default="", help="run only these steps, comma-separated, e.g. "
                        "loader,shards_workers,shards_in_flight,profile_sphere-vit-b16,nccl_fsdp (issue #59's); "
                        "default: all")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=False)
    DEADLINE[0] = time.perf_counter() + args.budget
    import torch

    report = {"device": args.device, "tiny": args.tiny, "torch": torch.__version__, "python": platform.python_version(),
              "machine": platform.machine(), "kernel": platform.release(), "cpu": cpu(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "steps": {}}
    steps = report["steps"]
    chosen = set(filter(None, args.only.split(",")))
    wanted = lambda name: not chosen or name in chosen  # noqa: E731
    write_report(report, out)
    if wanted("gpu_tests"):
        steps["gpu_tests"] = run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "--run-gpu",
                                  "--show-capture=no", "--tb=short", "tests/test_gpu.py"], 180)
        write_report(report, out)
    if wanted("training"):
        steps["training"] = {}
        training(args, out, steps["training"], lambda: write_report(report, out))
    presets = "tiny" if args.tiny else "sphere-vit-b16,multi-32x16-vit-b16"
    batch = "8" if args.tiny else "256"
    small = ["--rounds", "1", "--steps", "2", "--warmup", "1"] if args.tiny else ["--rounds", "3"]
    device = ["--device", args.device] + ([] if args.device == "cpu" else ["--precision", "bf16"])
    shard = ["--samples", "256", "--steps", "3", "--warmup", "1", "--rounds", "1", "--image-size", "64"] if args.tiny else []
    mfu = [sys.executable, str(HERE / "mfu.py"), "--presets", presets, "--batch", batch, *device, *small]
    shards = [sys.executable, str(HERE / "shard_throughput.py"), "--preset", "tiny" if args.tiny else "sphere-vit-b16",
              "--batch", batch, "--device", args.device, *shard]
    # The compiled step goes last: compiling two ViT-B/16 towers is the slowest step, and the least new.
    for name, limit, command in (("step_eager", 150, mfu), ("shards_vs_random", 120, shards),
                                 ("step_compiled", 600, [*mfu, "--compile"]), *issue_59_steps(args, out, batch),
                                 *hyperbolic_steps(args, mfu)):
        if wanted(name):
            steps[name] = run(command, limit)
            write_report(report, out)
    lines = write_report(report, out)
    print("\n".join(lines))
    return 0 if report["passed"] else 1


def issue_59_steps(args, out: Path, batch: str) -> list[tuple[str, int, list[str]]]:
    """(name, limit, command) of the loader at more workers, the shards with 8 workers compiled, the step profiled,
    training over NCCL in one process, and FSDP's memory on the GPU (see the module text)."""
    tiny = args.tiny
    workers = ["1", "2"] if tiny else ["1", "8", "15"]
    loader = [sys.executable, str(HERE / "loader.py"), "--sizes", "256", "--samples", "128" if tiny else "4096",
              "--batch", "16" if tiny else "256", "--batches", "2" if tiny else "64", "--rounds", "1",
              "--workers", *workers, "--shards", str(out / "loader-shards"), "--out", str(out / "loader.json"),
              "--note", "on the lent GPU machine, beside nothing else"]
    shards = [sys.executable, str(HERE / "shard_throughput.py"), "--preset", "tiny" if tiny else "sphere-vit-b16",
              "--batch", batch, "--device", args.device, "--workers", "2" if tiny else "8"] + (
        ["--samples", "256", "--steps", "3", "--warmup", "1", "--rounds", "1", "--image-size", "64"] if tiny
        else ["--compile", "--precision", "bf16"])
    precision = ["--precision", "fp32" if args.device == "cpu" else "bf16"]
    profile = [sys.executable, str(HERE / "profile_step.py"), "--batch", batch, "--device", args.device, *precision]
    profiles = [(f"profile_{preset}", 240, [*profile, "--preset", preset] + ([] if tiny else ["--compile"]))
                for preset in (["tiny"] if tiny else ["sphere-vit-b16", "multi-32x16-vit-b16"])]
    train = ["--preset", "tiny", "--quiet", "--set", f"train.device={args.device}", "--set", "train.steps=20",
             "--set", "train.checkpoint_every=10", "--set", "evaluate.size=16", "--set", "train.batch_size=16"]
    fsdp = topoclip("train", *train, "--set", "train.parallelism=fsdp", "--out", str(out / "nccl-fsdp"))
    ddp = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "topoclip",
           "train", *train, "--out", str(out / "nccl-ddp")]
    memory = [sys.executable, str(HERE / "fsdp_memory.py"), "--preset", "tiny" if tiny else "sphere-vit-b16",
              "--batch", "8" if tiny else "64", "--worlds", "1", "--device", args.device]
    # The same with four batches queued a worker (LOADER_BATCHES_IN_FLIGHT allows one at 8 workers): whether a worker
    # idling from its batch's end until the step takes it is what holds the step back.
    deeper = [*shards, "--in-flight", "8" if tiny else "32"]
    # The same in epochs of --samples (32 batches): what an epoch's start costs the step, the workers kept.
    epochs = [*shards, "--samples-per-epoch", "0"]
    # And what that is spent on: the gap before an epoch's first batch (epochs of 32 batches, as shards_epochs'), and
    # one worker's epoch start (on the loader step's shards of 256 px: the same samples and layout, written once).
    start = [sys.executable, str(HERE / "epoch_start.py"), "--preset", "tiny" if tiny else "sphere-vit-b16",
             "--workers", "2" if tiny else "8", "--batch", "16" if tiny else "256", "--samples", "128" if tiny else "4096",
             "--epoch-batches", "4" if tiny else "32", "--epochs", "3" if tiny else "4", "--shuffle-buffer", "1", "1000",
             "--shards", str(out / "loader-shards" / "256"), "--out", str(out / "epoch-start.json")]
    return [("loader", 240, loader), ("shards_workers", 300, shards), ("shards_epochs", 300, epochs),
            ("epoch_start", 150, start),
            ("shards_in_flight", 300, deeper), *profiles,
            ("nccl_fsdp", 120, fsdp),
            ("nccl_ddp", 120, ddp), ("fsdp_memory", 180, memory)]


def hyperbolic_steps(args, mfu: list[str]) -> list[tuple[str, int, list[str]]]:
    """(name, limit, command) of the ViT-B/16 step (the tiny preset's with --tiny) in each hyperbolic family, with
    MERU's entailment loss, topoclip's model only."""
    presets = {"step_lorentz": ("tiny" if args.tiny else "sphere-vit-b16", "lorentz"),
               "step_lorentz_product": ("tiny" if args.tiny else "multi-32x16-vit-b16", "lorentz-product")}
    return [(name, 150, [*mfu, "--presets", preset, "--set", f"model.topology={topology}", "--set",
                         "train.entailment_weight=0.2", "--no-open-clip"]) for name, (preset, topology) in presets.items()]


def statuses(node: dict, prefix: str = ""):
    for key, value in node.items():
        if isinstance(value, dict) and "status" in value:
            yield prefix + key, value["status"]
        elif isinstance(value, dict):
            yield from statuses(value, prefix + key + ".")


def write_report(report: dict, out: Path) -> list[str]:
    """check.json and report.txt as they stand: written after every step, so a check cut short keeps what it ran."""
    found = dict(statuses(report["steps"]))
    report["passed"] = bool(found) and all(status == "passed" for status in found.values())
    (out / "check.json").write_text(json.dumps(report, indent=2))
    lines = [f"GPU check on {report['gpu'] or report['device']} (torch {report['torch']}, {report['date']}"
             f"{', tiny rehearsal' if report['tiny'] else ''}): {'all passed' if report['passed'] else 'FAILED'}"]
    lines += [f"  {name}: {status}" for name, status in found.items()]
    for name in ("step_eager", "step_compiled", "shards_vs_random", "step_lorentz", "step_lorentz_product"):
        summaries = [line for line in report["steps"].get(name, {}).get("json", []) if "images_per_s" in json.dumps(line)]
        if summaries:
            lines.append(f"  {name}: {json.dumps(summaries[-1])[:300]}")
    (out / "report.txt").write_text("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    sys.exit(main())
