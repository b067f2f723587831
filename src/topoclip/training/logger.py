"""Training logs: metrics.jsonl (always), TensorBoard (if installed), PNG plots at the end."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

METRICS = "metrics.jsonl"


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, in order ([] when there is none yet)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Appends one JSON object per call to run_dir/metrics.jsonl; mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, enabled: bool = True, resume_step: Optional[int] = None):
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS
        self.writer = None
        if not enabled:
            return
        if resume_step is not None and self.path.is_file():
            # Lines logged after the checkpoint we resume from are about to be logged again: drop them.
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        except ImportError:  # TensorBoard is optional
            self.writer = None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            step = record.get("step", 0)
            for key, value in flatten(record).items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, step)

    def plot(self) -> list[Path]:
        """PNG plots of loss, τ, learning rate and the evaluation metrics; returns their paths."""
        if not self.enabled:
            return []
        return plot_metrics(self.path, self.path.parent / "plots")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def flatten(record: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}/"))
        else:
            out[prefix + key] = value
    return out


def plot_metrics(metrics_path: Path, out_dir: Path) -> list[Path]:
    """Draw metrics.jsonl: loss.png, temperature.png, learning_rate.png, evaluation.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval" in r]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def figure(name: str, series: dict[str, tuple[list, list]], ylabel: str) -> None:
        many = len(series) > 1
        fig, axis = plt.subplots(figsize=(9 if many else 6, 4), dpi=100)
        for label, (x, y) in series.items():
            axis.plot(x, y, label=label, marker="o" if len(x) < 20 else None)
        axis.set_xlabel("step")
        axis.set_ylabel(ylabel)
        if many:  # beside the axes, where it hides no curve
            axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        axis.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)

    if steps:
        x = [r["step"] for r in steps]
        figure("loss", {"loss": (x, [r["loss"] for r in steps])}, "contrastive loss")
        figure("temperature", {"τ = exp(t)": (x, [r["scale"] for r in steps])}, "τ")
        figure("learning_rate", {"lr": (x, [r["lr"] for r in steps])}, "learning rate")
    if evals:
        series: dict[str, tuple[list, list]] = {}
        for r in evals:
            for key, value in r["eval"].items():
                if "/embedding/" in key:  # one template mode per set keeps the figure readable
                    continue
                # Periodic evaluations read the validation split, the final one the test split:
                # one curve per set either way.
                key = key.replace("-val", "").replace("-test", "").replace("/distance/", "/")
                series.setdefault(key, ([], []))
                series[key][0].append(r["step"])
                series[key][1].append(value)
        figure("evaluation", series, "percent")
    return written
