"""The benchmarks' tables: the GPU check, FSDP's memory, the data loader, a CSV's rows."""
from __future__ import annotations

import re

from topoclip.experiments.statistics import Difference

# An epoch of at least this many samples holds no epoch's start in a shards-against-random run, which draws a few
# hundred batches at most (shard_throughput.py's steady state asks for 10^8, its short epochs for --samples, 8,192).
STEADY_STATE_SAMPLES = 10**6
# A row from before the benchmark recorded its epochs ran shard_throughput.py's --samples default, 8,192 samples an epoch.
OLD_ROW_SAMPLES = 8192

# A block is rendered by its name's entry, a trailing step count aside (equilibrium-9600 as equilibrium,
# equilibrium-train-19200 as equilibrium-train);
# blocks named NAME-tests are comparison tables (comparison_table); any other name is an ablation.
def tests_line(output: str) -> str:
    """pytest's closing counts ("1 failed, 11 passed") from the tail of its output."""
    counts = re.findall(r"((?:\d+ \w+, )*\d+ \w+) in [\d.]+s", output)[-1]
    return re.sub(r", \d+ warnings?", "", counts)


def gpu_check_table(result: dict) -> str:
    """The GPU check (benchmarks/gpu_check.py) as the files.README shows it: what ran, the ViT-B/16 step, the data path."""
    check = result["check"]
    steps = check["steps"]
    training = steps["training"]
    statuses = ", ".join(f"{name} {step['status']}" for name, step in training.items())
    summary = {(line["model"], line["preset"], name): line for name in ("step_eager", "step_compiled")
               for line in steps[name]["json"] if line.get("benchmark") == "mfu"}
    rows = ["| bf16, batch 256 | sphere-vit-b16 | multi-32x16-vit-b16 | Multi's cost |", "|---|---|---|---|"]
    for name, label in (("step_eager", "eager"), ("step_compiled", "`torch.compile`")):
        cells = []
        for preset in ("sphere-vit-b16", "multi-32x16-vit-b16"):
            ours, theirs = summary[("topoclip", preset, name)], summary[("open_clip ViT-B-16", preset, name)]
            cells.append(f"{ours['median_images_per_s']:,.0f} img/s, MFU {100 * ours['mfu']:.1f} %, "
                         f"{ours['ratio_to_open_clip']:.2f}× OpenCLIP ({theirs['median_images_per_s']:,.0f})")
        sphere, multi = (summary[("topoclip", preset, name)]["median_images_per_s"]
                         for preset in ("sphere-vit-b16", "multi-32x16-vit-b16"))
        rows.append(f"| {label} | {cells[0]} | {cells[1]} | {100 * (1 - multi / sphere):.1f} % |")
    resume = training.get("resume_losses")
    resumed = (f"The run killed with SIGKILL and resumed matched the uninterrupted run's losses at "
               f"{resume['steps_compared']} logged steps (largest relative difference "
               f"{resume['largest_relative_difference']:g}; bound {resume['bound']:g})." if resume else
               "The losses of the killed and resumed run were not compared (a run did not finish).")
    shards = [line for line in steps["shards_vs_random"]["json"] if line.get("benchmark") == "shard_throughput"]
    shards += result["after"]["shards_vs_random"]
    feeding = ", ".join(f"{line['num_workers']} workers {line['shard_to_random']:.2f} "
                        f"({line['shards_images_per_s'] / line['num_workers']:,.0f} images/s per worker)"
                        for line in shards)
    return "\n".join([
        f"Measured: `benchmarks/gpu_check.py` on one {check['gpu']}, torch {check['torch']}, {check['date'][:10]}; "
        f"MFU against the bf16 matmul peak measured in the same run "
        f"({summary[('topoclip', 'sphere-vit-b16', 'step_eager')]['peak_tflop_per_s']:.0f} TFLOP/s).", "",
        *rows, "",
        f"- Training on the GPU: {statuses}. {resumed}",
        f"- `gpu` tests: {tests_line(steps['gpu_tests']['tail'])} in the check; "
        f"{result['after']['gpu_tests']['failed_first'].split(':')[0]} failed and passes after the fix "
        f"({result['after']['gpu_tests']['fix']}).",
        f"- The trainer's data path (256-px JPEG shards) against random tensors, shards/random: {feeding}.",
    ])


