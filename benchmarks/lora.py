"""LoRA against full fine-tuning (issue #62): trainable weights, peak memory, step time, and what each keeps of the
pretrained model's zero-shot on a held-out set, one JSON file.

    python benchmarks/lora.py --out docs/results/lora.json     # a quiet machine; minutes on 2 cores at the defaults

The task: a model pretrained on the built-in scenes (in-domain style, `--preset`, `--pretrain-steps`) is fine-tuned
on a CSV of other scenes of the train split rendered in the out-of-domain style (`--rows` pairs, OpenCLIP's
filepath/title columns), `--steps` steps, once in full (every weight, `--full-lr`) and once with LoRA
(`--rank`, adapters on every block's q/k/v, out, fc and proj of both towers, `--lora-lr`). Each is a `topoclip
train` of its own process, so its peak resident memory (ru_maxrss) is its own. Reported for each:

- trainable weights (the trainer's own count for LoRA; the model's weights for full);
- the peak resident memory of the process, and the median images per second of its logged windows after the first;
- the mean recall of retrieval on the test split in the pretraining's style (held out of the fine-tuning: what is
  *retained*) and in the fine-tuning's style (what is *learnt*), beside the pretrained model's own.

With `--seeds N` (N ≥ 2) the whole of it runs once per seed (`--seed`, `--seed` + 1, …: the pretraining and both
fine-tunes of a seed share it), the figures are the means over seeds (recalls with their standard deviation), and
LoRA − full is a paired t over the seeds for each recall (`topoclip.experiments.statistics.paired`): one seed is a
measurement, not a comparison of the arms' accuracy.

A CPU preset is small enough that peft's own imports outweigh what LoRA saves; so, for `--count-presets` (ViT-B/16 by
default), the weights LoRA trains at `--rank` and the training state each arm holds are *counted* (the model built on
the meta device): fp32 weights, and a gradient and AdamW's two moments for each trained weight.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from topoclip.config import load_config
from topoclip.data.scenes import retrieval_set
from topoclip.experiments.statistics import mean_std, paired

CHILD = ("import resource, sys\nfrom topoclip.cli import main\ncode = main(sys.argv[1:])\n"
         "print('MAXRSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\nsys.exit(code)")
SETS = {"retained": "scenes-test", "learnt": "scenes-test-ood"}


def train(arguments: list[str]) -> dict:
    """One `topoclip train` in a process of its own: {"peak_mib", "output"}."""
    done = subprocess.run([sys.executable, "-c", CHILD, "train", *arguments], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"topoclip train {' '.join(arguments)} failed:\n{done.stderr[-2000:]}")
    peak = int(re.search(r"MAXRSS_KIB (\d+)", done.stdout).group(1)) / 1024
    return {"peak_mib": round(peak, 1), "output": done.stdout}


def recalls(run: Path, scenes: Path) -> dict:
    """Mean recall of `run`'s model on the scenes' test retrieval, both styles, as the run `scenes` evaluates them
    (a run on a CSV evaluates no scenes of its own)."""
    import topoclip
    from topoclip.run.evaluation.run import evaluate

    clip = topoclip.load(run)
    records = evaluate(clip.model, clip.tokenizer, topoclip.load(scenes).config, "test", torch.device("cpu"))
    by_name = {record["dataset"]: record["metrics"]["mean_recall"] for record in records
               if record["task"] == "zeroshot_retrieval"}
    return {key: round(by_name[name], 2) for key, name in SETS.items()}


def speed(run: Path) -> float:
    rates = [json.loads(line)["images_per_s"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if '"images_per_s"' in line]
    return round(statistics.median(rates[1:] or rates), 1)


def count_state(preset: str, rank: int) -> dict:
    """Weights, those LoRA trains at `rank`, and each arm's training state in MiB (fp32 weights; a gradient and
    AdamW's two moments, fp32, for each trained weight), from the model built on the meta device."""
    from topoclip.model.clip import CLIP
    from topoclip.model.lora import add_adapters, trainable_count

    config = load_config(preset, [f"train.lora_rank={rank}"])
    with torch.device("meta"):
        model = CLIP(config.model)
        weights = sum(parameter.numel() for parameter in model.parameters())
        add_adapters(model, config.train)
    trained, total = trainable_count(model)
    mib = 4 / 2**20
    return {"preset": preset, "weights": weights, "lora_trainable": trained,
            "full_state_mib": round(weights * 4 * mib, 1), "lora_state_mib": round((total + 3 * trained) * mib, 1)}


