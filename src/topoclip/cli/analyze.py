"""`topoclip analyze …`: the paper's analyses of one trained run or checkpoint."""
from __future__ import annotations

import inspect
from pathlib import Path

from topoclip.cli.common import add_command
from topoclip.core.arguments import add_overrides, number, whole
from topoclip.config import DEFAULT_PRESET, ConfigError, load_config


# --------------------------------------------------------------------------- analyze


def analysis_inputs(args):
    """(Pretrained, out folder) for an analysis of one trained model; the folder defaults to RUN/analysis."""
    from topoclip.analysis.inputs import load_model

    loaded = load_model(args.model, args.device)
    return loaded, out_folder(args.out, loaded.run_dir or loaded.checkpoint)


def out_folder(out, folder) -> Path:
    """--out, else FOLDER/analysis: inside a folder that may be anyone's, so never a link that leads out of it
    (the results would be written wherever it points)."""
    from topoclip.core.door import check_inside
    from topoclip.core.errors import RunFolderError

    if out:
        return Path(out)
    return check_inside(Path(folder) / "analysis", folder, "the analysis folder", RunFolderError)


def analysis_written(name: str, result: dict, out: Path) -> int:
    print(f"wrote {', '.join(result['plots'])} and {name}.json to {out}")
    return 0


def command_analyze_temperature(args) -> int:
    from topoclip.analysis.temperature import analyze_temperature

    out = out_folder(args.out, args.runs[0])
    return analysis_written("temperature", analyze_temperature(args.runs, out, args.window), out)


def command_analyze_similarities(args) -> int:
    from topoclip.analysis.similarities import analyze_similarities

    loaded, out = analysis_inputs(args)
    return analysis_written("similarities", analyze_similarities(loaded, out, args.size), out)


def command_analyze_equilibrium(args) -> int:
    from topoclip.analysis.equilibrium import analyze_equilibrium, output_name

    loaded, out = analysis_inputs(args)
    result = analyze_equilibrium(loaded, out, args.size, args.fractions, args.batch_sizes, draws=args.draws,
                                 seed=args.seed, split=args.split)
    return analysis_written(output_name(args.split), result, out)


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


