"""Where a training step's time goes: the step under torch.profiler, its top kernels and the time no kernel ran.

    python benchmarks/profile_step.py --preset sphere-vit-b16 --batch 256 --device cuda --precision bf16 --compile
    python benchmarks/profile_step.py --preset tiny --batch 8 --device cpu          # a rehearsal on a CPU

The step is benchmarks/train_step.py's (the trainer's forward_backward_loss and optimizer_step on random inputs).
After --warmup untimed steps, --steps steps are profiled. Prints one JSON line: the wall time a step, the time a
step the device was busy (the union of its kernels' intervals: on CUDA the GPU's kernels, on a CPU the operators'
self time), the idle remainder (the gaps: launches, host work, synchronisation), and the top kernels by self time
with their share, so the largest loss toward the step's peak is named before it is fixed.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from train_step import synchronize, topoclip_step


def busy_seconds(events, cuda: bool) -> float:
    """The union of the kernels' intervals (CUDA), or the sum of the operators' self time (CPU), in seconds."""
    if not cuda:
        return sum(event.self_cpu_time_total for event in events) / 1e6
    intervals = sorted((event.time_range.start, event.time_range.end) for event in events
                       if event.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for start, stop in intervals:
        if start > end:
            busy, end = busy + (stop - start), stop
        elif stop > end:
            busy, end = busy + (stop - end), stop
    return busy / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="sphere-vit-b16")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    precision = args.precision if args.device != "cpu" else "fp32"
    step, model, _ = topoclip_step(args.preset, args.batch, device=args.device, precision=precision,
                                   overrides=tuple(args.overrides), compile=args.compile)
    for _ in range(args.warmup):
        step()
    synchronize(args.device)
    cuda = args.device.startswith("cuda")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as profile:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        synchronize(args.device)
        wall = (time.perf_counter() - start) / args.steps
    events = profile.events()
    busy = busy_seconds(events, cuda) / args.steps
    # On CUDA the kernels alone: an operator's row carries the device time of the kernels it launched, so with both
    # the total counts each kernel twice (and a compiled Triton kernel is listed twice, as a launch and a kernel).
    table = [row for row in profile.key_averages()
             if not cuda or row.device_type == torch.autograd.DeviceType.CUDA]
    key = (lambda row: row.self_device_time_total) if cuda else (lambda row: row.self_cpu_time_total)
    total = sum(key(row) for row in table) or 1.0
    top = sorted(table, key=key, reverse=True)[:args.top]
    print(json.dumps({
        "benchmark": "profile_step", "preset": args.preset, "batch": args.batch, "device": args.device,
        "precision": precision, "compile": args.compile, "steps": args.steps, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "wall_ms_per_step": round(1000 * wall, 2), "busy_ms_per_step": round(1000 * busy, 2),
        "idle_fraction": round(max(0.0, 1 - busy / wall), 3),
        "top": [{"name": row.key[:120], "calls": row.count // args.steps, "ms_per_step": round(key(row) / 1000 / args.steps, 3),
                 "share": round(key(row) / total, 3)} for row in top]}), flush=True)


if __name__ == "__main__":
    main()
