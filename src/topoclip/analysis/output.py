"""Where analyses put their results: ``OUT/<name>.json`` (the numbers) and ``OUT/<name>*.png`` (plots)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from topoclip.core.atomic import save_png_atomic, write_text_atomic


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, out_dir, name: str) -> Path:
    """Write `figure` to OUT/name.png and close it; returns the path."""
    path = Path(out_dir) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png_atomic(figure, path, dpi=110, bbox_inches="tight")
    pyplot().close(figure)
    return path


def _plain(value: Any) -> Any:
    # Tensors and NumPy values -> lists and floats; NaN/inf -> None (JSON has neither).
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(out_dir, name: str, data: dict) -> Path:
    """Write `data` (tensors and arrays allowed) to OUT/name.json; returns the path."""
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(_plain(data), indent=1))  # renamed into place: a link there is replaced,
    return path  # never written through
