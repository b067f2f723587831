"""Training logs: metrics.jsonl (always), TensorBoard and W&B (train.report_to), PNG plots at the end.

Every reporter gets the same scalars (each numeric field of each metrics.jsonl record, keyed by its
path, e.g. "eval/shape/distance/top1"), the resolved config at the start and the final evaluation table
at the end. "tensorboard" (the default) writes RUN/tensorboard/ when TensorBoard is installed and is
skipped quietly otherwise; "wandb" must be installed (`pip install "topoclip[wandb]"`; WANDB_MODE=offline
works without a network) and keeps one W&B run per run folder (its id in RUN/wandb-id.txt), so a resumed
run continues the same W&B run.

metrics.jsonl holds one JSON object per line, each flushed as it is logged. A run killed while
writing (or on a full disk) can leave a torn last line; readers skip it, and a resumed run cuts the
file back to its complete records up to the step it resumes from (with a warning).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import warnings
from pathlib import Path
from typing import Optional, Sequence

from topoclip.config import flat_dict
from topoclip.core.door import read_text
from topoclip.core.errors import UserError
from topoclip.core.atomic import save_png_atomic, write_text_atomic
from topoclip.io.run_folder import METRICS, PLOTS, parse_metrics_lines, read_metrics


def truncate_metrics(path: Path, step: int) -> None:
    """Keep only the complete records with step <= `step` (resuming from `step`); replaced atomically.

    Records logged after the checkpoint a run resumes from are about to be logged again, and a torn
    last line would corrupt the next one appended: both are dropped, the torn line with a warning.
    """
    path = Path(path)
    if not path.is_file():
        return
    records, problems = parse_metrics_lines(path)
    if problems:
        warnings.warn(f"{path}: dropped {'; '.join(problems)}; kept {len(records)} complete records", stacklevel=2)
    kept = [r for r in records if r.get("step", 0) <= step]
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


def reporter_scalars(record: dict) -> dict[str, float]:
    """A metrics.jsonl record's numbers under the names TensorBoard and W&B show: "eval/…" for a validation
    evaluation, "test/…" for the final one (the two splits name their sets alike, and the last step has both)."""
    split = "test/" if record.get("final") else "eval/"
    return {(split + key[len("eval/"):] if key.startswith("eval/") else key): value
            for key, value in flat_dict(record, "/").items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


class MetricsLogger:
    """Appends one JSON object per call to run_dir/metrics.jsonl (flushed per line); mirrors scalars to TensorBoard.

    resume_step: cut the file back to the records up to this step first (see `truncate_metrics`).
    """

    def __init__(self, run_dir: Path, enabled: bool = True, resume_step: Optional[int] = None,
                 report_to: Sequence[str] = ("tensorboard",), config: Optional[dict] = None):
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS
        self.writer = self.wandb = None
        self.handle = None
        if not enabled:
            return
        if resume_step is not None:
            truncate_metrics(self.path, resume_step)
        self.handle = self.path.open("a", encoding="utf-8")
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))
                if config is not None:
                    self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", resume_step or 0)
            except ImportError:  # TensorBoard is optional
                self.writer = None
        if "wandb" in report_to:
            self.wandb = start_wandb(Path(run_dir), config or {})

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        # One write of the whole line, then flush: a crash loses at most the line being written.
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()
        step = record.get("step", 0)
        scalars = reporter_scalars(record)
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)
        if self.wandb is not None and scalars:
            self.wandb.log({"step": step, **scalars})  # plotted against "step" (start_wandb), committed at once

    def final_table(self, rows: list[list], columns: list[str], step: int) -> None:
        """The final evaluation table (one row per record) to every reporter (metrics.jsonl has its headline)."""
        if not self.enabled:
            return
        if self.writer is not None:
            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
            self.writer.add_text("final evaluation", "\n".join(lines), step)
        if self.wandb is not None:
            import wandb

            self.wandb.log({"step": step, "final evaluation": wandb.Table(columns=columns, data=rows)})

    def plot(self) -> list[Path]:
        """PNG plots of loss, τ, learning rate and the evaluation metrics; returns their paths."""
        if not self.enabled:
            return []
        return plot_metrics(self.path, self.path.parent / PLOTS)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def start_wandb(run_dir: Path, config: dict):
    """A W&B run for this run folder, the same one again on resume (its id kept in RUN/wandb-id.txt)."""
    try:
        import wandb
    except ImportError:
        raise UserError("train.report_to has \"wandb\" but wandb is not installed: pip install 'topoclip[wandb]' "
                        "(or drop it from train.report_to)") from None
    id_file = run_dir / "wandb-id.txt"
    run_id = read_text(id_file, "W&B run id", run_dir, 100, "replace", UserError).strip() if id_file.exists() else ""
    if not re.fullmatch(r"[a-z0-9]{1,64}", run_id):  # absent, or not an id W&B would take: a new one
        run_id = secrets.token_hex(4)  # W&B ids: [a-z0-9]
    id_file.write_text(run_id)
    try:
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "topoclip"), name=run_dir.name, id=run_id,
                         resume="allow", dir=str(run_dir), config=config)
    except Exception as error:  # no API key, no network, a refused login: W&B's own errors, said in one line
        detail = (str(error).splitlines() or [type(error).__name__])[0][:200]
        raise UserError(f"W&B could not start ({detail}); run `wandb login`, or set WANDB_MODE=offline, or drop "
                        f"\"wandb\" from train.report_to") from None
    # The run's own step is the x-axis, not W&B's row counter: a resumed run logs its steps again from its
    # checkpoint, which W&B's monotonic _step would refuse.
    run.define_metric("*", step_metric="step")
    return run


def number(value) -> bool:
    """A finite-or-not float or int, not a bool: what a plot can draw."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The training record's keys a plot draws beside the loss and beside the curvature, and their legends.
