"""`topoclip train`, `eval`, `predict` and `presets`: runs and their models."""
from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path

from topoclip.cli.common import add_command
from topoclip.core.arguments import add_overrides, whole
from topoclip.cli.openclip_flags import add_openclip_flags
from topoclip.config import (DEFAULT_PRESET, ConfigError, describe_preset, load_config, presets, to_dict,
                             validate_readable)
from topoclip.core.errors import EvaluationSetError, UserError, file_name_problem, resolve_device
from topoclip.config.schema import TEMPLATE_MODES


# --------------------------------------------------------------------------- train


def command_train(args) -> int:
    from topoclip.cli.openclip_flags import local_pretrained, local_pretrained_given, overrides, pretrained_name
    from topoclip.data.sources import SourceError, epoch_steps
    from topoclip.core.distributed import launch_rank, launch_world_size
    from topoclip.io.run_folder import RunFolder
    from topoclip.run.training.resume import resume_config
    from topoclip.run.training.trainer import new_run_dir, train

    if args.openclip_name is not None and args.openclip_logs is not None:
        problem = file_name_problem(args.openclip_name)
        if problem:
            raise ConfigError(f"--name {args.openclip_name!r:.80} must be a plain folder name ({problem}): with --logs "
                              f"LOGS it names the run folder LOGS/NAME")
    if args.resume == "latest":  # OpenCLIP's --logs LOGS --name NAME --resume latest: the run LOGS/NAME, continued
        if not (args.openclip_logs and args.openclip_name):
            raise ConfigError("--resume latest is OpenCLIP's (the run LOGS/NAME): give --logs LOGS --name NAME with it, "
                              "or the run folder itself: --resume RUN_FOLDER")
        args.resume, args.openclip_logs = str(Path(args.openclip_logs) / args.openclip_name), None
    if args.openclip_logs is not None:  # OpenCLIP's parent of run folders: said before anything is resolved
        if not args.openclip_logs.strip():
            raise ConfigError("--logs needs a folder (OpenCLIP's parent of run folders), e.g. --logs logs")
        if args.out or args.resume:
            raise ConfigError("--logs is OpenCLIP's parent of run folders; give it or --out (the run folder itself), "
                              "not both" if args.out else "--logs starts a new run; --resume continues one in its "
                              "folder: --resume LOGS/NAME")
        if os.path.lexists(args.openclip_logs) and not Path(args.openclip_logs).is_dir():
            raise ConfigError(f"--logs {args.openclip_logs}: not a folder; give the folder run folders go in "
                              f"(OpenCLIP's parent of run folders; made when missing)")
    if local_pretrained_given(args):
        args.init_from = local_pretrained(args)
        args.openclip_model = args.openclip_pretrained = None
    name = pretrained_name(args)
    if name is not None:
        from topoclip.io.pretrained import get_pretrained, pretrained_folder

        if args.init_from or args.resume:
            raise ConfigError("--pretrained starts a new run from a pretrained model; it cannot be combined with "
                              "--init-from or --resume")
        get_pretrained(name)  # an unknown name is said before anything is fetched
        args.init_from = str(pretrained_folder(name))

    def steps_per_epoch(aliases: list[str]) -> int:  # of the config this run trains with (--epochs)
        if args.init_from:
            from topoclip.run.training.init_from import starting_config

            config = starting_config(args.init_from, args.preset, aliases + args.overrides)
        else:
            config = load_config(args.preset or DEFAULT_PRESET, aliases + args.overrides)
        validate_readable(config.data, config.train.batch_size)  # a table that cannot be read says why, not that it has no epoch
        try:
            return epoch_steps(config.data, config.train.batch_size)
        except SourceError as error:
            raise ConfigError(str(error)) from None

    args.overrides = overrides(args, steps_per_epoch) + args.overrides  # OpenCLIP's flags; --set wins over them
    if args.resume:
        if args.preset is not None:
            raise ConfigError("--preset cannot be combined with --resume: a resumed run keeps its saved config; "
                              "change what a resume allows with --set (e.g. --set train.steps=N), or start a new run "
                              "with --preset and a new --out")
        if args.out:
            raise ConfigError("--out cannot be combined with --resume: a resumed run stays in its own folder")
        if args.init_from:
            raise ConfigError("--init-from starts a new run and --resume continues one; give one of them")
        saved = resume_config(args.resume, overrides=args.overrides)  # the folder's: a command in it refused unless typed
        # train() refuses, before anything is written, an override that changes what the checkpoint fixes.
        config = load_config(values=to_dict(saved), overrides=args.overrides)
    elif args.init_from:
        from topoclip.run.training.init_from import starting_config

        config = starting_config(args.init_from, args.preset, args.overrides)
    else:
        config = load_config(args.preset or DEFAULT_PRESET, args.overrides)
    config = with_imagenet_val(config, args.imagenet_val)
    if args.init_from and not args.resume:  # what train() would refuse, refused before the config is printed too
        from topoclip.run.training.init_from import check_initial_checkpoint

        check_initial_checkpoint(config)
    if args.print_config:
        print(json.dumps(to_dict(config), indent=2))
        return 0
    logs = args.openclip_logs
    # OpenCLIP's --logs DIR --name N trains in DIR/N; without --name, in DIR/NAME-TIMESTAMP (as runs/ by default)
    run_dir = Path(args.resume or args.out or (Path(logs) / config.name if logs and args.openclip_name else
                                               new_run_dir(config, logs or "runs")))

    def on_interrupt():  # (said by rank 0 when Ctrl-C stops it, once it saved a checkpoint to go on from)
        if launch_rank() or not RunFolder(run_dir).step_checkpoints():
            return None
        world = launch_world_size()
        command = ("run the same command" if args.resume else
                   f"run `topoclip train --resume {shlex.quote(str(run_dir))}`")
        return (f"{run_dir} keeps its checkpoints: {command} to continue from the newest"
                + (f", launched as this one was ({world} processes)" if world > 1 else ""))
    args.on_interrupt = on_interrupt
    train(config, out_dir=None if args.resume else run_dir, resume=args.resume, progress=not args.quiet)
    return 0


