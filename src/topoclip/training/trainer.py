"""`topoclip.train(config)`: the training loop, its run folder, checkpoints and resumption.

    runs/NAME/
      config.json         the resolved config (what `--resume` continues)
      tokenizer.json      the tokenizer the run uses
      metrics.jsonl       one JSON object per logged step and per evaluation
      eval.json           the final evaluation records (CLIP_benchmark-style)
      checkpoints/step-NNNNNN/   (see topoclip.checkpoint)
      plots/*.png         loss, temperature, learning rate, evaluation metrics over training

Only rank 0 writes; every rank resumes from the same checkpoint. The data stream of the built-in
scenes is a function of the step, so an interrupted and resumed CPU fp32 run reproduces the
losses of an uninterrupted one.
"""
from __future__ import annotations

import json
import math
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from topoclip.checkpoint import (CONFIG, STEP_PREFIX, TOKENIZER, load_training_state, load_weights,
                                 prune_checkpoints, save_checkpoint, step_checkpoints)
from topoclip.config import Config, ConfigError, load_config, to_dict, validate
from topoclip.data.quality import BAD_SAMPLE_KINDS, BadSampleCounter, check_bad_fraction
from topoclip.distributed import DistributedInfo, barrier, cleanup, init_distributed, sum_across_ranks
from topoclip.model import CLIP
from topoclip.tokenizer import Tokenizer
from topoclip.training.data import training_batches
from topoclip.training.logger import MetricsLogger
from topoclip.training.optim import build_optimizer, build_scheduler
from topoclip.training.step import forward_backward, optimizer_step

# Captions read to train a vocabulary when the config names none.
TOKENIZER_TRAINING_CAPTIONS = 20_000
# Bad-sample fraction is judged only after this many samples (a few bad ones early prove nothing).
BAD_FRACTION_MIN_SEEN = 1000


def build_tokenizer(config: Config, saved: Optional[Path] = None) -> Tokenizer:
    """The run's tokenizer: `saved` (a resumed run's), else data.tokenizer, else trained on the captions."""
    context = config.model.text.context_length
    if saved is not None:
        return Tokenizer.load(saved, context_length=context)
    if config.data.tokenizer:
        return Tokenizer.from_vocab(config.data.tokenizer, context_length=context)
    return Tokenizer.train(training_captions(config), vocab_size=config.model.text.vocab_size, context_length=context)


def training_captions(config: Config) -> list[str]:
    """Up to TOKENIZER_TRAINING_CAPTIONS captions of the training data (for a new vocabulary)."""
    data = config.data
    if data.source == "scenes":
        from topoclip.data.scenes import SceneDataset

        scenes = SceneDataset(data.scenes, "train")
        count = min(len(scenes), TOKENIZER_TRAINING_CAPTIONS)
        return [scenes.clean_caption(i).text for i in range(count)]
    if data.source == "csv":
        from topoclip.data.csv import read_caption_table
        from topoclip.data.images import clean_caption
        from topoclip.data.quality import BadSample

        rows = read_caption_table(data.train_data, data.csv_image_key, data.csv_caption_key, data.csv_separator or None)
        captions = []
        for _, raw in rows[:TOKENIZER_TRAINING_CAPTIONS]:
            try:
                captions.append(clean_caption(raw))
            except BadSample:  # counted when training reads the row; here it is only left out
                pass
        return captions
    from topoclip.data.shards import read_captions

    return read_captions(data.train_data, TOKENIZER_TRAINING_CAPTIONS)


def check_tokenizer(tokenizer: Tokenizer, config: Config) -> None:
    """The tokenizer must fit the text tower; refused before training starts."""
    text = config.model.text
    if tokenizer.vocab_size > text.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.text.vocab_size={text.vocab_size}; "
                          f"set model.text.vocab_size={tokenizer.vocab_size}")
    if tokenizer.cls_id != text.cls_token_id:
        raise ConfigError(f"the tokenizer's [CLS] id is {tokenizer.cls_id} but model.text.cls_token_id={text.cls_token_id}; "
                          f"set model.text.cls_token_id={tokenizer.cls_id}")


