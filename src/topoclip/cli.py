"""The `topoclip` command: it parses arguments and calls the library; nothing else lives here.

Each command is a pair of small functions: `add_NAME(commands)` registers its subparser (through
`add_command`, which gives every command `--debug`) and `command_NAME(args)` runs it and returns
the exit status. `COMMANDS` lists the registrations; a new command is one more pair and one entry.

Errors are handled once, in `main()`, for every command: a UserError (a setting, a file, the data,
the disk, the device; ConfigError is one) or an OSError (a missing or unwritable file) prints one
line `topoclip: error: ...` and exits with status 2; anything else is a bug and keeps its
traceback. `--debug` shows the traceback of every error.
"""
from __future__ import annotations

import argparse
import errno
import inspect
import json
import os
import shlex
import sys
from pathlib import Path

from topoclip import __version__
from topoclip.config import DEFAULT_PRESET, ConfigError, describe_preset, load_config, override_value, presets, to_dict
from topoclip.errors import DISK_FULL_ERRNOS, EvaluationSetError, UserError, resolve_device

USER_ERROR_STATUS = 2
INTERRUPTED_STATUS = 130


# --------------------------------------------------------------------------- train


def command_train(args) -> int:
    from topoclip.training.resume import resume_config
    from topoclip.training.trainer import train

    if args.resume:
        if args.preset is not None:
            raise ConfigError("--preset cannot be combined with --resume: a resumed run keeps its saved config; "
                              "change what a resume allows with --set (e.g. --set train.steps=N), or start a new run "
                              "with --preset and a new --out")
        if args.out:
            raise ConfigError("--out cannot be combined with --resume: a resumed run stays in its own folder")
        if args.init_from:
            raise ConfigError("--init-from starts a new run and --resume continues one; give one of them")
        saved = resume_config(args.resume, typed_train_data=override_value(args.overrides, "data.train_data"))
        # Refused here, before anything is written, when an override changes what the checkpoint fixes.
        config = resume_config(args.resume, load_config(values=to_dict(saved), overrides=args.overrides))
    elif args.init_from:
        from topoclip.training.init_from import starting_config

        config = starting_config(args.init_from, args.preset, args.overrides)
    else:
        config = load_config(args.preset or DEFAULT_PRESET, args.overrides)
    if args.print_config:
        print(json.dumps(to_dict(config), indent=2))
        return 0
    train(config, out_dir=args.out, resume=args.resume, progress=not args.quiet)
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


# --------------------------------------------------------------------------- eval


def command_eval(args) -> int:
    from topoclip.checkpoint import load_checkpoint
    from topoclip.config import Config, apply_overrides, from_dict, validate
    from topoclip.evaluation.run import evaluate, no_evaluation_sets, summary_table

    device = resolve_device(args.device, "--device")
    model, tokenizer, config = load_checkpoint(args.checkpoint)
    if args.overrides:  # e.g. evaluate on other sets: --set evaluate.classification='["folder"]'
        config = from_dict(Config, apply_overrides(to_dict(config), args.overrides))
        validate(config)
    if tokenizer is None:
        raise ConfigError(f"{args.checkpoint} has no tokenizer.json; it cannot encode prompts")
    records = evaluate(model.to(device), tokenizer, config, args.split, device, model_name=args.name or config.name)
    if not records:
        raise EvaluationSetError(no_evaluation_sets(config))
    print(summary_table(records))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def add_eval(commands) -> None:
    evaluate = add_command(commands, "eval", command_eval, "zero-shot classification and retrieval of a checkpoint")
    evaluate.add_argument("checkpoint", help="a checkpoint folder, or a run folder (its newest checkpoint)")
    evaluate.add_argument("--json", help="also write the records (CLIP_benchmark-style) to this file")
    evaluate.add_argument("--split", default="test", choices=["val", "test"], help="built-in data split")
    evaluate.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda or cuda:N")
    evaluate.add_argument("--name", help="model name in the records")
    add_overrides(evaluate)


# --------------------------------------------------------------------------- predict