def epoch(line: dict) -> str:
    """A shards-against-random row's epochs: longer than the run (shard_throughput.py's default, 10^8 samples, the
    steady state), or how many batches and whether the loader's workers outlived them (a row without the fields is from
    before SharedEpoch: OLD_ROW_SAMPLES a run, the workers started again each)."""
    samples = line.get("samples_per_epoch") or OLD_ROW_SAMPLES
    if samples >= STEADY_STATE_SAMPLES:
        return "longer than the run"
    return f"{samples // line['batch']} batches, workers {'kept' if line.get('workers_kept') else 'started again'}"


def lease_note(lease: str) -> str:
    """A later lease's footnote from its record ("YYYY-MM-DD HH:MM[:SS] UTC (what)"), or the record as it is."""
    found = re.fullmatch(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2})(?::\d{2})? UTC \((.+)\)", lease.strip())
    return f"- The lease of {found[1]}: {found[2]}." if found else f"- A lease: {lease}."


def gpu_feeding_table(result: dict) -> str:
    """Issue #59's GPU steps (docs/results/gpu-feeding.json): NCCL, the data path against random tensors by workers
    and batches queued, the compiled step's busy share, FSDP's memory on the GPU, the loader alone."""
    rows = ["| lease | an epoch | workers | batches queued | model threads | random tensors | shards | shards ÷ random "
            "(range) | the step's wait for the loader |", "|---|---|---|---|---|---|---|---|---|"]
    for line in result["shards_vs_random"]:
        wait = line.get("loader_wait_ms_per_step")
        rows.append(f"| {line.get('lease', result['date'])[:16]} | {epoch(line)} | {line['num_workers']} | "
                    f"{line['batches_in_flight']} | {line['threads']} | "
                    f"{line['random_images_per_s']:,.0f} img/s | {line['shards_images_per_s']:,.0f} img/s | "
                    f"{line['shard_to_random']:.2f} ({line['ratio_range'][0]:.2f}–{line['ratio_range'][1]:.2f}) | "
                    f"{'—' if wait is None else f'{wait:.0f} ms'} |")
    nccl = ", ".join(f"{name.removeprefix('nccl_').upper()} {entry['status']}" for name, entry in result["nccl"].items())
    busy = "; ".join(f"{line['preset']} {line['wall_ms_per_step']:.1f} ms a step, the GPU idle "
                     f"{100 * line['idle_fraction']:.1f} %" for line in result["profiles"])
    memory = ", ".join(f"{line['parallelism'].upper()} {line['per_rank'][0]['peak_device'] / 1024**3:.2f} GiB"
                       for line in result["fsdp_memory"])
    loader = result["loader"]
    ms = lambda value, digits: "not timed" if value is None else f"{value:.{digits}f} ms"  # noqa: E731
    alone = "; ".join(f"{row['workers']} worker{'s' * (row['workers'] > 1)}"
                      f"{' pinned' if row['pinned'] else ' unpinned'} {row['images_per_s']:,.0f} img/s (taking "
                      f"{ms(row['main_ms_per_batch'], 2)}" + (f", pinning {ms(row.get('pin_ms_per_batch'), 1)}"
                                                              if row["pinned"] else "")
                      + f", copy and normalisation on the GPU {ms(row['device_ms_per_batch'], 1)} a batch)"
                      for row in loader["rows"])
    first = result["shards_vs_random"][0]
    leases = dict.fromkeys(line["lease"] for line in result["shards_vs_random"] if "lease" in line)
    return "\n".join([
        f"Measured on one {result['gpu']}, torch {result['torch']}, in the leases of the first column "
        f"({first['cpu_count']} CPU cores): {first['preset']}, bf16, batch {first['batch']}, compiled, on 256-px JPEG "
        "shards against random tensors on the GPU:", "", *rows, "",
        *map(lease_note, leases), "",
        f"- Over NCCL (one process): {nccl}. FSDP's memory benchmark on the GPU (batch "
        f"{result['fsdp_memory'][0]['batch']}, peak): {memory}.",
        f"- The compiled step profiled: {busy}.",
        f"- The loader alone there (`{loader['command']}`), batches of {loader['batch']}: {alone}; {loader['cut']}.",
    ])


