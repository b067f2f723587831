"""Multi-process training with PyTorch's own stack: torchrun (or srun), torch.distributed, DDP.

Launch with ``torchrun --nproc-per-node N ...`` (or ``srun`` with one task per GPU). Every process
calls :func:`init_distributed`, wraps the CLIP in ``DistributedDataParallel``, and scores its local
batch against the batch gathered from all ranks with :func:`gather_features` (OpenCLIP's "local loss +
gather with grad"). Without a launcher everything here degrades to a single process: no process
group, ``gather_features`` is the identity, ``barrier`` does nothing.
"""
from __future__ import annotations

import os
import subprocess
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from topoclip.core.errors import resolve_device

# When srun starts the tasks without torchrun, nobody sets MASTER_PORT; every task derives the
# same port from the job id: MASTER_PORT_BASE + job_id mod MASTER_PORT_SPAN (inside 20000–29999,
# below Linux's ephemeral range 32768+ so a client socket rarely holds it).
MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000
DEFAULT_MASTER_PORT = 29500  # torchrun's default, when SLURM gives no job id either
# How long a rank waits in one collective before the run is failed. The ranks wait for rank 0 alone while it writes
# a checkpoint (tens of GB to a slow disk for a large tower), its plots and the final evaluation table; NCCL's
# default of 10 minutes would kill a healthy run there. A hung rank is still found within the hour.
COLLECTIVE_TIMEOUT = timedelta(minutes=60)


@dataclass(frozen=True)
class DistributedInfo:
    """Where this process sits. world_size 1 means a single process (no process group)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def is_initialized() -> bool:
    """True when a torch.distributed process group exists (i.e. world_size > 1 was launched)."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def _slurm_master_addr() -> str:
    """The first host of the SLURM allocation (every task computes the same one)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    try:  # scontrol expands every nodelist syntax ("gpu[01-04,07]", "a1,b[2-3]")
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                               capture_output=True, text=True).stdout.split()
        if hosts:
            return hosts[0]
    except (OSError, subprocess.CalledProcessError):
        pass
    # Without scontrol: "node[03-05,9],other" -> "node03"; "node7,node8" -> "node7".
    first = nodelist.split(",")[0]
    if "[" in first:
        prefix, ranges = first.split("[", 1)
        return prefix + ranges.rstrip("]").split(",")[0].split("-")[0]
    return first


def _launch_counts() -> tuple[int, int, int, bool]:
    """(rank, local_rank, world_size, from SLURM) from torchrun's variables, else srun's, else (0, 0, 1); reads only.

    torchrun wins when both are present (torchrun started inside an srun step). SLURM variables
    alone count only with more than one task: a plain `python` inside an sbatch allocation also
    sees SLURM_PROCID=0 / SLURM_NTASKS=1 and must stay a single process.
    """
    world = _env_int("WORLD_SIZE")
    if world is not None:
        return _env_int("RANK") or 0, _env_int("LOCAL_RANK") or 0, world, False
    tasks = _env_int("SLURM_NTASKS")
    if tasks is not None and tasks > 1 and _env_int("SLURM_PROCID") is not None:
        return _env_int("SLURM_PROCID"), _env_int("SLURM_LOCALID") or 0, tasks, True
    return 0, 0, 1, False


def _launch_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) of the launch (see `_launch_counts`); for an srun-only launch it also sets
    the four variables init_method "env://" reads."""
    rank, local_rank, world, slurm = _launch_counts()
    if slurm:
        os.environ.setdefault("MASTER_ADDR", _slurm_master_addr())
        job = _env_int("SLURM_JOB_ID")
        port = MASTER_PORT_BASE + job % MASTER_PORT_SPAN if job is not None else DEFAULT_MASTER_PORT
        os.environ.setdefault("MASTER_PORT", str(port))
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
        os.environ["LOCAL_RANK"] = str(local_rank)
    return rank, local_rank, world