def command_predict(args) -> int:
    from topoclip.inference import DEFAULT_TEMPLATES, load

    labels = [label.strip() for label in args.labels.split(",") if label.strip()]
    if not labels:
        raise ConfigError('--labels needs at least one class name, e.g. --labels "cat,dog"')
    if args.top < 1:
        raise ConfigError(f"--top {args.top}: give how many labels to print per image, at least 1")
    from topoclip.evaluation.zeroshot import check_template

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
    predict.add_argument("--top", type=int, default=5, help="how many labels to print per image (default 5)")
    predict.add_argument("--device", default="cpu", help="cpu (default), auto, cuda or cuda:N")


# --------------------------------------------------------------------------- convert and export


def command_convert(args) -> int:
    from topoclip.convert import convert

    folder = convert(args.source_format, args.source, args.destination, vocab=args.vocab, activation=args.activation,
                     overrides=args.overrides, class_tokens=args.class_tokens, embed_dim=args.embed_dim,
                     noise=args.noise)
    print(f"wrote {folder} (model.safetensors, config.json{', tokenizer.json' if (folder / 'tokenizer.json').is_file() else ''})")
    return 0


def add_convert(commands) -> None:
    from topoclip.convert import FORMATS

    convert = add_command(commands, "convert", command_convert, "import a foreign checkpoint (the authors' release, "
                          "OpenAI, OpenCLIP), and/or upcycle a single-token model to m class tokens; writes a "
                          "topoclip folder (safetensors + config + tokenizer)")
    convert.add_argument("source", help="weights file (.safetensors, .pt, .bin) or folder; a topoclip checkpoint or run "
                         "folder with --from topoclip")
    convert.add_argument("destination", help="new (or empty) folder to write")
    convert.add_argument("--from", dest="source_format", choices=FORMATS, default="topoclip",
                         help="the source's format (default topoclip)")
    convert.add_argument("--vocab", help="its tokenizer: a BERT vocab.txt (mtob), bpe_simple_vocab_16e6.txt.gz "
                         "(openai, openclip) or a tokenizer.json")
    convert.add_argument("--activation", choices=["gelu", "quick_gelu"], help="openclip: the activation the weights "
                         "were trained with, when no open_clip_config.json beside them says it")
    convert.add_argument("--class-tokens", type=int, help="upcycle to this many class tokens (m)")
    convert.add_argument("--embed-dim", type=int, help="upcycle: dimensions per token (n; default the source's)")
    convert.add_argument("--noise", type=float, help="upcycle: noise on the copied tokens, relative (default 0.02)")
    add_overrides(convert)


def command_export(args) -> int:
    from topoclip.checkpoint import load_checkpoint, save_checkpoint
    from topoclip.convert import check_destination
    from topoclip.inference import checkpoint_folder

    if not (args.onnx or args.weights):
        raise ConfigError("say what to export: --onnx DST (ONNX encoders) and/or --weights DST (safetensors folder)")
    model, tokenizer, config = load_checkpoint(checkpoint_folder(args.checkpoint))
    if args.weights:
        save_checkpoint(check_destination(args.weights), model, config, tokenizer)
        print(f"wrote {args.weights} (model.safetensors, config.json{', tokenizer.json' if tokenizer else ''})")
    if args.onnx:
        from topoclip.export_onnx import export_onnx

        print(export_onnx(model, config, tokenizer, args.onnx, check=not args.no_check))
    return 0


def add_export(commands) -> None:
    export = add_command(commands, "export", command_export, "export a checkpoint: ONNX image and text encoders "
                         "(served without PyTorch), or a clean safetensors folder")
    export.add_argument("checkpoint", help="a checkpoint, run or exported folder, or a Hugging Face Hub repo id")
    export.add_argument("--onnx", metavar="DST", help="write image_encoder.onnx, text_encoder.onnx, config.json and "
                        "tokenizer.json into this new folder, checked against PyTorch with onnxruntime")
    export.add_argument("--weights", metavar="DST", help="write model.safetensors, config.json and tokenizer.json "
                        "(no training state) into this new folder")
    export.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")