def fsdp_memory_table(result: dict) -> str:
    """benchmarks/fsdp_memory.py's launches: per-rank bytes of DDP and FSDP and the largest model a budget holds."""
    gib, budget = 1024**3, result["budget_gib"]
    first = result["launches"][0]
    rows = [f"Measured: `{result['command']}` ({first['preset']}, {first['parameter_count'] / 1e6:.1f} M parameters, "
            f"fp32 AdamW, one step of batch {first['batch']}) on {result['machine']}, torch {result['torch']}. GiB on "
            "the rank that holds the most; the largest model counts parameters, gradients and AdamW state only "
            "(activations and FSDP's gathered block come on top):", "",
            f"| | processes | parameters | gradients | AdamW state | together | peak RSS | largest model in "
            f"{budget:g} GiB per rank |", "|---|---|---|---|---|---|---|---|"]
    for launch in result["launches"]:
        held = max(launch["per_rank"], key=lambda rank: rank["parameters"] + rank["gradients"] + rank["optimizer"])
        total = held["parameters"] + held["gradients"] + held["optimizer"]
        largest = budget * gib / (total / launch["parameter_count"])
        rows.append(f"| {launch['parallelism']} | {launch['world']} | {held['parameters'] / gib:.3f} | "
                    f"{held['gradients'] / gib:.3f} | {held['optimizer'] / gib:.3f} | {total / gib:.3f} | "
                    f"{held['peak_rss'] / gib:.2f} | {largest / 1e9:.1f} B parameters |")
    return "\n".join(rows)


def loader_table(result: dict) -> str:
    """benchmarks/loader.py: images a second one DataLoader worker delivers to the training loop, topoclip's path
    beside the baseline commit's and OpenCLIP's, and the workers the measured GPU step needs."""
    paths = list(next(iter(result["sizes"].values()))["paths"])
    gpu = result.get("gpu_step") or {}
    rows = [f"Measured: `{result['command']}` on {result['machine']} ({result['cores']} cores; {result['note']}), "
            f"batches of {result['batch']}, {result['image_size']} px crops, the median of {result['rounds']} rounds: "
            f"images per second one worker delivers (the whole path: tar, decode, crop, tokenize, the pipe).", ""]
    header = "| shorter side (bits/pixel) | " + " | ".join(paths) + " | topoclip ÷ " + " | topoclip ÷ ".join(
        paths[1:]) + " |" + (f" workers for {gpu['images_per_s']:,.0f} img/s (topoclip, {paths[-1]}) |" if gpu else "")
    rows += [header, "|---" * (2 * len(paths) + bool(gpu)) + "|"]
    for size, entry in result["sizes"].items():
        per_worker = [entry["paths"][name]["per_worker"] for name in paths]
        ratios = [per_worker[0] / other for other in per_worker[1:]]
        cells = [f"{value:,.0f}" for value in per_worker] + [f"{ratio:.1f}×" for ratio in ratios]
        if gpu:
            workers = entry["workers_for_the_gpu_step"]
            cells.append(f"{workers[paths[0]]}, {workers[paths[-1]]}")
        rows.append(f"| {size} px ({entry['bits_per_pixel']:.1f}) | " + " | ".join(cells) + " |")
    if gpu:
        rows += ["", f"The GPU step: {gpu['preset']}, {gpu['precision']}, batch {gpu['batch']}, compiled, on random "
                     f"tensors, {gpu['images_per_s']:,.0f} img/s on an {gpu['gpu']} ({gpu['source']}); the workers "
                     f"it needs are that rate over one worker's, on cores like these."]
    return "\n".join(rows)


def csv_rows_table(result: dict) -> str:
    """benchmarks/csv_rows.py: what a CSV's rows cost a DataLoader worker, as Python strings and packed."""
    columns = ("in-process MiB", "peak while reading MiB", "copied per forked reader MiB", "pickled MiB", "pickle s",
               "unpickle s")
    rows = [f"Measured: `{result['command']}` ({result['rows']:,} rows) on {result['machine']}, torch {result['torch']}:", "",
            "| rows held as | in the process (MiB) | at most while reading (MiB) | copied by each forked worker that reads "
            "them (MiB) | pickled for a fork-server worker (MiB) | pickle (s) | unpickle (s) |", "|---|---|---|---|---|---|---|"]
    rows += [f"| {line['rows as']} | " + " | ".join(f"{line[column]:g}" for column in columns) + " |"
             for line in result["results"]]
    return "\n".join(rows)


