"""LoRA (Hu et al., 2021) on a CLIP's towers, through peft, the field's library (`pip install "topoclip[lora]"`).

An adapted weight W (out, in) becomes W + (α/r)·B·A with A (r, in) and B (out, r) trained and W frozen; B starts at
zero, so the adapted model starts as the pretrained one. `add_adapters` puts them, with peft's `get_peft_model`, on
the train.lora_targets of every block of the train.lora_towers:

- `attn.in_proj_weight`, the packed q/k/v projection (3w, w): a parameter, not a layer (the packing OpenAI's
  and OpenCLIP's weights have), which peft adapts through `target_parameters` (its ParamWrapper);
- `attn.out_proj`, `mlp.c_fc`, `mlp.c_proj`: nn.Linear layers, peft's LoRA Linear.

Every other weight of an adapted tower is frozen too; what lies outside the towers (τ, the sigmoid's bias, the
curvature) trains as the run's settings say. A checkpoint keeps
- model.safetensors: `merged_weights`, the CLIP's own names with each adapted weight W + ΔW (peft's own
  get_delta_weight), so every reader (load, eval, export, push, ONNX) sees a plain CLIP and needs no peft;
- lora/: peft's `save_pretrained` (adapter_config.json, adapter_model.safetensors), which
  `peft.PeftModel.from_pretrained(CLIP with the base weights, "…/lora")` loads;
and the run keeps the frozen base weights once (RUN/lora-base), from which a resume rebuilds the adapted model
exactly: base + the checkpoint's adapters + the trained weights outside the towers.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

TOWER_MODULES = {"image": "visual", "text": "text"}  # the towers' attribute names on a CLIP
ADAPTERS = "lora"  # a checkpoint's subfolder of peft's files
PACKED = "attn.in_proj_weight"


def target_names(model: nn.Module, settings) -> tuple[list[str], list[str]]:
    """(module names, parameter names): the full names of what train.lora_targets adapt in train.lora_towers."""
    towers = tuple(TOWER_MODULES[tower] + "." for tower in settings.lora_towers)
    layers = [target for target in settings.lora_targets if target != PACKED]
    modules = [name for name, _ in model.named_modules()
               if name.startswith(towers) and any(name.endswith("." + layer) for layer in layers)]
    parameters = [name for name, _ in model.named_parameters()
                  if PACKED in settings.lora_targets and name.startswith(towers) and name.endswith("." + PACKED)]
    return modules, parameters


def add_adapters(model: nn.Module, settings):
    """Adapters on `model` (changed in place; its forward is the adapted model's) and its adapted towers frozen;
    returns peft's PeftModel around it, which saves the adapters."""
    import peft

    modules, parameters = target_names(model, settings)
    for tower in settings.lora_towers:
        getattr(model, TOWER_MODULES[tower]).requires_grad_(False)
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    # Empty lists, not None: peft fills a None target_modules from a table of transformers' model types
    config = peft.LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
                             target_modules=modules, target_parameters=parameters, bias="none")
    wrapped = peft.get_peft_model(model, config)
    for name, parameter in model.named_parameters():  # peft freezes all but the adapters: keep τ & co. as they were
        if strip(name) in trainable:
            parameter.requires_grad_(True)
    return wrapped


def strip(name: str) -> str:
    """A parameter's name on the CLIP without adapters (peft nests an adapted layer as its base_layer)."""
    return name.replace(".base_layer", "")


def adapter_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{the adapted weight's name on a plain CLIP: its peft layer}."""
    from peft.tuners.lora import LoraLayer

    return {f"{strip(name)}.{getattr(layer, 'parameter_name', None) or 'weight'}": layer
            for name, layer in model.named_modules() if isinstance(layer, LoraLayer)}


def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapted model's weights under a plain CLIP's names: W + ΔW for each adapted weight, the rest as they are."""
    state = model.state_dict()
    merged = {strip(name): tensor.detach() for name, tensor in state.items() if ".lora_" not in name}
    with torch.no_grad():
        for name, layer in adapter_layers(model).items():
            merged[name] = merged[name] + layer.get_delta_weight("default").to(merged[name].dtype)
    return merged


def restore_adapted(wrapped, weights: dict[str, torch.Tensor], folder: Path) -> None:
    """A checkpoint into an adapted model whose frozen base is in place: the adapters from `folder`'s lora/, every
    weight that is not adapted (τ & co., and the frozen rest) from the checkpoint's merged `weights`."""
    model = wrapped.base_model.model
    adapted, own = set(adapter_layers(model)), model.state_dict()
    model.load_state_dict({name: weights[strip(name)] for name in own
                           if ".lora_" not in name and strip(name) not in adapted}, strict=False)
    load_adapters(wrapped, folder / ADAPTERS)


def save_adapters(wrapped, folder: Path) -> Path:
    """peft's adapter_config.json and adapter_model.safetensors in the new folder `folder`; a failed write leaves
    nothing (a full disk is a DiskFullError)."""
    from topoclip.core.errors import DiskFullError, is_disk_full

    try:
        wrapped.save_pretrained(str(folder))
    except (OSError, RuntimeError) as error:
        shutil.rmtree(folder, ignore_errors=True)
        if is_disk_full(error):
            raise DiskFullError(f"no space left on {folder.parent} while writing LoRA adapters", folder.parent) from error
        raise
    return folder


def load_adapters(wrapped, folder: Path) -> None:
    """The adapters of a checkpoint's lora/ (peft's files) into `wrapped`; CheckpointError when they do not fit."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    from topoclip.core.door import regular_file
    from topoclip.core.errors import CheckpointError

    file = folder / "adapter_model.safetensors"
    kinds = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}
    expected = {name: (tuple(tensor.shape), kinds.get(tensor.dtype)) for name, tensor in
                get_peft_model_state_dict(wrapped).items()}
    try:
        regular_file(file, "LoRA adapters", folder.parent, error=CheckpointError)
        with safe_open(str(file), framework="pt") as header:  # names, shapes and types alone: nothing allocated yet
            stored = {name: (tuple(header.get_slice(name).get_shape()), header.get_slice(name).get_dtype())
                      for name in header.keys()}
        if stored != expected:
            wrong = sorted(set(stored) ^ set(expected)) or [name for name in stored if stored[name] != expected[name]]
            raise CheckpointError(f"{file} does not hold this run's adapters ({len(wrong)} differ, e.g. "
                                  f"{wrong[0][:120]}); the checkpoint is damaged or of another run")
        adapters = load_file(str(file))
    except (OSError, SafetensorError) as error:
        raise CheckpointError(f"{file} cannot be read ({error}); the checkpoint is damaged") from None
    try:
        result = set_peft_model_state_dict(wrapped, adapters)
    except RuntimeError as error:  # load_state_dict's size mismatch
        raise CheckpointError(f"{file} does not fit this run's adapters ({str(error).splitlines()[-1][:160]})") from None
    missing = [name for name in result.missing_keys if ".lora_" in name]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{file} does not fit this run's adapters ({len(missing)} missing, "
                              f"{len(result.unexpected_keys)} unexpected: {(missing + result.unexpected_keys)[0]})")


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters) of `model`."""
    counts = [(parameter.numel(), parameter.requires_grad) for parameter in model.parameters()]
    return sum(n for n, trained in counts if trained), sum(n for n, _ in counts)