# --------------------------------------------------------------------------- presets


def command_presets(args) -> int:
    width = max(len(name) for name in presets())
    for name in presets():
        print(f"{name:<{width}}  {describe_preset(name)}")
    return 0


def add_presets(commands) -> None:
    add_command(commands, "presets", command_presets, "list the named presets")


# --------------------------------------------------------------------------- data


def command_make_shards(args) -> int:
    from topoclip.data.shard_writer import csv_to_shards, write_shards

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


def add_data(commands) -> None:
    data = add_command(commands, "data", None, "data tools")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    shards = add_command(data_commands, "make-shards", command_make_shards, "write WebDataset tar shards "
                         "(img2dataset layout) from a CSV of image paths and captions, or from the built-in scenes")
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


# --------------------------------------------------------------------------- analyze and ablate


def analysis_inputs(args):
    """(LoadedModel, out folder) for an analysis of one trained model; the folder defaults to RUN/analysis."""
    from topoclip.analysis.inputs import load_model

    loaded = load_model(args.model, args.device)
    return loaded, Path(args.out or (loaded.run_dir or loaded.checkpoint) / "analysis")


def analysis_written(name: str, result: dict, out: Path) -> int:
    print(f"wrote {', '.join(result['plots'])} and {name}.json to {out}")
    return 0


def command_analyze_temperature(args) -> int:
    from topoclip.analysis.temperature import analyze_temperature

    out = Path(args.out or Path(args.runs[0]) / "analysis")
    return analysis_written("temperature", analyze_temperature(args.runs, out, args.window), out)


def command_analyze_similarities(args) -> int:
    from topoclip.analysis.similarities import analyze_similarities

    loaded, out = analysis_inputs(args)
    return analysis_written("similarities", analyze_similarities(loaded, out, args.size), out)


def command_analyze_equilibrium(args) -> int:
    from topoclip.analysis.equilibrium import analyze_equilibrium

    loaded, out = analysis_inputs(args)
    result = analyze_equilibrium(loaded, out, args.size, args.fractions, args.batch_sizes, draws=args.draws, seed=args.seed)
    return analysis_written("equilibrium", result, out)


def command_analyze_landscape(args) -> int:
    from topoclip.analysis.landscape import analyze_landscape

    loaded, out = analysis_inputs(args)
    result = analyze_landscape(loaded, out, args.batch_size, args.resolution, args.radius, args.scales,
                               args.gradient_scales, args.gradient_points, args.seed)
    return analysis_written("landscape", result, out)


def command_analyze_gradcam(args) -> int:
    from topoclip.analysis.gradcam import analyze_gradcam

    loaded, out = analysis_inputs(args)
    result = analyze_gradcam(loaded, out, args.examples, args.image, args.caption, args.layer, args.pairs)
    return analysis_written("gradcam", result, out)


def command_analyze_experts(args) -> int:
    from topoclip.analysis.experts import analyze_experts

    loaded, out = analysis_inputs(args)
    result = analyze_experts(loaded, out, args.size, args.draws, args.mode, args.sets, args.seed)
    return analysis_written("experts", result, out)


def command_analyze_probe(args) -> int:
    from topoclip.analysis.probe import analyze_probe

    loaded, out = analysis_inputs(args)
    result = analyze_probe(loaded, out, args.tasks, args.train_size, args.validation_size, args.test_size)
    return analysis_written("probe", result, out)


def command_analyze_cost(args) -> int:
    from topoclip.analysis.cost import analyze_cost
    from topoclip.checkpoint import load_config_from, resolve_checkpoint

    configs = [load_config_from(resolve_checkpoint(Path(path))) for path in args.models]
    names = [Path(path).name for path in args.models]
    for preset in args.preset or ([] if args.models else [DEFAULT_PRESET]):
        configs.append(load_config(preset, args.overrides))
        names.append(Path(preset).stem)
    out = Path(args.out or "analysis")
    return analysis_written("cost", analyze_cost(configs, out, args.batch_sizes, names), out)