def command_analyze_hierarchy(args) -> int:
    from topoclip.analysis.hierarchy import analyze_hierarchy

    loaded, out = analysis_inputs(args)
    result = analyze_hierarchy(loaded, out, args.size, args.traversal_images, args.steps)
    return analysis_written("hierarchy", result, out)


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
    from topoclip.io.checkpoint import load_config_from, resolve_checkpoint

    if args.overrides and args.models and not args.preset:
        raise ConfigError("analyze cost: --set applies to each --preset; a folder's settings are its own (the weights' "
                          "shapes)")
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
    from topoclip.analysis.hierarchy import analyze_hierarchy
    from topoclip.analysis.similarities import analyze_similarities
    from topoclip.data.scenes import SPLITS

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
    sub.add_argument("--window", type=whole(1), help="steps τ must stay within 2 %% for (default: one epoch, at most a "
                     "quarter of the run)")
    sub = analysis("similarities", command_analyze_similarities, "histograms of positive and negative similarities, "
                   "in- and out-of-domain, summed and per sub-sphere (paper Fig. 6)")
    sub.add_argument("--size", type=whole(1), default=default_of(analyze_similarities, "size"),
                     help="test pairs per domain (default %(default)s)")
    sub = analysis("equilibrium", command_analyze_equilibrium, "alignment / uniformity term of InfoNCE as τ varies, "
                   "with p %% of captions shuffled and batch size b")
    sub.add_argument("--size", type=whole(1), default=default_of(analyze_equilibrium, "size"),
                     help="pairs to draw batches from (default %(default)s)")
    sub.add_argument("--split", choices=SPLITS, default=default_of(analyze_equilibrium, "split"),
                     help="built-in split the pairs come from, train being the scenes the model trained on (default "
                          "%(default)s; another split writes equilibrium-SPLIT.json)")
    sub.add_argument("--fractions", type=number(0, 1), nargs="+", default=default_of(analyze_equilibrium, "fractions"),
                     help="shuffled shares")
    sub.add_argument("--batch-sizes", type=whole(1), nargs="+", default=default_of(analyze_equilibrium, "batch_sizes"))
    sub.add_argument("--draws", type=whole(1), default=default_of(analyze_equilibrium, "draws"),
                     help="random batches averaged per (b, p)")
    sub.add_argument("--seed", type=whole(0), default=default_of(analyze_equilibrium, "seed"))
    sub = analysis("landscape", command_analyze_landscape, "loss on a random filter-normalised weight plane at "
                   "τ = 1 and 100, and gradient norms along a random direction as τ varies")
    positive = number(0, low_inclusive=False)
    sub.add_argument("--batch-size", type=whole(1), default=default_of(analyze_landscape, "batch_size"))
    sub.add_argument("--resolution", type=whole(1), default=default_of(analyze_landscape, "resolution"),
                     help="grid points per side (odd; default %(default)s)")
    sub.add_argument("--radius", type=positive, default=default_of(analyze_landscape, "radius"),
                     help="the plane spans [−radius, radius]² (default %(default)s)")
    sub.add_argument("--scales", type=positive, nargs="+", default=default_of(analyze_landscape, "plane_scales"),
                     help="τ of the contour planes")
    sub.add_argument("--gradient-scales", type=positive, nargs="+", default=default_of(analyze_landscape, "gradient_scales"))
    sub.add_argument("--gradient-points", type=whole(1), default=default_of(analyze_landscape, "gradient_points"))
    sub.add_argument("--seed", type=whole(0), default=default_of(analyze_landscape, "seed"))
    sub = analysis("gradcam", command_analyze_gradcam, "Grad-CAM of the matching score, total and per class-token "
                   "pair, on image patches and text tokens (paper Fig. 5)")
    sub.add_argument("--examples", type=whole(1), default=default_of(analyze_gradcam, "examples"),
                     help="built-in test pairs to explain (default %(default)s)")
    sub.add_argument("--image", action="append", default=[], help="an image file to explain instead (repeatable)")
    sub.add_argument("--caption", action="append", default=[], help="its caption (one per --image)")
    sub.add_argument("--layer", type=int, default=default_of(analyze_gradcam, "layer"),
                     help="explain the input of this block (default %(default)s, the last)")
    sub.add_argument("--pairs", type=whole(0), default=default_of(analyze_gradcam, "pairs_shown"),
                     help="class-token pairs drawn per example (default %(default)s)")
    sub = analysis("experts", command_analyze_experts, "zero-shot accuracy from random subsets of k of the m "
                   "sub-spheres (paper Table 10)")
    sub.add_argument("--size", type=whole(1), default=default_of(analyze_experts, "size"),
                     help="images per classification set (default %(default)s)")
    sub.add_argument("--draws", type=whole(1), default=default_of(analyze_experts, "draws"),
                     help="random subsets per k (default %(default)s)")
    sub.add_argument("--mode", default=default_of(analyze_experts, "mode"), choices=["distance", "embedding"])
    sub.add_argument("--sets", nargs="+", default=default_of(analyze_experts, "sets"))
    sub.add_argument("--seed", type=whole(0), default=default_of(analyze_experts, "seed"))
    sub = analysis("hierarchy", command_analyze_hierarchy, "generic captions nearer the origin than specific ones, "
                   "and the captions met on the way from an image to the origin (MERU; hyperbolic and Euclidean models)")
    sub.add_argument("--size", type=whole(1), default=default_of(analyze_hierarchy, "size"),
                     help="test scenes, each with a chain of 5 captions from generic to specific (default %(default)s)")
    sub.add_argument("--traversal-images", type=whole(1), default=default_of(analyze_hierarchy, "traversal_images"),
                     help="images walked to the origin (default %(default)s)")
    sub.add_argument("--steps", type=whole(2), default=default_of(analyze_hierarchy, "steps"),
                     help="points on each walk, the image and the origin included (default %(default)s)")
    sub = analysis("probe", command_analyze_probe, "linear probe on the frozen class-token features")
    sub.add_argument("--tasks", nargs="+", default=default_of(analyze_probe, "tasks"))
    sub.add_argument("--train-size", type=whole(1), default=default_of(analyze_probe, "train_size"))
    sub.add_argument("--validation-size", type=whole(1), default=default_of(analyze_probe, "validation_size"))
    sub.add_argument("--test-size", type=whole(1), default=default_of(analyze_probe, "test_size"))
    sub = analysis("cost", command_analyze_cost, "parameters, forward FLOPs (counted, and by the transformer FLOP formula) and "
                   "logit memory of presets or checkpoints", model=False)
    sub.add_argument("models", nargs="*", help="checkpoint or run folders (optional)")
    sub.add_argument("--preset", action="append", help=f"a preset to cost (repeatable; default {DEFAULT_PRESET} "
                     f"when no folder is given)")
    sub.add_argument("--batch-sizes", type=whole(1), nargs="+", default=default_of(analyze_cost, "batch_sizes"))
    add_overrides(sub)  # each preset's; a folder's settings are its own
