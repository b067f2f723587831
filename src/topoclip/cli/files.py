"""`topoclip convert`, `export` and `shards`: checkpoints and data in and out."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from topoclip.cli.common import add_command
from topoclip.core.arguments import add_overrides, number, whole
from topoclip.config import DEFAULT_PRESET, ConfigError, load_config


# --------------------------------------------------------------------------- convert and export


def command_convert(args) -> int:
    from topoclip.io.convert import convert

    folder = convert(args.source_format, args.source, args.destination, vocab=args.vocab, activation=args.activation,
                     overrides=args.overrides, class_tokens=args.class_tokens, embed_dim=args.embed_dim,
                     noise=args.noise)
    print(f"wrote {folder} (model.safetensors, topoclip_config.json{', tokenizer.json' if (folder / 'tokenizer.json').is_file() else ''})")
    return 0


def add_convert(commands) -> None:
    from topoclip.io.convert import FORMATS

    convert = add_command(commands, "convert", command_convert, "import a foreign checkpoint (the authors' release, "
                          "OpenAI, OpenCLIP), and/or upcycle a single-token model to m class tokens; writes a "
                          "topoclip folder (safetensors + config + tokenizer)")
    convert.add_argument("source", help="weights file (.safetensors, .pt, .bin) or folder; a topoclip checkpoint or run "
                         "folder with --from topoclip")
    convert.add_argument("destination", help="new (or empty) folder to write")
    convert.add_argument("--from", dest="source_format", choices=FORMATS, default="topoclip",
                         help="the source's format (default topoclip; hf: a transformers CLIPModel or SiglipModel folder)")
    convert.add_argument("--vocab", help="its tokenizer: a BERT vocab.txt (mtob), bpe_simple_vocab_16e6.txt.gz "
                         "(openai, openclip) or a tokenizer.json")
    convert.add_argument("--activation", choices=["gelu", "quick_gelu"], help="openclip: the activation the weights "
                         "were trained with, when no open_clip_config.json beside them says it")
    convert.add_argument("--class-tokens", type=whole(1), help="upcycle to this many class tokens (m)")
    convert.add_argument("--embed-dim", type=whole(1), help="upcycle: dimensions per token (n; default the source's)")
    convert.add_argument("--noise", type=number(0), help="upcycle: noise on the copied tokens, relative (default 0.02)")
    add_overrides(convert)


def command_export(args) -> int:
    from topoclip.io.checkpoint import load_checkpoint, save_checkpoint
    from topoclip.io.convert import check_destination
    from topoclip.run.inference import checkpoint_folder

    if not (args.onnx or args.weights or args.openclip or args.hf):
        raise ConfigError("say what to export: --onnx DST (ONNX encoders), --weights DST (safetensors folder), "
                          "--openclip DST (OpenCLIP's files) and/or --hf DST (transformers' CLIPModel)")
    chosen = {}  # every destination is checked before anything is read or written: new or empty, each its own
    for flag, folder in (("--onnx", args.onnx), ("--weights", args.weights), ("--openclip", args.openclip),
                         ("--hf", args.hf)):
        if folder:
            where = os.path.abspath(folder)
            other = next((other for other in chosen if os.path.commonpath([other, where]) in (other, where)), None)
            if other is not None:
                raise ConfigError(f"{chosen[other]} and {flag} name {'the same folder' if other == where else 'a folder and one inside it'} "
                                  f"({folder}); give each export its own folder")
            chosen[where] = flag
            check_destination(folder)
    model, tokenizer, config = load_checkpoint(checkpoint_folder(args.checkpoint))
    if args.openclip:  # each format's refusal before any other format is written
        from topoclip.io.convert.openclip_export import openclip_refusal, tokenizer_refusal

        reason = openclip_refusal(config) or tokenizer_refusal(config, tokenizer)
        if reason:
            raise ConfigError(f"OpenCLIP cannot load this model: {reason}")
    if args.hf:
        from topoclip.io.convert.hf import hf_refusal

        if hf_refusal(config, tokenizer):
            raise ConfigError(hf_refusal(config, tokenizer))
    if args.openclip:
        from topoclip.io.convert.openclip_export import export_openclip

        export_openclip(model, config, args.openclip, tokenizer)
        print(f"wrote {args.openclip} (open_clip_config.json, open_clip_model.safetensors, tokenizer.json, "
              f"tokenizer_config.json): open_clip.create_model_and_transforms('local-dir:{args.openclip}') and "
              f"open_clip.get_tokenizer('local-dir:{args.openclip}')")
    if args.hf:
        from topoclip.io.convert.hf import export_hf, tokenizer_classes

        export_hf(model, config, args.hf, tokenizer)
        print(f"wrote {args.hf} (config.json, model.safetensors, tokenizer.json, tokenizer_config.json, "
              f"preprocessor_config.json): transformers.CLIPModel.from_pretrained('{args.hf}'); its ids: "
              f"{tokenizer_classes(tokenizer)}")
    if args.weights:
        save_checkpoint(check_destination(args.weights), model, config, tokenizer)
        print(f"wrote {args.weights} (model.safetensors, topoclip_config.json{', tokenizer.json' if tokenizer else ''})")
    if args.onnx:
        from topoclip.io.export_onnx import export_onnx

        print(export_onnx(model, config, tokenizer, args.onnx, check=not args.no_check, flat=args.flat))
    return 0


def add_export(commands) -> None:
    export = add_command(commands, "export", command_export, "export a checkpoint: ONNX image and text encoders "
                         "(served without PyTorch), or a clean safetensors folder")
    export.add_argument("checkpoint", help="a checkpoint, run or exported folder, or a Hugging Face Hub repo id")
    export.add_argument("--onnx", metavar="DST", help="write image_encoder.onnx, text_encoder.onnx, topoclip_config.json and "
                        "tokenizer.json into this new folder, checked against PyTorch with onnxruntime")
    export.add_argument("--weights", metavar="DST", help="write model.safetensors, topoclip_config.json and tokenizer.json "
                        "(no training state) into this new folder")
    export.add_argument("--openclip", metavar="DST", help="write OpenCLIP's open_clip_config.json and "
                        "open_clip_model.safetensors (a sphere model with one class token and an OpenAI-shaped text "
                        "tower; others are refused)")
    export.add_argument("--hf", metavar="DST", help="write transformers' CLIPModel (config.json, model.safetensors) "
                        "with the model's tokenizer and image processor into this new folder (the models --openclip "
                        "takes)")
    export.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")
    export.add_argument("--flat", action="store_true", help="ONNX encoders output (B, m·n) vectors whose inner "
                        "product is the model's similarity, for an inner-product index (sphere and ps-inner only)")


# --------------------------------------------------------------------------- push


def command_push(args) -> int:
    from topoclip.run.hub import push, upload_folder

    if args.dry_run:
        from topoclip.io.convert import check_destination

        folder = upload_folder(args.checkpoint, check_destination(args.dry_run), args.repo_id, args.license)
        print(f"wrote {folder}: what `topoclip push` would upload ({', '.join(sorted(p.name for p in folder.iterdir()))})")
        return 0
    print(f"pushed: {push(args.checkpoint, args.repo_id, args.private, args.license, message=args.message)}")
    return 0


def add_push(commands) -> None:
    push = add_command(commands, "push", command_push, "upload a model to the Hugging Face Hub with a generated model "
                       "card (and OpenCLIP's files where OpenCLIP can load it)")
    push.add_argument("checkpoint", help="a run or checkpoint folder")
    push.add_argument("repo_id", help="org/name (or user/name) on the Hub; created when absent")
    push.add_argument("--private", action="store_true", help="create the repository private")
    push.add_argument("--license", help="the license in the card: needed for a model fine-tuned from another's "
                      "weights (that model's license); default mit for one trained from scratch")
    push.add_argument("--message", default="Upload with topoclip push", help="the commit message")
    push.add_argument("--dry-run", metavar="DIR", help="write what would be uploaded into DIR (new or empty), upload "
                      "nothing")


# --------------------------------------------------------------------------- data


def command_make_shards(args) -> int:
    from topoclip.data.shard_writer import CONVERSION, csv_to_shards, require_empty_folder, shard_pattern, write_shards
    from topoclip.core.errors import UserError

    if args.resume and not args.csv:
        raise UserError("--resume continues a CSV conversion (--csv); built-in scenes are rendered whole into a new --out")
    if "::" in args.out:
        raise UserError(f"--out {args.out} holds '::', which webdataset reads as a separator between shard patterns, so "
                        f"no pattern could name its shards: choose a folder without it")
    if not args.resume and Path(args.out).exists():
        require_empty_folder(args.out)  # before anything is read or rendered (a new folder is made when written)
    if args.csv:
        names = {"path": "--csv", "image_key": "--image-key", "caption_key": "--caption-key", "separator": "--separator"}
        again = "the same command" + ("" if args.resume else " with --resume")
        args.on_interrupt = lambda: (f"{args.out} keeps the shards it finished: run {again} to continue after them"
                                     if (Path(args.out) / CONVERSION).is_file() else None)  # (the conversion began)
        paths, counter = csv_to_shards(args.csv, args.out, image_key=args.image_key, caption_key=args.caption_key,
                                       separator=args.separator, samples_per_shard=args.samples_per_shard,
                                       image_size=args.image_size, resume=args.resume, progress=True, names=names)
        print(counter.describe())
    else:
        from topoclip.data.scenes import SceneDataset
        from tqdm.auto import tqdm

        config = load_config(args.preset, args.overrides)
        scenes = SceneDataset(config.data.scenes, args.split)
        count = min(args.count or len(scenes), len(scenes))
        samples = ((scenes[i][0], scenes[i][1], {"index": i, "split": args.split}) for i in tqdm(range(count), desc="render"))
        paths = write_shards(samples, args.out, samples_per_shard=args.samples_per_shard, image_format="png")
    print(f"{args.out} holds {len(paths)} shards" + (f": {shard_pattern(paths)}" if paths else ""))
    return 0


def separator(text: str) -> str:
    """An argparse type: one character; "\\t" (as typed in a shell) or "tab" is a tab."""
    value = {"\\t": "\t", "tab": "\t"}.get(text, text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not one character (a tab: '\\t' or tab)")
    return value


def command_ceiling(args) -> int:
    import json

    from topoclip.data.scenes.ceiling import retrieval_ceiling

    config = load_config(args.preset, args.overrides)
    settings = config.evaluate
    size = min(settings.size, config.data.scenes.size_of(args.split))
    result = {"preset": args.preset, "overrides": args.overrides, "split": args.split, "size": size,
              "captions_per_image": settings.captions_per_image,
              "ceiling": retrieval_ceiling(config.data.scenes, args.split, size, settings.captions_per_image)}
    text = json.dumps(result, indent=2)
    if args.out:
        from topoclip.core.atomic import write_text_atomic

        write_text_atomic(args.out, text + "\n")
    print(text)
    return 0


def add_data(commands) -> None:
    data = add_command(commands, "data", None, "data tools")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    shards = add_command(data_commands, "make-shards", command_make_shards, "write WebDataset tar shards "
                         "(img2dataset layout) from a CSV of image paths and captions, or from the built-in scenes")
    shards.add_argument("--csv", help="CSV/TSV with image paths and captions (default: render the built-in scenes)")
    shards.add_argument("--image-key", default="filepath")
    shards.add_argument("--caption-key", default="title")
    shards.add_argument("--separator", type=separator, help="the CSV's column separator, one character ('\\t' or tab: "
                        "a tab; default: a tab for .tsv / .tab, else a comma)")
    shards.add_argument("--image-size", type=whole(1), help="resize images so the shorter side is this (CSV only)")
    shards.add_argument("--preset", default=DEFAULT_PRESET, help="scenes: the preset whose data.scenes settings to use")
    shards.add_argument("--split", default="train", choices=["train", "val", "test"])
    shards.add_argument("--count", type=whole(0), default=0, help="scenes: how many samples (default: the whole split)")
    add_overrides(shards)
    shards.add_argument("--samples-per-shard", type=whole(1), default=1000)
    shards.add_argument("--out", required=True, help="output folder")
    shards.add_argument("--resume", action="store_true", help="continue a CSV conversion into --out that stopped "
                        "part-way (the same --csv, byte for byte, and options), after its last finished shard")
    ceiling = add_command(data_commands, "ceiling", command_ceiling, "the recall the Bayes-optimal ranker reaches on "
                          "the built-in retrieval set (the generator's caption probabilities, exactly): the ceiling "
                          "of every R@K and mean recall `topoclip eval` reports on it")
    ceiling.add_argument("--preset", default=DEFAULT_PRESET, help="whose data.scenes and evaluate settings")
    ceiling.add_argument("--split", default="test", choices=["val", "test"])
    ceiling.add_argument("--out", help="also write the JSON to this file")
    add_overrides(ceiling)