def add_train(commands) -> None:
    train = add_command(commands, "train", command_train, "train a model (default: the proposed multi-token "
                        "product-sphere model at CPU size on the built-in scenes)")
    train.add_argument("--preset", help=f"a preset name (see `topoclip presets`) or a JSON file "
                       f"(default {DEFAULT_PRESET})")
    add_overrides(train)
    train.add_argument("--out", help="run folder, new or empty (default runs/PRESET-TIMESTAMP)")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint "
                       "(--set may change its steps, lr, cadences, device and evaluation sets)")
    train.add_argument("--init-from", metavar="CHECKPOINT", help="start from this checkpoint's weights and tokenizer "
                       "(e.g. one `topoclip convert` wrote); without --preset the run takes the checkpoint's config")
    train.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit "
                       "(nothing is trained or written)")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    add_imagenet_val(train)
    add_openclip_flags(train)


def add_imagenet_val(parser) -> None:
    parser.add_argument("--imagenet-val", metavar="PATH", help="also evaluate zero-shot ImageNet-1k (CLIP's class "
                        "names and 80 templates) on the synset folders under PATH, as OpenCLIP's --imagenet-val; "
                        "the same as adding imagenet1k=PATH to evaluate.classification")


def with_imagenet_val(config, path):
    """The config with "imagenet1k=PATH" added to its classification sets (once) when --imagenet-val is given."""
    entry = f"imagenet1k={path}"
    if path and entry not in config.evaluate.classification:
        return with_evaluate(config, classification=[*config.evaluate.classification, entry])
    return config


def with_evaluate(config, **changes):
    """The config with `changes` to its evaluate section (a Config is frozen once loaded)."""
    from dataclasses import replace

    return replace(config, evaluate=replace(config.evaluate, **changes))


# --------------------------------------------------------------------------- pretrained


def command_pretrained(args) -> int:
    from topoclip.io.pretrained import PRETRAINED, cache_dir

    width, repo_width = max(len(name) for name in PRETRAINED), max(len(entry.repo) for entry in PRETRAINED.values())
    for entry in PRETRAINED.values():
        cached = (cache_dir() / "pretrained" / entry.name.replace(":", "--")).is_dir()
        layout = "OpenCLIP's files" if entry.layout == "openclip" else "transformers' files"
        print(f"{entry.name:<{width}}  hf-hub:{entry.repo:<{repo_width}}  {entry.note} ({layout})"
              f"{'  (converted here)' if cached else ''}")
    print("\ntopoclip.load(NAME), topoclip train --pretrained NAME (OpenCLIP's --model MODEL --pretrained TAG works "
          "too), topoclip eval/embed/predict NAME")
    return 0


def add_pretrained(commands) -> None:
    add_command(commands, "pretrained", command_pretrained, "list the pretrained models by name, as OpenCLIP names "
                "them (MODEL:TAG); fetched from the Hugging Face Hub on first use")