def default_of(function, parameter: str):
    """The library's default for `parameter` of `function`: an option's default is stated once, in the library."""
    return inspect.signature(function).parameters[parameter].default


def add_analyze(commands) -> None:
    from topoclip.analysis.cost import analyze_cost
    from topoclip.analysis.equilibrium import analyze_equilibrium
    from topoclip.analysis.experts import analyze_experts
    from topoclip.analysis.gradcam import analyze_gradcam
    from topoclip.analysis.landscape import analyze_landscape
    from topoclip.analysis.probe import analyze_probe
    from topoclip.analysis.similarities import analyze_similarities

    analyze = add_command(commands, "analyze", None, "the paper's analyses of a trained run or checkpoint: each "
                          "writes PNG plots and a JSON of the numbers (default into RUN/analysis/)")
    analyses = analyze.add_subparsers(dest="analysis", required=True)

    def analysis(name, run, help, model=True):
        sub = add_command(analyses, name, run, help)
        if model:
            sub.add_argument("model", help="a run folder (its newest checkpoint) or a checkpoint folder")
            sub.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda or cuda:N")
        sub.add_argument("--out", help="output folder (default: RUN/analysis, or CHECKPOINT/analysis outside a run)")
        return sub

    sub = analysis("temperature", command_analyze_temperature, "τ and t over training and the convergence step, "
                   "several runs overlaid (paper Fig. 4)", model=False)
    sub.add_argument("runs", nargs="+", help="run folders (their metrics.jsonl)")
    sub.add_argument("--window", type=int, help="steps τ must stay within 2 %% for (default: one epoch, at most a "
                     "quarter of the run)")
    sub = analysis("similarities", command_analyze_similarities, "histograms of positive and negative similarities, "
                   "in- and out-of-domain, summed and per sub-sphere (paper Fig. 6)")
    sub.add_argument("--size", type=int, default=default_of(analyze_similarities, "size"),
                     help="test pairs per domain (default %(default)s)")
    sub = analysis("equilibrium", command_analyze_equilibrium, "alignment / uniformity term of InfoNCE as τ varies, "
                   "with p %% of captions shuffled and batch size b")
    sub.add_argument("--size", type=int, default=default_of(analyze_equilibrium, "size"),
                     help="test pairs to draw batches from (default %(default)s)")
    sub.add_argument("--fractions", type=float, nargs="+", default=default_of(analyze_equilibrium, "fractions"),
                     help="shuffled shares")
    sub.add_argument("--batch-sizes", type=int, nargs="+", default=default_of(analyze_equilibrium, "batch_sizes"))
    sub.add_argument("--draws", type=int, default=default_of(analyze_equilibrium, "draws"),
                     help="random batches averaged per (b, p)")
    sub.add_argument("--seed", type=int, default=default_of(analyze_equilibrium, "seed"))
    sub = analysis("landscape", command_analyze_landscape, "loss on a random filter-normalised weight plane at "
                   "τ = 1 and 100, and gradient norms along a random direction as τ varies")
    sub.add_argument("--batch-size", type=int, default=default_of(analyze_landscape, "batch_size"))
    sub.add_argument("--resolution", type=int, default=default_of(analyze_landscape, "resolution"),
                     help="grid points per side (odd; default %(default)s)")
    sub.add_argument("--radius", type=float, default=default_of(analyze_landscape, "radius"),
                     help="the plane spans [−radius, radius]² (default %(default)s)")
    sub.add_argument("--scales", type=float, nargs="+", default=default_of(analyze_landscape, "plane_scales"),
                     help="τ of the contour planes")
    sub.add_argument("--gradient-scales", type=float, nargs="+", default=default_of(analyze_landscape, "gradient_scales"))
    sub.add_argument("--gradient-points", type=int, default=default_of(analyze_landscape, "gradient_points"))
    sub.add_argument("--seed", type=int, default=default_of(analyze_landscape, "seed"))
    sub = analysis("gradcam", command_analyze_gradcam, "Grad-CAM of the matching score, total and per class-token "
                   "pair, on image patches and text tokens (paper Fig. 5)")
    sub.add_argument("--examples", type=int, default=default_of(analyze_gradcam, "examples"),
                     help="built-in test pairs to explain (default %(default)s)")
    sub.add_argument("--image", action="append", default=[], help="an image file to explain instead (repeatable)")
    sub.add_argument("--caption", action="append", default=[], help="its caption (one per --image)")
    sub.add_argument("--layer", type=int, default=default_of(analyze_gradcam, "layer"),
                     help="explain the input of this block (default %(default)s, the last)")
    sub.add_argument("--pairs", type=int, default=default_of(analyze_gradcam, "pairs_shown"),
                     help="class-token pairs drawn per example (default %(default)s)")
    sub = analysis("experts", command_analyze_experts, "zero-shot accuracy from random subsets of k of the m "
                   "sub-spheres (paper Table 10)")
    sub.add_argument("--size", type=int, default=default_of(analyze_experts, "size"),
                     help="images per classification set (default %(default)s)")
    sub.add_argument("--draws", type=int, default=default_of(analyze_experts, "draws"),
                     help="random subsets per k (default %(default)s)")
    sub.add_argument("--mode", default=default_of(analyze_experts, "mode"), choices=["distance", "embedding"])
    sub.add_argument("--sets", nargs="+", default=default_of(analyze_experts, "sets"))
    sub.add_argument("--seed", type=int, default=default_of(analyze_experts, "seed"))
    sub = analysis("probe", command_analyze_probe, "linear probe on the frozen class-token features (SPEC §8)")
    sub.add_argument("--tasks", nargs="+", default=default_of(analyze_probe, "tasks"))
    sub.add_argument("--train-size", type=int, default=default_of(analyze_probe, "train_size"))
    sub.add_argument("--validation-size", type=int, default=default_of(analyze_probe, "validation_size"))
    sub.add_argument("--test-size", type=int, default=default_of(analyze_probe, "test_size"))
    sub = analysis("cost", command_analyze_cost, "parameters, forward FLOPs (counted and SPEC §6's formula) and "
                   "logit memory of presets or checkpoints", model=False)
    sub.add_argument("models", nargs="*", help="checkpoint or run folders (optional)")
    sub.add_argument("--preset", action="append", help=f"a preset to cost (repeatable; default {DEFAULT_PRESET} "
                     f"when no folder is given)")
    sub.add_argument("--batch-sizes", type=int, nargs="+", default=default_of(analyze_cost, "batch_sizes"))
    add_overrides(sub)