def topology_cost_table(result: dict) -> str:
    """benchmarks/topology_cost.py: the similarity and loss of every topology alone, and whole CPU training steps."""
    batches = sorted({row["batch"] for row in result["scoring"]})
    scoring = {(row["topology"], row["batch"]): row for row in result["scoring"]}
    topologies = list(dict.fromkeys(row["topology"] for row in result["scoring"]))
    quiet = "a quiet machine" if result["quiet_machine"] else "a busy machine (figures indicative only)"
    rows = [f"Measured by `benchmarks/topology_cost.py` on {quiet}, {result['threads']} threads, torch {result['torch']}.",
            "", "Similarity + symmetric InfoNCE, forward and backward, of a batch against itself (milliseconds, the "
            "median; ×: against `sphere` for one vector, against `ps-inner` for the products):", "",
            "| topology | (m, n) | " + " | ".join(f"B = {batch:,}" for batch in batches) + " |",
            "|---|---" + "|---" * len(batches) + "|"]
    for name in topologies:
        first = scoring[(name, batches[0])]
        base = "ps-inner" if first["m"] > 1 else "sphere"
        cells = [f"{scoring[(name, b)]['milliseconds']:,.1f}" + ("" if name == base else
                 f" ({scoring[(name, b)]['milliseconds'] / scoring[(base, b)]['milliseconds']:.1f}×)") for b in batches]
        rows.append(f"| `{name}` | ({first['m']}, {first['n']}) | " + " | ".join(cells) + " |")
    rounds = len(result["steps"][0].get("rounds_images_per_s", [0]))
    rows += ["", "A whole training step (forward, backward, AdamW) of the CPU presets, batch 128, random inputs "
                 f"(`benchmarks/train_step.py`): the median step of a run, the median (and range) of {rounds} "
                 "round(s) of the four in turn:", "",
             "| preset | settings | images / s | against its baseline |", "|---|---|---|---|"]
    baseline = {}
    for step in result["steps"]:
        images = step["median_images_per_s"]
        spread = step.get("rounds_images_per_s", [images])
        ratio = "" if not step["overrides"] else f"{images / baseline[step['preset']] - 1:+.0%}"
        baseline.setdefault(step["preset"], images)
        settings = ", ".join(f"`{item}`" for item in step["overrides"]) or "as the preset"
        rows.append(f"| `{step['preset']}` | {settings} | {images:,.0f} ({min(spread):,.0f}–{max(spread):,.0f}) | "
                    f"{ratio} |")
    return "\n".join(rows)


def gpu_hyperbolic_table(result: dict) -> str:
    """The ViT-B/16 step of each hyperbolic family beside its twin on one GPU (docs/results/gpu-hyperbolic.json):
    images/s eager and compiled, the median and range of the rounds, and the cost against the twin."""
    steps, cells, twins = result["steps"], {}, {}
    for step in steps:
        topology = next((item.split("=", 1)[1] for item in step["overrides"] if item.startswith("model.topology=")),
                        None)
        key = (step["preset"], topology or "as the preset")
        cells.setdefault(key, {})[bool(step["compile"])] = step
        if topology is None:
            twins[step["preset"]] = cells[key]

    def cell(row: dict, compiled: bool, twin: dict) -> str:
        step = row.get(compiled)
        if step is None:
            return "not timed"
        rounds = step["rounds_images_per_s"]
        text = f"{step['median_images_per_s']:,.0f} ({min(rounds):,.0f}–{max(rounds):,.0f})"
        if step["overrides"] and compiled in twin:
            text += f", {step['median_images_per_s'] / twin[compiled]['median_images_per_s'] - 1:+.1%}"
        return text

    def setting(values) -> str:
        return " or ".join(sorted({str(value) for value in values})) or "none"

    weights = [item.split("=", 1)[1] for step in steps for item in step["overrides"]
               if item.startswith("train.entailment_weight=")]
    dates = setting(step.get("date", result["date"])[:10] for step in steps)  # a later lease's steps carry their own
    rows = [f"Measured on one {result['gpu']} ({result['machine']}), torch {result['torch']}, {dates}: "
            f"images/s of the whole step (forward, backward, AdamW), batch {setting(step['batch'] for step in steps)}, "
            f"{setting(step['precision'] for step in steps)}, random tensors, the median (range) of "
            f"{setting(len(step['rounds_images_per_s']) for step in steps)} rounds, and against the preset's own "
            f"topology; the hyperbolic rows with the entailment loss at weight {setting(weights)}:", "",
            "| preset | topology | eager | `torch.compile` |", "|---|---|---|---|"]
    for (preset, topology), row in sorted(cells.items(), key=lambda item: list(twins).index(item[0][0])):
        twin = twins[preset]
        rows.append(f"| `{preset}` | {topology if topology == 'as the preset' else f'`{topology}`'} | "
                    f"{cell(row, False, twin)} | {cell(row, True, twin)} |")
    return "\n".join(rows)