# --------------------------------------------------------------------------- eval


def command_eval(args) -> int:
    from topoclip.io.checkpoint import load_checkpoint
    from topoclip.run.inference import checkpoint_folder
    from topoclip.config import validate, with_overrides
    from topoclip.run.clip_benchmark import default_template_mode, write_results
    from topoclip.run.evaluation.run import evaluate, no_evaluation_sets, summary_table

    if args.template_mode and not args.output:
        raise ConfigError("--template-mode chooses the mode of --output's CLIP_benchmark files; give --output DIR "
                          "(the records of every mode in evaluate.template_modes go to --json)")
    device = resolve_device(args.device, "--device")
    model, tokenizer, config = load_checkpoint(checkpoint_folder(args.checkpoint))
    # e.g. evaluate on other sets: --set evaluate.classification='["folder"]'
    config = with_overrides(config, args.overrides, "eval")
    config = with_imagenet_val(config, args.imagenet_val)
    if tokenizer is None:
        raise ConfigError(f"{args.checkpoint} has no tokenizer.json; it cannot encode prompts")
    name = args.name or config.name or "topoclip"
    if args.output:  # CLIP_benchmark's files hold one template mode: evaluate it too
        mode = args.template_mode or default_template_mode(config.model.topology)
        if mode not in config.evaluate.template_modes:
            config = with_evaluate(config, template_modes=[*config.evaluate.template_modes, mode])
            validate(config)
    records = evaluate(model.to(device), tokenizer, config, args.split, device, model_name=name)
    if not records:
        raise EvaluationSetError(no_evaluation_sets(config))
    print(summary_table(records))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
        print(f"\nwrote {args.json}")
    if args.output:
        written = write_results(records, args.output, name, args.checkpoint, mode)
        print(f"wrote {len(written)} CLIP_benchmark result files to {args.output} (classification: the {mode!r} "
              f"template mode); tabulate them with `clip_benchmark build {args.output}/*.json`")
    return 0


def add_eval(commands) -> None:
    evaluate = add_command(commands, "eval", command_eval, "zero-shot classification and retrieval of a checkpoint")
    evaluate.add_argument("checkpoint", help="a checkpoint folder, or a run folder (its newest checkpoint)")
    evaluate.add_argument("--json", help="also write every record (all template modes, topoclip's units) to this file")
    evaluate.add_argument("--output", metavar="DIR", help="also write CLIP_benchmark's result files (one per dataset "
                          "and task) to DIR, which `clip_benchmark build` reads")
    evaluate.add_argument("--template-mode", choices=list(TEMPLATE_MODES), help="the template averaging "
                          "of --output's classification results (default: flat, CLIP_benchmark's own, where the "
                          "topology allows it; else distance)")
    evaluate.add_argument("--split", default="test", choices=["val", "test"], help="built-in data split")
    evaluate.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda or cuda:N")
    evaluate.add_argument("--name", help="model name in the records")
    add_overrides(evaluate)
    add_imagenet_val(evaluate)


# --------------------------------------------------------------------------- benchmark


def command_benchmark(args) -> int:
    from topoclip.core.geometry import require_flat
    from topoclip.io.checkpoint import load_config_from, resolve_checkpoint
    from topoclip.run.clip_benchmark import run_clip_benchmark

    arguments = args.arguments[1:] if args.arguments[:1] == ["--"] else args.arguments
    config = load_config_from(resolve_checkpoint(Path(args.checkpoint)))
    try:  # before clip_benchmark is asked for: installing it would not help a model it cannot rank
        require_flat(config.model.topology)
    except ValueError as error:
        raise ConfigError(f"CLIP_benchmark ranks by inner products of flat features: {error}; evaluate it with "
                          f"`topoclip eval`") from None
    return run_clip_benchmark(args.checkpoint, arguments, args.name or config.name or "topoclip")


def add_benchmark(commands) -> None:
    benchmark = add_command(commands, "benchmark", command_benchmark, "run CLIP_benchmark itself on a run: "
                            "`topoclip benchmark RUN -- --dataset cifar10 --dataset_root DIR --no_amp` (needs "
                            "pip install clip_benchmark)")
    benchmark.add_argument("checkpoint", help="a run or checkpoint folder (sphere or ps-inner: CLIP_benchmark ranks "
                           "by inner products of flat features)")
    benchmark.add_argument("--name", help="model name in the result files (default: the config's name)")
    benchmark.add_argument("arguments", nargs=argparse.REMAINDER, help="after --: clip_benchmark eval's own "
                           "options (--dataset, --dataset_root, --task, --batch_size, --output, --no_amp, ...)")


