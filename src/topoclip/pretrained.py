"""Pretrained models by name, as OpenCLIP names them (`MODEL:TAG`, its `--model MODEL --pretrained TAG`).

Each name is a Hugging Face Hub repository in transformers' CLIPModel layout (its weights, config, BPE merges and
pixel statistics side by side; topoclip.convert.hf reads it). `topoclip.load(NAME)`, `topoclip train --pretrained
NAME` and `topoclip pretrained` use this table. The files are fetched on first use into the Hugging Face cache
(HF_HUB_CACHE), where later uses and offline machines (HF_HUB_OFFLINE=1) find them; the model is converted from
them in memory when loaded, and into a topoclip folder under `cache_dir()` when a run starts from it.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from topoclip.atomic import scratch_name
from topoclip.errors import UserError


@dataclass(frozen=True)
class PretrainedModel:
    name: str  # OpenCLIP's MODEL:TAG
    repo: str  # the Hub repository (transformers' CLIPModel layout)
    note: str


PRETRAINED = {entry.name: entry for entry in [
    PretrainedModel("ViT-B-32:openai", "openai/clip-vit-base-patch32", "OpenAI's CLIP, WIT-400M"),
    PretrainedModel("ViT-B-16:openai", "openai/clip-vit-base-patch16", "OpenAI's CLIP, WIT-400M"),
    PretrainedModel("ViT-L-14:openai", "openai/clip-vit-large-patch14", "OpenAI's CLIP, WIT-400M"),
    PretrainedModel("ViT-L-14-336:openai", "openai/clip-vit-large-patch14-336", "OpenAI's CLIP at 336 px"),
    PretrainedModel("ViT-B-32:laion2b_s34b_b79k", "laion/CLIP-ViT-B-32-laion2B-s34B-b79K", "OpenCLIP on LAION-2B"),
    PretrainedModel("ViT-B-16:laion2b_s34b_b88k", "laion/CLIP-ViT-B-16-laion2B-s34B-b88K", "OpenCLIP on LAION-2B"),
    PretrainedModel("ViT-L-14:laion2b_s32b_b82k", "laion/CLIP-ViT-L-14-laion2B-s32B-b82K", "OpenCLIP on LAION-2B"),
    PretrainedModel("ViT-H-14:laion2b_s32b_b79k", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "OpenCLIP on LAION-2B"),
]}


def get_pretrained(name: str) -> PretrainedModel:
    """The entry of `name`; UserError listing the names otherwise."""
    try:
        return PRETRAINED[name]
    except KeyError:
        raise UserError(f"no pretrained model {name!r}; `topoclip pretrained` lists them ({', '.join(PRETRAINED)})") from None


def cache_dir() -> Path:
    """Where converted pretrained models are kept: $TOPOCLIP_CACHE, else ~/.cache/topoclip."""
    return Path(os.environ.get("TOPOCLIP_CACHE") or Path.home() / ".cache" / "topoclip")


def pretrained_folder(name: str, revision: Optional[str] = None) -> Path:
    """A topoclip checkpoint folder of `name`: converted once from the Hub's files and kept under cache_dir()."""
    from topoclip.convert import convert
    from topoclip.inference import hub_folder

    entry = get_pretrained(name)
    folder = cache_dir() / "pretrained" / name.replace(":", "--") / (revision or "main")
    if not (folder / "model.safetensors").is_file():
        snapshot = hub_folder(entry.repo, revision)
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = scratch_name(folder)  # the conversion lands whole or not at all
        convert("hf", snapshot, staging)
        try:
            os.replace(staging, folder)
        except OSError:  # another process converted it meanwhile
            shutil.rmtree(staging, ignore_errors=True)
    return folder