def launch_rank() -> int:
    """This process's rank as the launcher gave it (torchrun's RANK, srun's SLURM_PROCID), 0 without one; it changes no
    variable, so it holds before init_distributed (which sets RANK for an srun-only launch)."""
    return _launch_counts()[0]


def launch_world_size() -> int:
    """The number of processes the launcher started (torchrun's WORLD_SIZE, srun's SLURM_NTASKS), 1 without one;
    it changes no variable."""
    return _launch_counts()[2]


def init_distributed(device: str = "auto", group_of_one: bool = False) -> DistributedInfo:
    """Read the launcher's environment, pick the device, and join the process group.

    Backend nccl on CUDA, gloo otherwise. On CUDA the current device is set to this process's GPU
    (cuda:local_rank unless `device` names an index). With no launcher (WORLD_SIZE unset, no
    multi-task srun) or a world of 1 no process group is created, unless `group_of_one` (FSDP shards over a
    group, of one process too). Calling it again returns the same answer without re-initialising.
    """
    rank, local_rank, world_size = _launch_env()
    resolved = resolve_device(device, "train.device", local_rank)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    if world_size > 1 and not is_initialized():
        backend = "nccl" if resolved.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)
    elif group_of_one and not is_initialized():  # a store in this process: no address, no port
        backend = "nccl" if resolved.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    if is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return DistributedInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=resolved)


def is_main(info: Optional[DistributedInfo] = None) -> bool:
    """True on rank 0 (the process that logs and writes checkpoints)."""
    return (info.rank if info is not None else get_rank()) == 0


def barrier() -> None:
    """Wait for every rank; nothing in a single process."""
    if is_initialized():
        dist.barrier()


def cleanup() -> None:
    """Destroy the process group if one exists (call once at the end of training)."""
    if is_initialized():
        dist.destroy_process_group()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s (picklable) object on every rank; `obj` itself in a single process."""
    if not is_initialized():
        return obj
    holder = [obj if get_rank() == src else None]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def gather_objects(obj: Any) -> list:
    """Every rank's (picklable) object, in rank order, on every rank; [obj] in a single process."""
    if not is_initialized():
        return [obj]
    gathered = [None] * get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def sum_across_ranks(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum of a list of numbers over all ranks (the list itself in a single process)."""
    if not is_initialized():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def gather_features(x: torch.Tensor) -> torch.Tensor:
    """All-gather with gradients: (b, ...) on every rank -> (world · b, ...), rank r's rows at
    [r·b, (r+1)·b). Identity without a process group.

    The backward sums, for rank r's block, the gradients that every rank's loss sends to it
    (a reduce-scatter), so each rank's features receive the gradient of the sum of all ranks'
    losses; DDP's all-reduce then averages parameter gradients, which makes the result the
    gradient of the mean loss, equal to the single-process gradient on the global batch.
    Every rank must pass the same b.
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return x
    from torch.distributed.nn.functional import all_gather

    with warnings.catch_warnings():
        # torch ≥ 2.10 marks this autograd-aware all_gather deprecated in favour of the private
        # torch.distributed._functional_collectives; it is still the public one, and correct.
        warnings.filterwarnings("ignore", message=".*all_gather is deprecated", category=FutureWarning)
        blocks = all_gather(x)  # world tensors (b, ...), differentiable
    return torch.cat(blocks, dim=0)


def is_sharded(model: nn.Module) -> bool:
    """Whether `model`'s parameters are FSDP shards (DTensors: train.parallelism=fsdp). Every rank must then run
    the model as many times as the others: each run gathers the shards from all of them."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: its shard when FSDP shards it (a DTensor), else the whole."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP / DataParallel (`.module`) and torch.compile (`._orig_mod`) wrappers,
    in any nesting: unwrap(compile(DDP(clip))) is clip."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch._dynamo OptimizedModule
            model = model._orig_mod
        else:
            return model
