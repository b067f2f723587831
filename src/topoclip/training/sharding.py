"""Sharded training (train.parallelism=fsdp): PyTorch's FSDP2 (`fully_shard`) over the processes torchrun starts.

Each transformer block is its own FSDP unit, then each tower, then the CLIP, so a block's weights are gathered only
while it runs and each rank keeps 1/W of the parameters, gradients and AdamW moments. The contrastive loss is
untouched: features are gathered across ranks exactly as under DDP (topoclip.distributed.gather_features), so the
loss and the gradients equal the one-process run on the same global batch.

The temperature's scalars (t, and the sigmoid loss's bias) stay whole on every rank: FSDP2 shards along dim 0 and
refuses 0-d parameters. Their gradients are averaged across ranks by a hook, as FSDP's reduce-scatter averages the
rest (and DDP's all-reduce everything).

Checkpoints stay one process's files (model.safetensors, and training_state.pt with the optimiser state keyed by
parameter index, as torch's own state_dict): `full_state` gathers them to rank 0, `load_full_state` shards them
again on any number of ranks, so a run resumes on another world size, or under DDP, unchanged.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from topoclip.transformer import Block

# Low-precision training gathers bf16/fp16 weights (half the traffic) and reduces gradients in fp32; the loss and
# the similarities are fp32 whatever the weights (topoclip.losses), as under autocast.
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shard(model: nn.Module, precision: str) -> nn.Module:
    """`model` (a CLIP) sharded in place over the default process group; returns it. Apply before the optimiser is
    built (it must see the sharded parameters) and after locking (locked weights are sharded too, and have no
    optimiser state)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    policy = MixedPrecisionPolicy(param_dtype=PARAM_DTYPES.get(precision), reduce_dtype=torch.float32)
    for block in [module for module in model.modules() if isinstance(module, Block)]:
        fully_shard(block, mp_policy=policy)
    for tower in (model.visual, model.text):
        fully_shard(tower, mp_policy=policy)
    whole = {parameter for parameter in model.parameters() if parameter.dim() == 0}
    fully_shard(model, mp_policy=policy, ignored_params=whole)
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


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state, optimiser state) of a sharded model as one process's `state_dict()`s, on the CPU of rank 0
    (other ranks get empty dicts). A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    by_name = get_optimizer_state_dict(model, optimizer, options=options)
    if not by_name:
        return weights, {}
    # torch numbers an optimiser's parameters in group order; the sharded state names them instead.
    index = {name: number for number, name in enumerate(name for group in by_name["param_groups"]
                                                          for name in group["params"])}
    return weights, {"state": {index[name]: values for name, values in by_name["state"].items()},
                     "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                                      for group in by_name["param_groups"]]}


def load_full_weights(model: nn.Module, weights: dict) -> None:
    """Shard one process's `weights` (as `full_state` gives them; every rank holds them whole) into `model`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Shard one process's optimiser state (keyed by parameter index, as torch's and `full_state`'s) into
    `optimizer` of the sharded `model`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(parameter): name for name, parameter in model.named_parameters()}
    order = [names[id(parameter)] for group in optimizer.param_groups for parameter in group["params"]]
    by_name = {"state": {order[number]: values for number, values in state["state"].items()},
               "param_groups": [{**group, "params": [order[number] for number in group["params"]]}
                                for group in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
