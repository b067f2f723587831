"""The training data path's speed per worker, on shards of realistic JPEGs, beside another commit's and OpenCLIP's.

    python benchmarks/loader.py                                    # topoclip as installed here
    python benchmarks/loader.py --baseline /work/pin/src           # and the path of another checkout, same run
    python benchmarks/loader.py --openclip .ci/field-venv/bin/python   # and OpenCLIP's, in the integration venv
    python benchmarks/loader.py --baseline PIN/src --openclip FIELD/bin/python --out docs/results/loader.json

What it measures: images per second delivered to the training loop by DataLoader workers doing the whole path —
tar → JPEG decode → random resized crop → tensor → tokenize → the batch across the worker pipe — as the trainer
runs it (`topoclip.run.training.data.training_batches`, user shards, train.num_workers workers), and OpenCLIP 3.3's
own `open_clip_train.data.get_wds_dataset` with its `image_transform(is_train=True)` and tokenizer (in a venv with
OpenCLIP's training extra, `pip install 'open_clip_torch[training]'`: pandas and webdataset ≤ 0.2.86, which it pins;
with webdataset 1.x its group_by_keys_nothrow fails on the end-of-shard marker 1.x yields, KeyError 'fname'). Each path runs with 1 worker (the rate of one worker on one core: the figure to divide a GPU's rate
by) and with as many workers as cores; the paths alternate round by round, so a noisy machine affects them alike,
and the median round is reported. The main process only takes the batches (and, for topoclip's uint8 batches, the
normalisation a GPU would do: timed apart, `device_ms_per_batch`). The clock starts once the batches the workers
queued while starting are taken. Then, the workers' queue left to fill again, `main_ms_per_batch` times the taking
alone (receiving a batch from shared memory; where CUDA is, a queue's get: DataLoader's pin thread received it, and
`pin_ms_per_batch` times its copy into page-locked memory): the serial stage no worker count helps.

The shards are written by the benchmark (reused when present): photo-like pictures (a smooth colour field, a 1/f
texture — natural images' amplitude spectrum — objects with edges, sensor noise; 2.3–2.6 bits a pixel at q90, as
photos are), the shorter side 256, 384 or 512 px with LAION's usual aspect ratios (1, 4:3, 3:2, 16:9, 30 % of them
portrait), JPEG quality 90, 8–20-word captions: what `img2dataset --resize_mode keep_ratio` writes.

The rate a GPU step needs is read from docs/results/gpu-check.json (random tensors, ViT-B/16 compiled, bf16): the
workers it takes are that rate over one worker's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("a red cube on the left of a small blue ball under green light near two yellow stars and a large purple "
         "ring beside an orange square above three white circles at night in the old city by the sea").split()
RATIOS = (1.0, 4 / 3, 3 / 2, 16 / 9)
APART = 8  # times a batch is pinned, or copied and normalised where the step runs, timed apart from the loader


def photo_like(rng: np.random.Generator, width: int, height: int):
    """A PIL RGB picture with a photo's statistics (see the module text)."""
    from PIL import Image, ImageDraw, ImageFilter

    grid = rng.integers(0, 256, (int(rng.integers(2, 6)), int(rng.integers(2, 6)), 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(grid).resize((width, height), Image.BICUBIC), dtype=np.float32)
    fy, fx = np.fft.fftfreq(height)[:, None], np.fft.rfftfreq(width)[None, :]
    frequency = np.sqrt(fx * fx + fy * fy)
    frequency[0, 0] = 1.0
    spectrum = (rng.standard_normal(frequency.shape) + 1j * rng.standard_normal(frequency.shape)) / frequency
    texture = np.fft.irfft2(spectrum, s=(height, width))
    texture *= 28.0 / texture.std()
    image = Image.fromarray(np.clip(base + texture[..., None] * rng.uniform(0.7, 1.3, 3), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 9))):
        left, top = int(rng.integers(0, width)), int(rng.integers(0, height))
        box = (left, top, left + int(rng.integers(width // 10, width // 2)), top + int(rng.integers(height // 10, height // 2)))
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    pixels = np.asarray(image.filter(ImageFilter.GaussianBlur(0.6)), dtype=np.float32)
    return Image.fromarray(np.clip(pixels + rng.normal(0, 3, pixels.shape), 0, 255).astype(np.uint8))


def write_shard(path: Path, first: int, samples: int, short: int, seed: tuple[int, int]) -> list[float]:
    """One tar of `samples` photo-like JPEGs (keys from `first`), its own random stream `seed`: bits per pixel."""
    import io
    import tarfile

    rng, bits = np.random.default_rng(seed), []
    partial = path.with_name(path.name + ".partial")  # a shard cut by a crash is never taken for a whole one
    with tarfile.open(partial, "w") as archive:
        for index in range(first, first + samples):
            ratio = float(rng.choice(RATIOS))
            long = int(round(short * ratio))
            width, height = (long, short) if rng.random() < 0.7 else (short, long)
            encoded = io.BytesIO()
            photo_like(rng, width, height).save(encoded, "JPEG", quality=90)
            bits.append(8 * encoded.tell() / (width * height))
            caption = " ".join(rng.choice(WORDS, size=int(rng.integers(8, 21))))
            for name, data in ((f"{index:08d}.jpg", encoded.getvalue()), (f"{index:08d}.txt", caption.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    os.replace(partial, path)
    return bits


def make_shards(folder: Path, samples: int, short: int, per_shard: int = 128) -> tuple[str, float]:
    """(brace pattern, bits per pixel) of `samples` photo-like JPEGs of shorter side `short` in `folder`, a shard
    per process on every core (a GPU machine's lease is minutes: 4,096 pictures took 90 s on one core there)."""
    from concurrent.futures import ProcessPoolExecutor

    from topoclip.core.door import is_regular, read_json

    folder.mkdir(parents=True, exist_ok=True)
    count = -(-samples // per_shard)
    pattern = str(folder / f"{{00000..{count - 1:05d}}}.tar")
    stats, layout = folder / "bits_per_pixel.json", {"samples": samples, "per_shard": per_shard, "writer": 2}
    if is_regular(stats, folder):  # written after the last shard: the shards of this layout are whole
        recorded = read_json(stats, "shard statistics", folder, expect=dict)
        if {key: recorded.get(key) for key in layout} == layout:
            return pattern, recorded["bits_per_pixel"]
        stats.unlink()
    with ProcessPoolExecutor(min(count, os.cpu_count() or 1)) as pool:
        jobs = [pool.submit(write_shard, folder / f"{shard:05d}.tar", shard * per_shard,
                            min(samples, (shard + 1) * per_shard) - shard * per_shard, short, (short, shard))
                for shard in range(count)]
        bits = [value for job in jobs for value in job.result()]
    stats.write_text(json.dumps({"bits_per_pixel": float(np.mean(bits)), **layout}))
    return pattern, float(np.mean(bits))


# --------------------------------------------------------------------------- one measurement (in a child process)


def queued(workers: int, prefetch: int) -> int:
    """Batches to take before the clock starts: the first two, then as many as the workers may have queued while
    the main process waited for them (each holds `prefetch`). Timed from there, the batches arrive at the rate the
    workers make them, not from a queue filled before the clock started (with 12 workers and 8 timed batches, a
    queue of 12 made the rate look 400 times faster)."""
    return 2 + workers * prefetch


def measure_topoclip(pattern: str, workers: int, batch: int, batches: int, image_size: int, pin: bool = True) -> dict:
    """Images per second `training_batches` delivers (topoclip as importable here: this checkout or --baseline's);
    `pin`: in page-locked memory where CUDA is, as the trainer takes them there."""
    import torch

    from topoclip.config import load_config
    try:
        from topoclip.run.training import data
    except ImportError:  # a commit before the layers (#60), the baseline 391d766 among them
        from topoclip.training import data
    try:
        from topoclip.preprocess.tokenizer import Tokenizer
    except ImportError:
        from topoclip.tokenizer import Tokenizer

    config = load_config("tiny", ["data.source=shards", f"data.train_data={pattern}", f"train.num_workers={workers}",
                                  f"train.batch_size={batch}", f"model.vision.image_size={image_size}",
                                  "data.resampled=true", "data.samples_per_epoch=100000000"])
    tokenizer = Tokenizer.train(WORDS, vocab_size=256, context_length=77)
    pinned = pin and torch.cuda.is_available()  # as the trainer takes them on a GPU machine
    stream = data.training_batches(config, 0, tokenizer=tokenizer, **({"pin_memory": True} if pinned else {}))
    for _ in range(queued(workers, data.prefetch_factor(workers))):
        next(stream)
    # Only the taking is timed: the workers go on while the main process works, so time spent on anything else in
    # this loop (the normalisation, once subtracted) would be counted as theirs.
    start, images = time.perf_counter(), 0
    for _ in range(batches):
        batch = next(stream)
        images += len(batch)
    seconds = time.perf_counter() - start
    # The main process's own share of a batch: once the workers have filled their queue, a batch taken from it
    # costs only the taking (its pages received from shared memory; pinned, on a GPU machine), a serial stage that
    # no number of workers shortens.
    in_queue = workers * data.prefetch_factor(workers)
    time.sleep(min(30.0, 1.5 * in_queue * len(batch) / (images / seconds)))  # the queue refilled
    began = time.perf_counter()
    for _ in range(in_queue):
        batch = next(stream)
    taking = (time.perf_counter() - began) / in_queue
    # Pinned, the taking above is a queue's get: DataLoader's pin thread received and pinned the batch meanwhile, in
    # this process. Its copy into page-locked memory, timed here: with the taking, the main process's whole share.
    pin_ms = None
    if pinned:
        pageable = batch.images.clone()
        began = time.perf_counter()
        for _ in range(APART):
            pageable.pin_memory()
        pin_ms = 1000 * (time.perf_counter() - began) / APART
    # The uint8 batch's copy and normalisation where the step runs (the GPU where there is one), timed apart.
    device_ms = None
    if hasattr(data, "device_pixels"):
        vision, where = config.model.vision, torch.device("cuda" if torch.cuda.is_available() else "cpu")
        sync = torch.cuda.synchronize if where.type == "cuda" else (lambda: None)
        data.device_pixels(batch.images.to(where, non_blocking=True), vision.mean, vision.std)  # warm-up
        sync()
        began = time.perf_counter()
        for _ in range(APART):
            data.device_pixels(batch.images.to(where, non_blocking=True), vision.mean, vision.std)
        sync()
        device_ms = 1000 * (time.perf_counter() - began) / APART
    dtype = str(batch.images.dtype).replace("torch.", "")
    return {"images_per_s": images / seconds, "batch_dtype": dtype, "device_ms_per_batch": device_ms,
            "main_ms_per_batch": 1000 * taking, "pin_ms_per_batch": pin_ms, "pinned": pinned,
            "torch_threads": torch.get_num_threads()}


def measure_openclip(pattern: str, workers: int, batch: int, batches: int, image_size: int) -> dict:
    """Images per second of OpenCLIP's own training pipeline (open_clip_train.data.get_wds_dataset)."""
    from argparse import Namespace

    import open_clip
    from open_clip_train.data import get_wds_dataset

    preprocess = open_clip.image_transform(image_size, is_train=True)
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    args = Namespace(train_data=pattern, val_data=None, train_num_samples=10 ** 8, dataset_resampled=True,
                     train_data_upsampling_factors=None, seed=0, batch_size=batch, workers=workers, world_size=1)
    loader = get_wds_dataset(args, preprocess, is_train=True, tokenizer=tokenizer).dataloader
    stream = iter(loader)
    for _ in range(queued(workers, 2)):  # its WebLoader keeps DataLoader's default prefetch_factor, 2
        next(stream)
    start, images = time.perf_counter(), 0
    for _ in range(batches):
        pixels, _ = next(stream)
        images += len(pixels)
    return {"images_per_s": images / (time.perf_counter() - start), "batch_dtype": "float32",
            "version": open_clip.__version__}


# --------------------------------------------------------------------------- the rounds


def child(python: str, which: str, pythonpath: str, pattern: str, workers: int, args) -> dict:
    """One measurement in a fresh process (so a path's workers and imports never meet another's)."""
    command = [python, str(Path(__file__).resolve()), "--measure", which, "--pattern", pattern, "--workers",
               str(workers), "--batch", str(args.batch), "--batches", str(args.batches), "--image-size",
               str(args.image_size)]
    # the path's own source first, then the caller's PYTHONPATH (a machine may keep packages there)
    paths = [pythonpath, os.environ.get("PYTHONPATH", "")]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{which} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def gpu_rate() -> dict:
    """The rate of the step a loader must feed: topoclip's ViT-B/16 sphere, compiled, bf16, on random tensors, from
    docs/results/gpu-check.json ({} where the file has no such figure)."""
    path = ROOT / "docs" / "results" / "gpu-check.json"
    if not path.is_file():
        return {}
    steps = json.loads(path.read_text()).get("check", {}).get("steps", {})
    for entry in steps.get("step_compiled", {}).get("json", []):
        if entry.get("model") == "topoclip" and entry.get("preset") == "sphere-vit-b16":
            return {"source": "docs/results/gpu-check.json", "gpu": entry.get("gpu"), "preset": entry["preset"],
                    "precision": entry.get("precision"), "batch": entry.get("batch"),
                    "images_per_s": entry["median_images_per_s"]}
    return {}


def machine() -> str:
    """This CPU's model name (Linux), or the platform's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.platform()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 384, 512], help="shorter sides of the JPEGs")
    parser.add_argument("--samples", type=int, default=1024, help="pictures per size (shards of 128)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=12, help="batches timed per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=None, help="default: 1 and the cores")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--baseline", help="another checkout's src folder: its path measured in the same run")
    parser.add_argument("--baseline-label", default="baseline")
    parser.add_argument("--openclip", help="a Python with open_clip_torch (and pandas): OpenCLIP's path too")
    parser.add_argument("--shards", default=str(Path(os.environ.get("TMPDIR", "/tmp")) / "topoclip-loader-shards"))
    parser.add_argument("--out", help="write the results as JSON here (e.g. docs/results/loader.json)")
    parser.add_argument("--note", default="", help="what else the machine was doing, recorded with the results")
    parser.add_argument("--unpinned", action="store_true",
                        help="on a CUDA machine, also topoclip's path without page-locking (topoclip-unpinned)")
    parser.add_argument("--measure", choices=["topoclip", "topoclip-unpinned", "openclip"], help=argparse.SUPPRESS)
    parser.add_argument("--pattern", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure = {"topoclip": measure_topoclip, "openclip": measure_openclip,
                   "topoclip-unpinned": lambda *a: measure_topoclip(*a, pin=False)}[args.measure]
        print(json.dumps(measure(args.pattern, args.workers[0], args.batch, args.batches, args.image_size)))
        return 0

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = args.workers or sorted({1, cores})
    paths = {"topoclip": (sys.executable, "topoclip", str(ROOT / "src"))}
    if args.baseline:
        paths[args.baseline_label] = (sys.executable, "topoclip", str(Path(args.baseline).resolve()))
    if args.unpinned:
        paths["topoclip-unpinned"] = (sys.executable, "topoclip-unpinned", str(ROOT / "src"))
    if args.openclip:
        paths["openclip"] = (args.openclip, "openclip", "")
    command = shlex.join(["python", "benchmarks/loader.py"] + [f"X/{Path(a).name}" if os.path.isabs(a) else a
                                                               for a in sys.argv[1:]])
    results = {"benchmark": "loader", "command": command, "note": args.note, "cores": cores, "batch": args.batch,
               "batches": args.batches,
               "rounds": args.rounds, "image_size": args.image_size, "machine": machine(), "gpu_step": gpu_rate(),
               "sizes": {}}
    for short in args.sizes:
        pattern, bits = make_shards(Path(args.shards) / f"{short}", args.samples, short)
        rows = {name: {count: [] for count in workers} for name in paths}
        extra = {name: {} for name in paths}
        for round_ in range(args.rounds):
            for count in workers:
                for name, (python, which, pythonpath) in paths.items():
                    measured = child(python, which, pythonpath, pattern, count, args)
                    rows[name][count].append(measured["images_per_s"])
                    extra[name] = {key: value for key, value in measured.items() if key != "images_per_s"}
                    print(json.dumps({"size": short, "round": round_, "path": name, "workers": count, **measured}),
                          flush=True)
        entry = {"bits_per_pixel": bits, "paths": {}}
        for name in paths:
            entry["paths"][name] = {
                **extra[name],
                "images_per_s": {str(count): statistics.median(rows[name][count]) for count in workers},
                "rounds": {str(count): rows[name][count] for count in workers},
                "per_worker": statistics.median(rows[name][1]) if 1 in rows[name] else None}
        ours = entry["paths"]["topoclip"]["per_worker"]
        entry["ratios"] = {f"topoclip / {name}": ours / entry["paths"][name]["per_worker"]
                           for name in paths if name != "topoclip" and ours and entry["paths"][name]["per_worker"]}
        if results["gpu_step"]:
            entry["workers_for_the_gpu_step"] = {
                name: int(np.ceil(results["gpu_step"]["images_per_s"] / entry["paths"][name]["per_worker"]))
                for name in paths if entry["paths"][name]["per_worker"]}
        results["sizes"][str(short)] = entry
        print(json.dumps({"size": short, "summary": entry["ratios"],
                          "per_worker": {name: round(entry["paths"][name]["per_worker"] or 0) for name in paths}}))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