# --------------------------------------------------------------------------- embed


def command_embed(args) -> int:
    from topoclip.run.embed import embed

    args.on_interrupt = f"{args.out} keeps the shards it finished: run the same command to continue after them"
    summary = embed(args.checkpoint, args.out, images=args.images, texts=args.texts, flat=args.flat,
                    image_key=args.image_key, batch_size=args.batch_size, shard_size=args.shard_size,
                    num_workers=args.workers, device=args.device, progress=not args.quiet)
    for kind in ("images", "texts"):
        if kind in summary:
            counts = summary[kind]
            skipped = ", ".join(f"{name} {count}" for name, count in counts["bad"].items()) or "none"
            print(f"{kind}: {counts['kept']} embedded of {counts['inputs']} (skipped: {skipped})")
    print(f"wrote {args.out} (img_emb/, text_emb/: .npy shards and their keys; embed.json)")
    return 0


def add_embed(commands) -> None:
    embed = add_command(commands, "embed", command_embed, "embed images and texts into .npy shards with their keys "
                        "(batched, resumable), as clip-retrieval's inference")
    embed.add_argument("checkpoint", help="a checkpoint, run or exported folder, or a Hugging Face Hub repo id")
    embed.add_argument("--images", help="a folder of images, a CSV/TSV (its --image-key column) or local .tar shards")
    embed.add_argument("--texts", help="a text file, one text per line")
    embed.add_argument("--out", required=True, help="output folder; run again to resume a killed run")
    embed.add_argument("--flat", action="store_true", help="(N, m·n) vectors whose inner product is the model's "
                       "similarity, for an inner-product index (sphere and ps-inner only)")
    embed.add_argument("--image-key", default="filepath", help="the CSV column of image paths (default filepath)")
    embed.add_argument("--batch-size", type=whole(1), default=256)
    embed.add_argument("--shard-size", type=whole(1), default=10_000, help="inputs per shard (default 10000)")
    embed.add_argument("--workers", type=whole(0), default=2, help="image decoding processes (0: in this one)")
    embed.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda or cuda:N")
    embed.add_argument("--quiet", action="store_true", help="no progress bar")


# --------------------------------------------------------------------------- predict


def command_predict(args) -> int:
    from topoclip.run.inference import DEFAULT_TEMPLATES, load

    labels = [label.strip() for label in args.labels.split(",") if label.strip()]
    if not labels:
        raise ConfigError('--labels needs at least one class name, e.g. --labels "cat,dog"')
    if args.top < 1:
        raise ConfigError(f"--top {args.top}: give how many labels to print per image, at least 1")
    from topoclip.run.evaluation.zeroshot import check_template

    for template in args.template or []:  # before a model is loaded
        try:
            check_template(template)
        except UserError as error:
            raise UserError(f"--{error}") from None
    clip = load(args.checkpoint, device=args.device)
    probabilities = clip.classify([Path(image) for image in args.image], labels, args.template or DEFAULT_TEMPLATES)
    top = min(args.top, len(labels))
    for image, row in zip(args.image, probabilities):
        values, indices = row.topk(top)
        print(image)
        for value, index in zip(values.tolist(), indices.tolist()):
            print(f"  {100 * value:6.2f} %  {labels[index]}")
    return 0


def add_predict(commands) -> None:
    predict = add_command(commands, "predict", command_predict, "zero-shot classify images with a checkpoint: "
                          "print the most likely labels")
    predict.add_argument("checkpoint", help="a checkpoint, run or exported folder, or a Hugging Face Hub repo id")
    predict.add_argument("--image", action="append", required=True, help="an image file (repeatable)")
    predict.add_argument("--labels", required=True, help='class names, comma-separated: "cat,dog,car"')
    predict.add_argument("--template", action="append", help='prompt with {} for the label (repeatable; default '
                         '"a photo of a {}."); several are averaged as the paper does')
    predict.add_argument("--top", type=whole(1), default=5, help="how many labels to print per image (default 5)")
    predict.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda or cuda:N")


# --------------------------------------------------------------------------- presets


def command_presets(args) -> int:
    width = max(len(name) for name in presets())
    for name in presets():
        print(f"{name:<{width}}  {describe_preset(name)}")
    return 0


def add_presets(commands) -> None:
    add_command(commands, "presets", command_presets, "list the named presets")