LOSS_PARTS = {"contrastive_loss": "contrastive part", "entailment_loss": "entailment loss (unweighted)"}
HYPERBOLIC = {"curvature": "c (curvature −c)", "alpha_image": "α, image tower", "alpha_text": "α, text tower"}


def plot_metrics(metrics_path: Path, out_dir: Path) -> list[Path]:
    """Draw metrics.jsonl: loss.png, temperature.png, learning_rate.png, evaluation.png (curvature.png: hyperbolic)."""
    import matplotlib

    matplotlib.use("Agg")
    records = read_metrics(metrics_path)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if isinstance(r.get("eval"), dict) and number(r.get("step"))]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def curve(key: str) -> tuple[list, list]:
        """(steps, values) of the training records that hold `key` as a number (a hand-edited line may not)."""
        kept = [r for r in steps if number(r.get("step")) and number(r.get(key))]
        return [r["step"] for r in kept], [r[key] for r in kept]

    written = []
    if steps:
        parts = {label: curve(key) for key, label in LOSS_PARTS.items() if curve(key)[0]}  # MERU's entailment loss
        written += [plot_curves(out_dir / "loss.png", {"loss": curve("loss"), **parts}, "loss"),
                    plot_curves(out_dir / "temperature.png", {"τ = exp(t)": curve("scale")}, "τ"),
                    plot_curves(out_dir / "learning_rate.png", {"lr": curve("lr")}, "learning rate")]
        if curve("curvature")[0]:  # a hyperbolic model's learned c and tower scalings: apart by 10× and more, log
            written.append(plot_curves(out_dir / "curvature.png", {label: curve(key) for key, label in HYPERBOLIC.items()
                                                                   if curve(key)[0]}, "c, α", log=True))
    if evals:
        written.append(plot_evaluation(out_dir / "evaluation.png", evaluation_series(evals)))
    return written


def plot_curves(path: Path, series: dict[str, tuple[list, list]], ylabel: str, log: bool = False) -> Path:
    """PATH: one line per series against the step, on a log axis with `log`; a legend beside the axes when there are
    several."""
    import matplotlib.pyplot as plt

    many = len(series) > 1
    fig, axis = plt.subplots(figsize=(9 if many else 6, 4), dpi=100)
    for label, (x, y) in series.items():
        axis.plot(x, y, label=label, marker="o" if len(x) < 20 else None)
    axis.set_xlabel("step")
    axis.set_ylabel(ylabel)
    if log:
        axis.set_yscale("log")
    if many:  # beside the axes, where it hides no curve
        axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    axis.grid(alpha=0.3)
    fig.tight_layout()
    save_png_atomic(fig, path)
    plt.close(fig)
    return path


def plot_evaluation(path: Path, series: dict[str, dict[str, tuple[list, list]]]) -> Path:
    """PATH: every evaluation metric against the step. Validation (periodic, evaluate.validation_size images per
    set) and test (final, evaluate.size images) are different sets: one colour per metric, a line for validation
    and a star for the final test value, never one line through both."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axis = plt.subplots(figsize=(9, 4), dpi=100)
    metric_handles = []
    for index, (metric, splits) in enumerate(series.items()):
        colour = f"C{index % 10}"
        if "validation" in splits:
            x, y = splits["validation"]
            axis.plot(x, y, color=colour, marker="o" if len(x) < 20 else None, markersize=4)
        if "test" in splits:
            x, y = splits["test"]
            axis.plot(x, y, color=colour, marker="*", markersize=12, linestyle="none")
        metric_handles.append(Line2D([], [], color=colour, label=metric))
    split_handles = [Line2D([], [], color="grey", marker="o", markersize=4, label="validation (during training)"),
                     Line2D([], [], color="grey", marker="*", markersize=12, linestyle="none",
                            label="test (final evaluation)")]
    axis.set_xlabel("step")
    axis.set_ylabel("percent")
    splits_legend = axis.legend(handles=split_handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axis.add_artist(splits_legend)  # beside the axes, where they hide no curve
    axis.legend(handles=metric_handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 0.82))
    axis.grid(alpha=0.3)
    fig.tight_layout()
    save_png_atomic(fig, path)
    plt.close(fig)
    return path


def evaluation_series(evals: list[dict]) -> dict[str, dict[str, tuple[list, list]]]:
    """{metric: {"validation" | "test": (steps, values)}} from the evaluation records of metrics.jsonl.

    A record with "final": true is the test split, every other one the validation split. The split
    suffix of a set's name ("-val" / "-test") is dropped so both splits share a metric name; of the
    template modes, "distance" is kept when a set has both (one per set keeps the figure readable).
    """
    series: dict[str, dict[str, tuple[list, list]]] = {}
    for record in evals:
        split = "test" if record.get("final") else "validation"
        values = record["eval"]
        for key, value in values.items():
            if "/embedding/" in key and key.replace("/embedding/", "/distance/") in values:
                continue
            dataset, _, metric = key.partition("/")
            for suffix in ("-val", "-test"):
                dataset = dataset.removesuffix(suffix)
            metric = metric.removeprefix("distance/").replace("embedding/", "embedding ")
            name = f"{dataset}/{metric}"
            if not number(value):
                continue
            steps, numbers = series.setdefault(name, {}).setdefault(split, ([], []))
            steps.append(record["step"])
            numbers.append(value)
    return series
