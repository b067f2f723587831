"""The `topoclip` command: it parses arguments and calls the library; nothing else lives here."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from topoclip.config import ConfigError, describe_preset, load_config, presets

DEFAULT_PRESET = "cpu-multi"


def command_train(args) -> int:
    from topoclip.training.trainer import train

    if args.resume:
        saved = Path(args.resume) / "config.json"
        if not saved.is_file():
            raise ConfigError(f"--resume {args.resume}: no config.json there; give the run folder of an earlier run")
        config = load_config(values=json.loads(saved.read_text()), overrides=args.overrides)
        train(config, resume=args.resume, progress=not args.quiet)
        return 0
    config = load_config(args.preset, args.overrides)
    train(config, out_dir=args.out, progress=not args.quiet)
    return 0


def command_eval(args) -> int:
    import torch

    from topoclip.checkpoint import load_checkpoint
    from topoclip.config import apply_overrides, from_dict, to_dict, validate, Config
    from topoclip.evaluation.run import evaluate, summary_table

    model, tokenizer, config = load_checkpoint(args.checkpoint)
    if args.overrides:  # e.g. evaluate on other sets: --set evaluate.classification='["folder"]'
        config = from_dict(Config, apply_overrides(to_dict(config), args.overrides))
        validate(config)
    if tokenizer is None:
        raise ConfigError(f"{args.checkpoint} has no tokenizer.json; it cannot encode prompts")
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    records = evaluate(model.to(device), tokenizer, config, args.split, device, model_name=args.name or config.name)
    print(summary_table(records))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def command_presets(args) -> int:
    width = max(len(name) for name in presets())
    for name in presets():
        print(f"{name:<{width}}  {describe_preset(name)}")
    return 0


def command_make_shards(args) -> int:
    from topoclip.data.shards import csv_to_shards, write_shards

    if args.csv:
        paths, counter = csv_to_shards(args.csv, args.out, image_key=args.image_key, caption_key=args.caption_key,
                                       samples_per_shard=args.samples_per_shard, image_size=args.image_size)
        print(counter.describe())
    else:
        from topoclip.data.scenes import SceneDataset
        from tqdm.auto import tqdm

        config = load_config(args.preset, args.overrides)
        scenes = SceneDataset(config.data.scenes, args.split)
        count = min(args.count or len(scenes), len(scenes))
        samples = ((scenes[i][0], scenes[i][1], {"index": i, "split": args.split}) for i in tqdm(range(count), desc="render"))
        paths = write_shards(samples, args.out, samples_per_shard=args.samples_per_shard, image_format="png")
    print(f"wrote {len(paths)} shards to {args.out}")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="topoclip", description="Train, evaluate and dissect CLIP models whose "
                                  "embedding topology (sphere, euclidean, product of spheres) is a setting.")
    commands = top.add_subparsers(dest="command", required=True)

    def add_overrides(p):
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set model.class_tokens=16 (repeatable; "
                            "values are JSON: numbers, true/false, [lists], or plain strings)")

    train = commands.add_parser("train", help="train a model (default: the proposed multi-token product-sphere "
                                "model at CPU size on the built-in scenes)")
    train.add_argument("--preset", default=DEFAULT_PRESET, help=f"a preset name (see `topoclip presets`) or a JSON "
                       f"file (default {DEFAULT_PRESET})")
    add_overrides(train)
    train.add_argument("--out", help="run folder (default runs/PRESET-TIMESTAMP)")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(run=command_train)

    evaluate = commands.add_parser("eval", help="zero-shot classification and retrieval of a checkpoint")
    evaluate.add_argument("checkpoint", help="a checkpoint folder, or a run folder (its newest checkpoint)")
    evaluate.add_argument("--json", help="also write the records (CLIP_benchmark-style) to this file")
    evaluate.add_argument("--split", default="test", choices=["val", "test"], help="built-in data split")
    evaluate.add_argument("--device", default="auto")
    evaluate.add_argument("--name", help="model name in the records")
    add_overrides(evaluate)
    evaluate.set_defaults(run=command_eval)

    listing = commands.add_parser("presets", help="list the named presets")
    listing.set_defaults(run=command_presets)

    data = commands.add_parser("data", help="data tools")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    shards = data_commands.add_parser("make-shards", help="write WebDataset tar shards (img2dataset layout) from a "
                                      "CSV of image paths and captions, or from the built-in scenes")
    shards.add_argument("--csv", help="CSV/TSV with image paths and captions (default: render the built-in scenes)")
    shards.add_argument("--image-key", default="filepath")
    shards.add_argument("--caption-key", default="title")
    shards.add_argument("--image-size", type=int, help="resize images so the shorter side is this (CSV only)")
    shards.add_argument("--preset", default=DEFAULT_PRESET, help="scenes: the preset whose data.scenes settings to use")
    shards.add_argument("--split", default="train", choices=["train", "val", "test"])
    shards.add_argument("--count", type=int, default=0, help="scenes: how many samples (default: the whole split)")
    add_overrides(shards)
    shards.add_argument("--samples-per-shard", type=int, default=1000)
    shards.add_argument("--out", required=True, help="output folder")
    shards.set_defaults(run=command_make_shards)
    return top


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, FileNotFoundError) as error:
        print(f"topoclip: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