def write_table(folder: Path, rows: int, preset: str) -> Path:
    """`rows` scenes of the train split in the out-of-domain style as PNG files and a CSV (filepath, title)."""
    from PIL import Image

    scenes = load_config(preset).data.scenes
    pairs = retrieval_set(scenes, "train", rows, captions_per_image=1, style="out-of-domain")
    lines = ["filepath,title"]
    for index, (image, caption) in enumerate(zip(pairs.images, pairs.captions)):
        Image.fromarray(image).save(folder / f"{index}.png")
        lines.append(f'{index}.png,"{caption}"')
    (folder / "pairs.csv").write_text("\n".join(lines) + "\n")
    return folder / "pairs.csv"


def one_seed(args: argparse.Namespace, seed: int, scratch: Path) -> dict:
    """The pretraining and both fine-tunes at one seed: {"seed", "pretrained", "arms"}."""
    common = ["--set", f"train.threads={args.threads}", "--set", "evaluate.size=500", "--set", "train.eval_every=0",
              "--set", f"train.seed={seed}", "--set", "train.report_to=[]", "--workers", "0"]
    pretrained = scratch / "pretrained"
    train(["--preset", args.preset, "--out", str(pretrained), "--set", f"train.steps={args.pretrain_steps}", *common])
    table = write_table(scratch, args.rows, args.preset)
    tune = ["--init-from", str(pretrained), "--train-data", str(table), "--batch-size", str(args.batch),
            "--set", f"train.steps={args.steps}", "--set", "train.warmup_steps=30", *common]
    arms = {}
    for arm, extra in (("full", ["--set", f"train.lr={args.full_lr}"]),
                       ("lora", ["--set", f"train.lr={args.lora_lr}", "--set", f"train.lora_rank={args.rank}"])):
        run = scratch / arm
        result = train([*tune, *extra, "--out", str(run)])
        said = re.search(r"([\d,]+) of [\d,]+ weights train", result["output"])  # the trainer's count (LoRA)
        trainable = int(said.group(1).replace(",", "")) if said else count_state(args.preset, args.rank)["weights"]
        arms[arm] = {"trainable": trainable, "peak_mib": result["peak_mib"], "images_per_s": speed(run),
                     **recalls(run, pretrained)}
    return {"seed": seed, "pretrained": recalls(pretrained, pretrained), "arms": arms}


def over_seeds(runs: list[dict]) -> dict:
    """The runs' means (recalls also with their standard deviation) and, from two seeds on, LoRA − full per recall
    as a paired t over the seeds."""
    def mean(values: list[float]) -> float:
        return round(sum(values) / len(values), 2)

    parts = {"pretrained": [run["pretrained"] for run in runs],
             **{arm: [run["arms"][arm] for run in runs] for arm in ("full", "lora")}}
    means = {part: {key: entries[0][key] if key == "trainable" else mean([entry[key] for entry in entries])  # same at every seed
                    for key in entries[0]} for part, entries in parts.items()}
    figures = {"pretrained": means.pop("pretrained"), "arms": means}
    if len(runs) > 1:
        figures["sd"] = {part: {key: round(mean_std([entry[key] for entry in entries])[1], 2) for key in SETS}
                         for part, entries in parts.items()}
        figures["lora_minus_full"] = {key: paired([entry[key] for entry in parts["lora"]],
                                                  [entry[key] for entry in parts["full"]]).as_dict() for key in SETS}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the figures here (JSON)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--pretrain-steps", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=300, help="fine-tuning steps of each arm")
    parser.add_argument("--rows", type=int, default=2000, help="pairs in the fine-tuning CSV")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--full-lr", type=float, default=1e-4)
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--seeds", type=int, default=1, help="how many seeds, from --seed on (≥ 2 for a comparison)")
    parser.add_argument("--count-presets", default="sphere-vit-b16", help="comma-separated presets to count")
    parser.add_argument("--quiet-machine", choices=["yes", "no"], required=True,
                        help="whether nothing else ran beside it (the memory and speed figures need it)")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    runs = []
    for seed in range(args.seed, args.seed + args.seeds):
        with tempfile.TemporaryDirectory() as scratch:
            runs.append(one_seed(args, seed, Path(scratch)))
        print(f"seed {seed}: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "quiet_machine")}
    figures = {"about": "benchmarks/lora.py: LoRA against full fine-tuning of a model pretrained on the scenes, "
                        "on a CSV of out-of-domain scenes; mean recall on in-domain (retained) and out-of-domain "
                        "(learnt) test retrieval", "command": "python benchmarks/lora.py " + " ".join(sys.argv[1:]),
               "torch": torch.__version__, "quiet_machine": args.quiet_machine == "yes", "settings": settings,
               **over_seeds(runs), "runs": runs,
               "counted": [count_state(name, args.rank) for name in args.count_presets.split(",") if name]}
    print(json.dumps(figures, indent=2))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
