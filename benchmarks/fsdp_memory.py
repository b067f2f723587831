"""Per-rank memory of DDP and FSDP (train.parallelism) at 1, 2 and 4 processes: parameters, gradients and AdamW
state in bytes, and the process's peak resident memory, after one training step; then the largest model whose
parameters, gradients and optimiser state fit a per-rank budget. JSON lines, then a table.

    python benchmarks/fsdp_memory.py --preset sphere-vit-s16 --batch 8 --worlds 1,2,4 --budget-gib 80

Each setting is one torchrun launch of gloo processes on this machine's CPU (the script starts them itself). The
bytes are exact counts of the tensors each rank holds (an FSDP rank holds its shards; a block's gathered weights
live only while it runs and are not counted); peak RSS includes Python, torch and the activations of the batch.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def local_bytes(tensors) -> int:
    """Bytes of this rank's part of `tensors` (an FSDP DTensor's local shard)."""
    from topoclip.core.distributed import local_part

    return sum(local_part(tensor).numel() * local_part(tensor).element_size() for tensor in tensors)


def worker(args) -> None:
    """One rank: build the run's state as the trainer does, take one step, print this rank's figures."""
    import torch

    from topoclip.config import load_config
    from topoclip.core.distributed import barrier, gather_objects, init_distributed
    from topoclip.run.training.step import forward_backward_loss, optimizer_step
    from topoclip.run.training.build import build_state
    from topoclip.preprocess.tokenizer import TextBatch

    torch.set_num_threads(1)
    config = load_config(args.preset, [f"train.parallelism={args.parallelism}", "train.precision=fp32",
                                       f"train.batch_size={args.batch}", *args.set])
    info = init_distributed(args.device, group_of_one=args.parallelism == "fsdp")
    state = build_state(config, info.device, initialise=True)
    model = state.model
    trained = model
    if info.world_size > 1 and args.parallelism == "ddp":
        trained = torch.nn.parallel.DistributedDataParallel(model)
    vision, text = config.model.vision, config.model.text
    generator = torch.Generator().manual_seed(info.rank)
    local = args.batch // info.world_size
    images = torch.randn(local, 3, vision.image_size, vision.image_size, generator=generator).to(info.device)
    ids = torch.randint(5, text.vocab_size, (local, text.context_length), generator=generator)
    ids[:, 0] = text.cls_token_id
    ids = ids.to(info.device)
    forward_backward_loss(trained, images, TextBatch(ids, torch.ones_like(ids, dtype=torch.bool)))
    gradients = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
    optimizer_step(trained, state.optimizer)
    figures = {
        "parameters": local_bytes(model.parameters()),
        "gradients": gradients,
        "optimizer": local_bytes(value for values in state.optimizer.state.values() for value in values.values()
                                 if isinstance(value, torch.Tensor)),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux reports KiB
    }
    if info.device.type == "cuda":  # what the GPU held at most: weights, gradients, state, activations, buffers
        figures["peak_device"] = torch.cuda.max_memory_allocated(info.device)
    everyone = gather_objects(figures)
    if info.rank == 0:
        count = sum(p.numel() for p in model.parameters())  # DTensor.numel() is the whole parameter's
        print(json.dumps({"benchmark": "fsdp_memory", "preset": args.preset, "parallelism": args.parallelism,
                          "world": info.world_size, "batch": args.batch, "parameter_count": count,
                          "per_rank": everyone}), flush=True)
    barrier()  # every rank leaves together
    # and without tearing gloo down: destroying the group at exit aborted a rank ("terminate called without an
    # active exception") in 2 of 2 loaded CI runs, 0 of 12 quiet launches; the figures are printed by then.
    os._exit(0)


def launch(args, parallelism: str, world: int) -> dict:
    """One torchrun launch of `world` worker processes; their figures."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=env.get("GLOO_SOCKET_IFNAME", "lo"))
    # --standalone: a rendezvous on a port the launcher picks itself (no race with another launch for a free port)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), __file__,
               "--worker",
               "--parallelism", parallelism, "--preset", args.preset, "--batch", str(args.batch), "--device", args.device,
               *[part for setting in args.set for part in ("--set", setting)]]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"benchmark"')]
    if done.returncode or not lines:
        sys.exit(f"fsdp_memory: the {parallelism} launch of {world} process(es) failed:\n{done.stderr[-3000:]}")
    print(lines[-1], flush=True)
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="sphere-vit-s16")
    parser.add_argument("--batch", type=int, default=8, help="the global batch of the one step")
    parser.add_argument("--worlds", default="1,2,4", help="numbers of processes")
    parser.add_argument("--budget-gib", type=float, default=80.0, help="per-rank memory for the largest-model line")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl, one GPU a process)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--parallelism", default="ddp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    results = [launch(args, parallelism, int(world)) for world in args.worlds.split(",")
               for parallelism in ("ddp", "fsdp")]
    gib = 1024**3
    print(f"\n{args.preset}, {results[0]['parameter_count'] / 1e6:.1f} M parameters, fp32 AdamW; GiB on the rank "
          "that holds the most (FSDP's shards are uneven by a few rows):")
    print(f"{'':>10} {'processes':>9} {'params':>7} {'grads':>7} {'AdamW':>7} {'total':>7} {'peak RSS':>9} "
          f"{'largest model in ' + format(args.budget_gib, 'g') + ' GiB':>26}")
    for result in results:
        worst = max(result["per_rank"], key=lambda rank: rank["parameters"] + rank["gradients"] + rank["optimizer"])
        total = worst["parameters"] + worst["gradients"] + worst["optimizer"]
        # Parameters, gradients and AdamW's two moments scale with the model; activations and the gathered block
        # (FSDP) do not, so the largest model is extrapolated from the bytes per parameter held per rank.
        largest = args.budget_gib * gib / (total / result["parameter_count"])
        print(f"{result['parallelism']:>10} {result['world']:>9} {worst['parameters'] / gib:7.3f} "
              f"{worst['gradients'] / gib:7.3f} {worst['optimizer'] / gib:7.3f} {total / gib:7.3f} "
              f"{worst['peak_rss'] / gib:9.2f} {largest / 1e9:22.2f} B params")


if __name__ == "__main__":
    main()
