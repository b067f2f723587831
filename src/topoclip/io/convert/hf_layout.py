"""What transformers' model folders share, for its CLIP (topoclip.io.convert.hf) and SigLIP (.siglip) importers:
the file names, the block layout's names, which model a folder holds, and the one reader of a foreign config's
fields."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

from topoclip.core.door import read_json
from topoclip.core.errors import CheckpointError

HF_CONFIG = "config.json"
MERGES = "merges.txt"
VOCAB = "vocab.json"  # the BPE vocabulary beside MERGES
PREPROCESSOR = "preprocessor_config.json"
TOKENIZER_JSON = "tokenizer.json"
# transformers' names of a block's parts -> OpenAI's (q, k, v are joined apart)
BLOCK_RENAMES = {"self_attn.out_proj": "attn.out_proj", "layer_norm1": "ln_1", "layer_norm2": "ln_2",
                 "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}


def hf_model_type(folder: Union[str, Path]) -> Optional[str]:
    """"clip" when `folder` holds a transformers CLIPModel, "siglip" a SiglipModel (its config.json says so), else
    None."""
    file = Path(folder) / HF_CONFIG
    if not file.exists():
        return None
    try:
        config = read_json(file, "transformers config", Path(folder), expect=dict, error=CheckpointError)
    except CheckpointError:  # unreadable, a FIFO, not an object: not a CLIPModel folder (its own reader says why)
        return None
    architectures = config.get("architectures")
    architectures = architectures if isinstance(architectures, list) else []
    for model_type, architecture in (("clip", "CLIPModel"), ("siglip", "SiglipModel")):
        if config.get("model_type") == model_type or architecture in architectures:
            return model_type
    return None


def is_hf_clip(folder: Union[str, Path]) -> bool:
    """Whether `folder` holds a transformers model topoclip imports: a CLIPModel or a SiglipModel."""
    return hf_model_type(folder) is not None


def read_config_json(file: Path) -> dict:
    return read_json(file, "transformers file", file.parent, expect=dict, error=CheckpointError)


def foreign_field(values: dict, key: str, kind: Union[type, tuple], default, where: str):
    """values[key] (or `default` when absent) of a foreign config (transformers', OpenCLIP's), checked to be of `kind`
    (bool is never a number); CheckpointError naming the field otherwise. Every field a foreign config gives is read
    through this."""
    value = values.get(key, default)
    number = kind in (int, float) or (isinstance(kind, tuple) and set(kind) & {int, float})
    if not isinstance(value, kind) or (number and isinstance(value, bool)):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise CheckpointError(f"{where}.{key} is {json.dumps(value)[:60]}, not a {names}; the file is not a model "
                              f"topoclip can import")
    return value
