"""Sharded training (train.parallelism=fsdp): PyTorch's FSDP2 (`fully_shard`) over the processes torchrun starts.

Each transformer block is its own FSDP unit, then each tower, then the CLIP, so a block's weights are gathered only
while it runs and each rank keeps 1/W of the parameters, gradients and AdamW moments. The contrastive loss is
untouched: features are gathered across ranks exactly as under DDP (topoclip.core.distributed.gather_features), so the
loss and the gradients equal the one-process run on the same global batch.

The 0-d parameters (the temperature's t and the sigmoid loss's bias; a hyperbolic model's log c and log α) stay
whole on every rank: FSDP2 shards along dim 0 and
refuses 0-d parameters. Their gradients are averaged across ranks by a hook, as FSDP's reduce-scatter averages the
rest (and DDP's all-reduce everything).

A checkpoint keeps the model as one process's file (model.safetensors, gathered to rank 0 by `full_weights`), so
`load`, `eval`, `export` and `push` read it as any other; the optimiser state, twice the weights, stays sharded:
every rank writes its shards with torch.distributed.checkpoint as safetensors (`save_optimizer_shards`; their
offsets in the files' headers, so reading them unpickles nothing), and `load_optimizer_shards` reshards them for
the ranks of the resumed run, however many, or whole for an unsharded one. A checkpoint of an unsharded run (the
optimiser state whole in training_state.pt) loads into a sharded one too (`load_full_weights`,
`load_full_optimizer`).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from topoclip.core.distributed import local_part
from topoclip.core.door import check_tree
from topoclip.core.errors import CheckpointError
from topoclip.model.transformer import Block


def shard(model: nn.Module) -> nn.Module:
    """`model` (a CLIP) sharded in place over the default process group; returns it. Apply before the optimiser is
    built (it must see the sharded parameters) and after locking (locked weights are sharded too, and have no
    optimiser state).

    The gathered weights are fp32, as the master weights: under bf16/fp16 the trainer's autocast casts them op by op
    exactly as under DDP (LayerNorm, embeddings and the residual stream stay fp32; similarities and the loss are
    fp32). FSDP2's bf16 gathers would halve the traffic but round those weights too, so they are not used."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for block in [module for module in model.modules() if isinstance(module, Block)]:
        fully_shard(block)
    for tower in (model.visual, model.text):
        fully_shard(tower)
    whole = {parameter for parameter in model.parameters() if parameter.dim() == 0}
    fully_shard(model, ignored_params=whole)
    for method in ("encode_image", "encode_text"):  # evaluation calls these, not forward: gather for them too
        register_fsdp_forward_method(model, method)
    world = dist.get_world_size()

    def average(parameter: torch.Tensor) -> None:
        dist.all_reduce(parameter.grad)  # gloo has no AVG: the sum, then / world
        parameter.grad.div_(world)

    for parameter in whole:
        if parameter.requires_grad:
            parameter.register_post_accumulate_grad_hook(average)
    return model


def full_weights(model: nn.Module) -> dict:
    """A sharded model's weights as one process's `state_dict()`, on the CPU of rank 0 (other ranks get an empty
    dict). A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_entries(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    """({"<parameter>.<moment>": this rank's shard, ...}, the parameter groups, which name their parameters) of
    the optimiser's state; zeros where it has taken no step yet (torch initialises them)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, optimizer)
    entries = {f"{name}.{key}": value for name, values in by_name["state"].items() for key, value in values.items()}
    return entries, by_name["param_groups"]


def save_optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> list:
    """Every rank writes its shards of the optimiser state into `folder`, one safetensors file a rank (a
    collective); returns the parameter groups, which training_state.pt keeps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    entries, groups = optimizer_entries(model, optimizer)
    dcp.save(entries, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True))
    return groups


def load_optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, groups: list) -> None:
    """The optimiser state of `folder` (save_optimizer_shards, any number of ranks) into `optimizer`, cut to this
    run's shards (whole for an unsharded model). CheckpointError when the files do not hold this model's moments,
    or hold inf/NaN."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    entries, _ = optimizer_entries(model, optimizer)
    check_tree(folder, "the optimiser's shards", error=CheckpointError)  # a FIFO there would block dcp.load forever
    try:
        with quiet_logging():  # a damaged shard: DCP logs its traceback before raising; the fallback says it in a line
            dcp.load(entries, storage_reader=HuggingFaceStorageReader(str(folder)))
    except (Exception, CheckpointException) as error:  # on every rank; CheckpointException is a BaseException
        raise CheckpointError(f"{folder}: the optimiser's shards do not fit this model ({type(error).__name__}: "
                              f"{str(error).strip().splitlines()[-1][:160] if str(error).strip() else ''})") from None
    state: dict[str, dict] = {}
    for key, value in entries.items():
        name, _, moment = key.rpartition(".")
        state.setdefault(name, {})[moment] = value
    if not all_finite(entries.values(), next(model.parameters()).device):
        raise CheckpointError(f"{folder}: the optimiser's shards hold inf/NaN")
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups}, options=StateDictOptions())


@contextmanager
def quiet_logging():
    """No log record below CRITICAL is printed inside the block (torch.distributed.checkpoint logs a failed read's
    traceback at WARNING/ERROR on the root logger before it raises; the caller turns the error into one line)."""
    previous = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        yield
    finally:
        logging.disable(previous)


def all_finite(tensors, device: torch.device) -> bool:
    """Whether every tensor is finite on every rank (each checks its shards; one all-reduce, on `device`: nccl
    reduces CUDA tensors only)."""
    flags = [torch.isfinite(local_part(t)).all().to(device) for t in tensors if t.is_floating_point()]
    bad = (~torch.stack(flags).all()).float() if flags else torch.zeros((), device=device)
    if dist.is_initialized():
        dist.all_reduce(bad)
    return not bool(bad)


def load_full_weights(model: nn.Module, weights: dict) -> None:
    """Shard one process's `weights` (a model.safetensors every rank has read whole) into `model`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Shard one process's optimiser state (an unsharded run's, keyed by parameter index as torch's state_dict)
    into `optimizer` of the sharded `model`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(parameter): name for name, parameter in model.named_parameters()}
    order = [names[id(parameter)] for group in optimizer.param_groups for parameter in group["params"]]
    by_name = {"state": {order[number]: values for number, values in state["state"].items()},
               "param_groups": [{**group, "params": [order[number] for number in group["params"]]}
                                for group in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