def recorded_command() -> str:
    """This command line as a results file records it: each absolute path becomes X/<its last part> (the README's
    "X is any folder"), so committed JSON names no folder of the machine that made it; quoted for a shell."""
    def portable(argument: str) -> str:
        option, equals, value = argument.rpartition("=") if argument.startswith("--") else ("", "", argument)
        return option + equals + (f"X/{Path(value).name}" if os.path.isabs(value) else value)

    return shlex.join(["topoclip"] + [portable(a) for a in sys.argv[1:]])


def command_ablate(args) -> int:
    from topoclip.experiments.runner import ablate

    out = Path(args.out or Path("ablations") / Path(args.grid).stem)
    ablate(args.grid, out, seeds=args.seeds, steps=args.steps, overrides=args.overrides, jobs=args.jobs,
           preset=args.preset, probe_size=args.probe_size, cells=args.cells, reuse=args.reuse or (),
           command=recorded_command())
    return 0


def add_ablate(commands) -> None:
    from topoclip.experiments.grid import grid_names

    ablate = add_command(commands, "ablate", command_ablate, "train a named grid of presets × settings × seeds "
                         "(resumable) and tabulate it like the paper's Table 6")
    ablate.add_argument("--grid", required=True, help=f"{', '.join(grid_names())}, or a grid JSON file")
    ablate.add_argument("--seeds", type=int, default=3, help="seeds per cell (default 3)")
    ablate.add_argument("--steps", type=int, help="train.steps of every run (default: the presets')")
    ablate.add_argument("--jobs", type=int, default=1, help="runs trained at once, each in its own process")
    ablate.add_argument("--preset", help="replace every cell's base preset (e.g. tiny for a smoke test)")
    ablate.add_argument("--cells", nargs="+", metavar="PATTERN", help="only the cells whose folder name matches one "
                        "of these shell patterns, e.g. 'sphere_*' 'ps-inner_*' (a reduced grid)")
    ablate.add_argument("--probe-size", type=int, default=1000, help="training images of each run's linear probe "
                        "(0: no probe)")
    ablate.add_argument("--out", help="output folder (default ablations/GRID); re-running it finishes what is missing")
    ablate.add_argument("--reuse", nargs="+", metavar="OUT", help="other ablation folders (e.g. a compare run's): "
                        "their finished runs whose config equals a cell's (name aside) are copied instead of trained")
    add_overrides(ablate)