def resolve_device(name: str, info: DistributedInfo) -> torch.device:
    if info.world_size > 1 or name == "auto":
        return info.device
    return torch.device(name)


def new_run_dir(config: Config) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{config.name or 'run'}-{stamp}"


def train(config: Optional[Config] = None, out_dir=None, resume=None, progress: bool = True) -> Path:
    """Train `config` (default: the `cpu-multi` preset); returns the run folder.

    `resume`: a run folder; training continues from its newest checkpoint with its saved config
    (a `config` given too overrides it, e.g. to train for more steps).
    """
    if resume is not None:
        run_dir = Path(resume)
        if not (run_dir / CONFIG).is_file():
            raise FileNotFoundError(f"cannot resume {run_dir}: no {CONFIG} there (is it a run folder?)")
        config = config or load_config(values=json.loads((run_dir / CONFIG).read_text()))
    else:
        config = config or load_config("cpu-multi")
        run_dir = Path(out_dir) if out_dir else new_run_dir(config)
    validate(config)
    train_config = config.train
    info = init_distributed(train_config.device)
    try:
        return _train(config, run_dir, resume is not None, info, progress)
    finally:
        cleanup()


def _train(config: Config, run_dir: Path, resuming: bool, info: DistributedInfo, progress: bool) -> Path:
    settings = config.train
    main = info.rank == 0
    device = resolve_device(settings.device, info)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.batch_size % info.world_size:
        raise ConfigError(f"train.batch_size={settings.batch_size} (the global batch) is not divisible by the "
                          f"{info.world_size} processes; pick a multiple of {info.world_size}")
    if (settings.batch_size // info.world_size) % settings.accumulation_steps:
        raise ConfigError(f"the per-process batch {settings.batch_size // info.world_size} is not divisible by "
                          f"train.accumulation_steps={settings.accumulation_steps}")

    torch.manual_seed(settings.seed)
    # Decided on every rank before rank 0 writes anything: every rank then builds the same tokenizer
    # (training one is deterministic) and none reads a file while it is being written.
    saved_tokenizer = run_dir / TOKENIZER if (run_dir / TOKENIZER).is_file() else None
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
    barrier()
    tokenizer = build_tokenizer(config, saved_tokenizer)
    check_tokenizer(tokenizer, config)
    if main:
        (run_dir / CONFIG).write_text(json.dumps(to_dict(config), indent=2))
        if saved_tokenizer is None:
            tokenizer.save(run_dir / TOKENIZER)

    model = CLIP(config.model).to(device)
    if settings.gradient_checkpointing:
        model.set_gradient_checkpointing(True)
    optimizer = build_optimizer(model, settings)
    scheduler = build_scheduler(optimizer, settings)
    scaler = torch.amp.GradScaler(device.type) if settings.precision == "fp16" else None

    start_step = 0
    counter = BadSampleCounter()
    checkpoints_dir = run_dir / "checkpoints"
    if resuming and step_checkpoints(checkpoints_dir):
        start_step = resume_from(step_checkpoints(checkpoints_dir)[-1], model, optimizer, scheduler, scaler, counter)

    trained = model
    if info.world_size > 1:
        trained = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    if settings.compile:
        trained = torch.compile(trained)

    logger = MetricsLogger(run_dir, enabled=main, resume_step=start_step)
    batches = training_batches(config, start_step, info.rank, info.world_size)
    bar = tqdm(range(start_step, settings.steps), initial=start_step, total=settings.steps,
               disable=not (progress and main), desc="train", dynamic_ncols=True)
    window_start, window_images = time.perf_counter(), 0
    loss_value = float("nan")
    for step in bar:
        batch = next(batches)
        # Every rank judges (and rank 0 logs) the counts of all ranks, so all stop together.
        counter += global_counts(batch, device)
        check_bad_fraction(counter, config.data.max_bad_fraction, BAD_FRACTION_MIN_SEEN)
        images = batch.images.to(device, non_blocking=True)
        text = tokenizer(batch.captions).to(device)
        model.train()
        loss_value = forward_backward(trained, images, text, settings.loss, accumulation_steps=settings.accumulation_steps,
                                      precision=settings.precision, scaler=scaler)
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss became {loss_value} at step {step}; lower train.lr, or use "
                                     f"train.precision=fp32 / a lower model.temperature.max_scale")
        grad_norm = optimizer_step(model, optimizer, scaler, settings.grad_clip)
        scheduler.step()
        window_images += settings.batch_size
        done = step + 1

        if done % settings.log_every == 0 or done == settings.steps:
            elapsed = time.perf_counter() - window_start
            scale = float(model.temperature.scale.detach())
            loss_value = sum_across_ranks([loss_value], device)[0] / info.world_size  # the global batch's loss
            logger.log({"step": done, "loss": loss_value, "scale": scale, "t": float(model.temperature.t.detach()),
                        "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                        "images_per_s": window_images / max(elapsed, 1e-9), "data": counter.as_dict()})
            bar.set_postfix(loss=f"{loss_value:.3f}", tau=f"{scale:.2f}")
            window_start, window_images = time.perf_counter(), 0
        if settings.eval_every and done % settings.eval_every == 0 and done < settings.steps and main:
            logger.log({"step": done, "eval": run_evaluation(model, tokenizer, config, "val", device)})
        if main and (done == settings.steps or (settings.checkpoint_every and done % settings.checkpoint_every == 0)):
            write_checkpoint(checkpoints_dir, done, model, config, tokenizer, optimizer, scheduler, scaler, counter)
            prune_checkpoints(checkpoints_dir, settings.keep_checkpoints)
        barrier()
    bar.close()

    if main:
        from topoclip.evaluation.run import headline, summary_table

        records = final_evaluation(model, tokenizer, config, device)
        (run_dir / "eval.json").write_text(json.dumps(records, indent=2))
        logger.log({"step": settings.steps, "eval": headline(records), "final": True})
        logger.plot()
        print(summary_table(records))
        print(f"\nrun folder: {run_dir.resolve()}  (config.json, metrics.jsonl, eval.json, checkpoints/, plots/)")
    logger.close()
    return run_dir


def global_counts(batch, device) -> BadSampleCounter:
    """This step's kept and skipped samples summed over every rank."""
    kinds = sorted(BAD_SAMPLE_KINDS)
    values = sum_across_ranks([len(batch)] + [batch.bad_samples.get(kind, 0) for kind in kinds], device)
    return BadSampleCounter(int(values[0]), {kind: int(v) for kind, v in zip(kinds, values[1:]) if v})


def run_evaluation(model, tokenizer, config: Config, split: str, device) -> dict:
    from topoclip.evaluation.run import evaluate, headline

    return headline(evaluate(model, tokenizer, config, split, device))


def final_evaluation(model, tokenizer, config: Config, device) -> list[dict]:
    from topoclip.evaluation.run import evaluate

    return evaluate(model, tokenizer, config, "test", device)


def write_checkpoint(folder: Path, step: int, model, config, tokenizer, optimizer, scheduler, scaler, counter) -> None:
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else {},
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        # The scenes stream is a function of the step; user streams restart their epoch.
        "data": {"step": step, **counter.as_dict()},
    }
    save_checkpoint(folder / f"{STEP_PREFIX}{step:06d}", model, config, tokenizer, state)


def resume_from(folder: Path, model, optimizer, scheduler, scaler, counter: BadSampleCounter) -> int:
    """Load weights and training state from a checkpoint folder; returns the step to continue from."""
    load_weights(model, folder)
    state = load_training_state(folder)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    # The schedule follows the *current* config (a resumed run may train for more steps): recompute
    # this step's lr rather than trusting the one stored with the optimizer.
    for group, base, schedule in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * schedule(scheduler.last_epoch)
    if scaler is not None and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    if torch.cuda.is_available() and state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    data = state["data"]
    counter += BadSampleCounter(data["kept"], data["bad"])
    return int(state["step"])
