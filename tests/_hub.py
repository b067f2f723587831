"""A Hugging Face cache the tests build: a repository's snapshot folder, offline, as huggingface_hub lays it out."""
import json
import os
import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_snapshot(cache: Path, repo_id: str, files: Path = None) -> Path:
    """The snapshot folder of `repo_id` in a Hugging Face cache at `cache` (its refs/main pointing at it), holding a
    copy of every file of the folder `files` when given."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in (files.iterdir() if files is not None else ()):
        (snapshot / file.name).write_bytes(file.read_bytes())
    return snapshot


def offline_env(tmp_path: Path) -> dict:
    """The environment of a subprocess that reads the Hugging Face cache at tmp_path/hub offline, with topoclip's
    cache of converted models at tmp_path/topoclip-cache."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "home"),
            "TOPOCLIP_CACHE": str(tmp_path / "topoclip-cache")}


def with_image_size(folder: Path, copy: Path, size: int) -> Path:
    """A copy of the transformers model folder `folder` at `copy` whose config.json gives the vision tower `size`
    pixels a side (the weights unchanged: only the grid of patches they hold is fixed)."""
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config["vision_config"]["image_size"] = size
    (copy / "config.json").write_text(json.dumps(config))
    return copy