def command_compare(args) -> int:
    from topoclip.experiments.compare import compare

    compare(args.out, seeds=args.seeds, steps=args.steps, overrides=args.overrides, jobs=args.jobs, preset=args.preset,
            command=recorded_command())
    return 0


def add_compare(commands) -> None:
    compare = add_command(commands, "compare", command_compare, "train the default multi-token model and its sphere "
                          "baseline under the same recipe for N seeds (resumable) and compare them, mean ± std")
    compare.add_argument("--seeds", type=int, default=3, help="seeds per model (default 3)")
    compare.add_argument("--steps", type=int, help="train.steps of every run (default: the presets')")
    compare.add_argument("--jobs", type=int, default=1, help="runs trained at once, each in its own process")
    compare.add_argument("--preset", help="replace both models' base preset (e.g. tiny for a smoke test)")
    compare.add_argument("--out", default="compare", help="output folder (default ./compare); re-running it "
                         "finishes what is missing")
    add_overrides(compare)


# --------------------------------------------------------------------------- the parser and main

# Each entry registers one command's subparser; the order is the order of `topoclip --help`.
COMMANDS = [add_train, add_eval, add_predict, add_convert, add_export, add_presets, add_data, add_analyze,
            add_ablate, add_compare]


def add_command(commands, name: str, run, help: str) -> argparse.ArgumentParser:
    """Register subcommand `name`, run by `run(args) -> exit status`, with the options every command has."""
    command = commands.add_parser(name, help=help, description=help)
    # SUPPRESS: the subcommand's default must not overwrite a `topoclip --debug CMD` given before it.
    command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show the full traceback of any error")
    if run is not None:
        command.set_defaults(run=run)
    return command


def add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set model.class_tokens=16 (repeatable; "
                        "values are JSON: numbers, true/false, [lists], or plain strings)")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="topoclip", description="Train, evaluate and dissect CLIP models whose "
                                  "embedding topology (sphere, euclidean, product of spheres) is a setting.")
    top.add_argument("--version", action="version", version=f"topoclip {__version__}")
    top.add_argument("--debug", action="store_true", help="show the full traceback of any error")
    commands = top.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(commands)
    return top


def describe_error(error: BaseException) -> str:
    """One line for a user error: its message, or for an OSError what failed on which file."""
    if isinstance(error, OSError) and not isinstance(error, UserError) and error.strerror:
        text = f"{error.strerror}: {error.filename}" if error.filename else error.strerror
        if error.errno in DISK_FULL_ERRNOS:
            text += "; free space, then continue the run with --resume"
        elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            text += "; choose a writable location (or make this one writable)"
    else:
        text = str(error) or type(error).__name__
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())  # one line, whatever it held


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("topoclip: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    except BrokenPipeError:  # the reader of our output went away (`topoclip presets | head`): nothing to say
        # Python's recipe: point stdout at devnull so the flush at exit does not fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (UserError, OSError) as error:
        if args.debug:
            raise
        print(f"topoclip: error: {describe_error(error)}", file=sys.stderr)
        return USER_ERROR_STATUS


if __name__ == "__main__":
    sys.exit(main())