def meru_equality_table(result: dict) -> str:
    """scripts/meru_equality.py: topoclip's Lorentz functions against MERU's own, float64."""
    names = list(result["runs"][0]["functions"])
    rows = [f"topoclip's functions against MERU's `meru/lorentz.py` (commit `{result['meru_commit'][:12]}`), float64, "
            f"random inputs, MERU's additive eps taken out (`scripts/meru_equality.py`): the largest difference, and "
            f"the bound from the inputs' condition numbers; with MERU's own eps = 1e-8 left in (last row).", "",
            "| c | " + " | ".join(f"`{name}`" for name in names) + " |", "|---" * (len(names) + 1) + "|"]
    for run in result["runs"]:
        rows.append(f"| {run['curvature']:g} | " + " | ".join(
            f"{row['max_abs_difference']:.1e} (≤ {row['bound']:.1e})" for row in run["functions"].values()) + " |")
    worst = {name: max(run["functions"][name].get("with_meru_eps", 0.0) for run in result["runs"]) for name in names}
    rows.append("| MERU's eps | " + " | ".join(f"{worst[name]:.1e}" if any("with_meru_eps" in run["functions"][name]
                                                    for run in result["runs"]) else "—" for name in names) + " |")
    return "\n".join(rows)


def lora_table(result: dict) -> str:
    """benchmarks/lora.py: LoRA against full fine-tuning, and what each keeps of the pretrained model; over seeds
    (`--seeds`), means ± standard deviations and LoRA − full as a paired t."""
    settings, arms, sd = result["settings"], result["arms"], result.get("sd")
    seeds = settings.get("seeds", 1)
    quiet = "a quiet machine" if result["quiet_machine"] else "a busy machine (memory and speed indicative only)"
    over = (f" Each of {seeds} seeds (from {settings['seed']}) pretrains once and fine-tunes both arms; the figures are "
            f"means over the seeds, recalls ± their standard deviation." if sd else " One seed.")
    rows = [f"Measured: `{result['command']}` on {quiet}, torch {result['torch']}: `{settings['preset']}` pretrained "
            f"{settings['pretrain_steps']:,} steps on the scenes, then fine-tuned {settings['steps']:,} steps (batch "
            f"{settings['batch']}) on a CSV of {settings['rows']:,} train scenes in the out-of-domain style, each arm a "
            f"process of its own. Retrieval mean recall on the test scenes: in the pretraining's style (held out of "
            f"the fine-tuning: retained) and in the fine-tuning's (learnt).{over}", "",
            "| | trainable weights | peak memory (MiB) | images / s | retained | learnt |", "|---|---|---|---|---|---|"]

    def recall(part: str, line: dict, key: str) -> str:
        return f"{line[key]:.1f}" + (f" ± {sd[part][key]:.1f}" if sd else "")

    rows.append(f"| pretrained | | | | {recall('pretrained', result['pretrained'], 'retained')} | "
                f"{recall('pretrained', result['pretrained'], 'learnt')} |")
    for arm, label in (("full", f"full fine-tuning, lr {settings['full_lr']:g}"),
                       ("lora", f"LoRA rank {settings['rank']}, lr {settings['lora_lr']:g}")):
        line = arms[arm]
        rows.append(f"| {label} | {line['trainable']:,} | {line['peak_mib']:,.0f} | {line['images_per_s']:,.0f} | "
                    f"{recall(arm, line, 'retained')} | {recall(arm, line, 'learnt')} |")
    if "lora_minus_full" in result:
        difference = {key: Difference(**value) for key, value in result["lora_minus_full"].items()}
        rows += ["", f"LoRA − full fine-tuning, paired over the seeds: retained {difference['retained'].describe()}; "
                     f"learnt {difference['learnt'].describe()}."]
    if result.get("counted"):
        rows += ["", f"At scale (counted on the meta device, not run): the weights LoRA rank {settings['rank']} "
                     f"trains, and the training state of each arm (fp32 weights; a gradient and AdamW's two moments "
                     f"for each trained weight; activations aside):", "",
                 "| preset | weights | LoRA trains | full fine-tuning's state (MiB) | LoRA's state (MiB) |",
                 "|---|---|---|---|---|"]
        rows += [f"| `{line['preset']}` | {line['weights']:,} | {line['lora_trainable']:,} "
                 f"({100 * line['lora_trainable'] / line['weights']:.1f} %) | {line['full_state_mib']:,.0f} | "
                 f"{line['lora_state_mib']:,.0f} |" for line in result["counted"]]
    return "\n".join(rows)
