"""`topoclip.train(config)`: the training loop in its run folder (layout: topoclip.training.run_folder).

Around the loop: the tokenizer (training.tokenizer_setup), saving and resuming checkpoints
(training.resume), the step and its guards (training.step), the batches (training.data).

Only rank 0 writes; every rank resumes from the same checkpoint. The data stream of the built-in
scenes is a function of the step, so an interrupted and resumed CPU fp32 run reproduces the
losses of an uninterrupted one.

A run folder is never reused silently: a fresh run needs a new or empty folder, and one process at
a time holds a folder. A resume continues the saved config and may change only RESUMABLE_SETTINGS
(how long and how fast it trains, how often it logs, evaluates and saves, where it computes, what
it is evaluated on); any other change is refused before anything is written, and config.json is
replaced (atomically) only once the checkpoint has loaded. Resuming a finished run says so and
changes nothing.

Non-finite values: a step whose loss is inf/NaN is skipped (no update; its batch and its learning-
rate step still pass), as mixed-precision trainers skip overflowing steps; MAX_SKIPPED_STEPS such
steps in a row stop the run. Parameters are checked after every update: weights that became
inf/NaN stop the run at once, so no checkpoint is ever written from them. Either stop names the
step, the last good checkpoint and what to change (a lower train.lr, most often).
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from tqdm.auto import tqdm

from topoclip.checkpoint import TOKENIZER, step_checkpoints
from topoclip.config import DEFAULT_PRESET, Config, ConfigError, load_config, to_dict, validate
from topoclip.data.quality import BAD_SAMPLE_KINDS, BadSampleCounter, check_bad_fraction
from topoclip.data.sources import get_source
from topoclip.distributed import (DistributedInfo, barrier, broadcast_object, cleanup, gather_objects,
                                  init_distributed, is_initialized, sum_across_ranks)
from topoclip.errors import NonFiniteError, UserError, require_device
from topoclip.model import CLIP
from topoclip.training.data import StreamPosition, prefetch_to_device, training_batches
from topoclip.training.logger import MetricsLogger
from topoclip.training.optim import build_optimizer, build_scheduler
from topoclip.training.resume import (finish_leftovers, finished, require_fitting_checkpoint, resume_config,
                                      resume_newest_good, rng_states, save_checkpoint_and_prune)
from topoclip.training.run_folder import RunFolder, claim_run_folder, write_text_atomic
from topoclip.training.step import (SkippedSteps, autocast_context, contrastive_loss, forward_backward_loss,
                                    nonfinite_anywhere, optimizer_step, parameters_finite, set_tf32)
from topoclip.training.tokenizer_setup import build_tokenizer, check_tokenizer, fit_to_trained_tokenizer

# Bad-sample fraction is judged only after this many samples (a few bad ones early prove nothing).
BAD_FRACTION_MIN_SEEN = 1000
# Steps with a non-finite loss skipped in a row before the run stops.
MAX_SKIPPED_STEPS = 5


def new_run_dir(config: Config) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{config.name or 'run'}-{stamp}"


def train(config: Optional[Config] = None, out_dir=None, resume=None, progress: bool = True) -> Path:
    """Train `config` (default: the `cpu-multi` preset); returns the run folder.

    out_dir: a new or empty folder (default runs/NAME-TIMESTAMP); a folder holding files is refused.
    resume: a run folder; training continues from its newest checkpoint with its saved config (a
        `config` given too may change RESUMABLE_SETTINGS of it, e.g. train.steps to train longer).
        A finished run is left as it is.
    Raises a UserError (one line: what, where, the fix) for anything the user can fix.
    """
    if resume is not None:
        if out_dir is not None:
            raise ConfigError("give out_dir (a new run) or resume (an existing run), not both")
        run_dir = Path(resume)
        config = resume_config(run_dir, config)
    else:
        config = config or load_config(DEFAULT_PRESET)
        run_dir = Path(out_dir) if out_dir else new_run_dir(config)
    validate(config)
    require_device(config.train.device, "train.device")
    if config.train.init_from and resume is None:
        from topoclip.training.init_from import check_initial_checkpoint

        check_initial_checkpoint(config)
    if resume is not None:
        note = finished(run_dir, config)
        if note is not None:
            if int(os.environ.get("RANK", "0")) == 0:
                with claim_run_folder(run_dir, resuming=True):
                    finish_leftovers(run_dir, config)
                print(note)
            return run_dir
    train_config = config.train
    info = init_distributed(train_config.device)
    try:
        return _train(config, run_dir, resume is not None, info, progress)
    finally:
        cleanup()


def on_main(main: bool, action: Callable[[], Any]) -> Any:
    """`action()` on rank 0; a UserError it raises is raised on every rank, so none waits for rank 0 forever."""
    result, failure = None, None
    if main:
        try:
            result = action()
        except UserError as error:
            failure = error
    failure = broadcast_object(failure)
    if failure is not None:
        raise failure
    return result


def _train(config: Config, run_dir: Path, resuming: bool, info: DistributedInfo, progress: bool) -> Path:
    settings = config.train
    if settings.batch_size % info.world_size:
        raise ConfigError(f"train.batch_size={settings.batch_size} (the global batch) is not divisible by the "
                          f"{info.world_size} processes; pick a multiple of {info.world_size}")
    if (settings.batch_size // info.world_size) % settings.accumulation_steps:
        raise ConfigError(f"the per-process batch {settings.batch_size // info.world_size} is not divisible by "
                          f"train.accumulation_steps={settings.accumulation_steps}")
    # The user's evaluation sets are listed now, not found broken after hours of training.
    on_main(info.rank == 0, lambda: check_evaluation_sets(config))
    lock = on_main(info.rank == 0, lambda: claim_run_folder(run_dir, resuming))
    try:
        return _train_in_folder(config, run_dir, resuming, info, progress)
    finally:
        if lock is not None:
            lock.release()


def _train_in_folder(config: Config, run_dir: Path, resuming: bool, info: DistributedInfo, progress: bool) -> Path:
    settings = config.train
    main = info.rank == 0
    device = info.device  # train.device, resolved for this rank by init_distributed
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if device.type == "cuda":
        set_tf32(settings.allow_tf32)
    if main:
        print(f"run folder: {run_dir.resolve()}", flush=True)

    torch.manual_seed(settings.seed)
    # A fresh run's folder is empty; a resumed run keeps its tokenizer. Every rank builds the same one
    # (training one is deterministic) and none reads a file rank 0 writes.
    saved_tokenizer = run_dir / TOKENIZER if resuming and (run_dir / TOKENIZER).is_file() else None
    tokenizer = build_tokenizer(config, saved_tokenizer)
    config = fit_to_trained_tokenizer(config, tokenizer)
    check_tokenizer(tokenizer, config)
    folder = RunFolder(run_dir)
    if main and not resuming:
        write_text_atomic(folder.config, json.dumps(to_dict(config), indent=2))
        tokenizer.save(folder.tokenizer)

    checkpoints_dir = folder.checkpoints
    found = folder.step_checkpoints() if resuming else []  # this process holds the folder: the list stays true
    if found:  # the folder's config: its shapes checked before allocating
        require_fitting_checkpoint(found, config.model)
    model = CLIP(config.model).to(device)
    if settings.init_from and not found:
        from topoclip.training.init_from import load_initial_weights

        load_initial_weights(model, config)
    if settings.gradient_checkpointing:
        model.set_gradient_checkpointing(True)
    optimizer = build_optimizer(model, settings)
    scheduler = build_scheduler(optimizer, settings)
    scaler = torch.amp.GradScaler(device.type) if settings.precision == "fp16" else None

    start_step, streams = 0, None
    counter = BadSampleCounter()
    user_stream = get_source(config.data.source).stream  # the scenes are a function of the step; streams keep a position
    position = StreamPosition(settings.num_workers, info.world_size)
    if resuming:
        if found:
            start_step, used, streams = resume_newest_good(found, model, optimizer, scheduler, scaler, counter, main)
            streams = streams[min(info.rank, len(streams) - 1)] if streams else None  # this rank's
        # (a stream split another way cannot continue: refused before config.json takes the resume's changes)
        position = StreamPosition(settings.num_workers, info.world_size, streams)
        if main:
            print(f"resuming from {used.name}" if found else "no checkpoint yet: starting from step 0", flush=True)
            # Only now that the checkpoint has loaded does the saved config take the resume's changes.
            text = json.dumps(to_dict(config), indent=2)
            if folder.config.read_text(encoding="utf-8") != text:
                write_text_atomic(folder.config, text)

    trained = model
    if info.world_size > 1:
        trained = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    if settings.compile:
        trained = torch.compile(trained)

    logger = MetricsLogger(run_dir, enabled=main, resume_step=start_step)
    batches = prefetch_to_device(training_batches(config, start_step, info.rank, info.world_size, tokenizer=tokenizer,
                                                  pin_memory=device.type == "cuda",
                                                  stream=streams), device)
    bar = tqdm(range(start_step, settings.steps), initial=start_step, total=settings.steps,
               disable=not (progress and main), desc="train", dynamic_ncols=True)
    window_start, window_images = time.perf_counter(), 0
    loss_value = float("nan")
    skipped_in_row = skipped = 0
    # A checkpoint due at step N is written during step N + 1, once N's weights have given a finite
    # loss (before N + 1's update, so weights and optimiser state are still N's): a checkpoint never
    # holds weights that give a non-finite loss. The last step's is written at once.
    pending: Optional[dict] = None
    # On a GPU the host reads device values (the loss, the weights' finiteness) only at the steps that
    # need them — logging, checkpoints, the last step — so it queues the next step meanwhile; in between,
    # a non-finite loss skips the update on the device (fused AdamW) and is counted there. On a CPU a
    # read costs nothing: every step is checked.
    deferred = device.type == "cuda"
    skips = SkippedSteps(device)
    for step in bar:
        batch = next(batches)
        position.advance(batch)
        done = step + 1
        # Every rank judges (and rank 0 logs) the counts of all ranks, so all stop together.
        counter += global_counts(batch, device)
        check_bad_fraction(counter, config.data.max_bad_fraction, BAD_FRACTION_MIN_SEEN)
        images = batch.images.to(device, non_blocking=True)
        text = (batch.text if batch.text is not None else tokenizer(batch.captions)).to(device, non_blocking=True)
        model.train()
        loss = forward_backward_loss(trained, images, text, settings.loss, accumulation_steps=settings.accumulation_steps,
                                     precision=settings.precision, scaler=scaler)
        # Decided over all ranks (their gradients are averaged): a non-finite loss anywhere skips the step.
        nonfinite = nonfinite_anywhere(loss)
        skips.record(nonfinite)
        checkpoint_due = done == settings.steps or (settings.checkpoint_every and done % settings.checkpoint_every == 0)
        evaluation_due = settings.eval_every and done % settings.eval_every == 0
        if deferred and pending is None and not (checkpoint_due or evaluation_due) and done % settings.log_every:
            grad_norm = optimizer_step(model, optimizer, scaler, settings.grad_clip, skip=nonfinite)
            advance_schedule(scheduler)
            window_images += settings.batch_size
            barrier()
            continue
        if deferred and not parameters_finite(model):  # an update since the last check, before any checkpoint
            raise NonFiniteError(stop_message("an update since the last check made some weights inf/NaN", done,
                                              checkpoints_dir, run_dir, config))
        loss_value = float(loss)
        skipped_before = skipped
        skipped_in_row, longest_in_row, skipped = skips.read()
        finite = skipped_in_row == 0
        if main and skipped - skipped_before > (0 if finite else 1):  # skipped on the device since the last check
            tqdm.write(f"topoclip: {skipped - skipped_before - (0 if finite else 1)} step(s) before step {done} had a "
                       f"non-finite loss and were skipped", file=sys.stderr)
        if longest_in_row >= MAX_SKIPPED_STEPS:
            shown = "" if finite else f" ({loss_value})"
            raise NonFiniteError(stop_message(f"the loss was non-finite{shown} for {longest_in_row} steps in a row",
                                              done, checkpoints_dir, run_dir, config))
        if pending is not None and finite:
            on_main(main, lambda: save_checkpoint_and_prune(checkpoints_dir, model, config, tokenizer, optimizer,
                                                           scheduler, scaler, **pending))
        pending = None  # (not saved when these weights gave a non-finite loss)
        if not finite:
            optimizer.zero_grad(set_to_none=True)
            grad_norm = float("nan")
            if main:
                tqdm.write(f"topoclip: step {done}: the loss is {loss_value}; step skipped ({skipped_in_row} in a row; "
                           f"the run stops at {MAX_SKIPPED_STEPS})", file=sys.stderr)
        else:
            grad_norm = optimizer_step(model, optimizer, scaler, settings.grad_clip)
            if not parameters_finite(model):  # before any checkpoint is written from them
                raise NonFiniteError(stop_message("the update made some weights inf/NaN", done, checkpoints_dir,
                                                  run_dir, config))
        advance_schedule(scheduler)
        window_images += settings.batch_size

        if done % settings.log_every == 0 or done == settings.steps:
            elapsed = time.perf_counter() - window_start
            scale = float(model.temperature.scale.detach())
            loss_value = sum_across_ranks([loss_value], device)[0] / info.world_size  # the global batch's loss
            logger.log({"step": done, "loss": loss_value, "scale": scale, "t": float(model.temperature.t.detach()),
                        "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                        "images_per_s": window_images / max(elapsed, 1e-9), "data": counter.as_dict(),
                        **({"skipped_steps": skipped} if skipped else {})})
            bar.set_postfix(loss=f"{loss_value:.3f}", tau=f"{scale:.2f}")
            window_start, window_images = time.perf_counter(), 0
        if settings.eval_every and done % settings.eval_every == 0 and done < settings.steps and main:
            logger.log({"step": done, "eval": run_evaluation(model, tokenizer, config, "val", device)})
        if checkpoint_due:
            pending = {"step": done, "counter": BadSampleCounter(counter.kept, counter.bad), "rng": rng_states(),
                       "keep": settings.keep_checkpoints, "streams": gather_objects(position.state()) if user_stream else None}
            if done == settings.steps:
                # The last update has no next step to vouch for it: its weights must give a finite loss on
                # this batch (on every rank) before they are saved and evaluated.
                if bool(nonfinite_anywhere(batch_loss(model, images, text, settings.loss, settings.precision))):
                    raise NonFiniteError(stop_message("the last update made the loss non-finite", done,
                                                      checkpoints_dir, run_dir, config))
                on_main(main, lambda: save_checkpoint_and_prune(checkpoints_dir, model, config, tokenizer, optimizer,
                                                               scheduler, scaler, **pending))
        barrier()
    bar.close()

    if main:
        from topoclip.evaluation.run import headline, no_evaluation_sets, summary_table, temperature_summary

        records = final_evaluation(model, tokenizer, config, device)
        write_text_atomic(folder.evaluation, json.dumps(records, indent=2))
        logger.log({"step": settings.steps, "eval": headline(records), "final": True})
        logger.plot()
        print(summary_table(records) if records else no_evaluation_sets(config))
        print(f"\n{temperature_summary(model)}")
        print(f"plots: {(run_dir / 'plots').resolve()}  (loss, temperature, learning rate, evaluation)")
        print(f"run folder: {run_dir.resolve()}  (config.json, metrics.jsonl, eval.json, checkpoints/, plots/)")
    logger.close()
    return run_dir


def advance_schedule(scheduler) -> None:
    """One step of the lr schedule. A skipped step (non-finite loss) advances it too, deliberately: the lr
    follows the step count, as under a GradScaler; torch's warning when the very first step was skipped
    ("lr_scheduler.step() before optimizer.step()") is about the opposite mistake, and is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before", category=UserWarning)
        scheduler.step()


def batch_loss(model, images, text, loss_name: str, precision: str) -> torch.Tensor:
    """The loss of the current weights on a batch, without gradients (0-d, on the model's device)."""
    with torch.no_grad():
        with autocast_context(precision, images.device.type):
            out = model(images, text)
        return contrastive_loss(model, out.image_embeds, out.text_embeds, out.scale, out.bias, loss_name,
                                is_initialized())


def stop_message(what: str, step: int, checkpoints_dir: Path, run_dir: Path, config: Config) -> str:
    """One line for a run stopped by non-finite values: the step, the last good checkpoint, what to change."""
    settings = config.train
    changes = f"lower train.lr (now {settings.lr:g})"
    if settings.precision != "fp32":
        changes += f", or use train.precision=fp32 (now {settings.precision})"
    changes += f", or lower model.temperature.max_scale (now {config.model.temperature.max_scale:g})"
    found = step_checkpoints(checkpoints_dir)
    if found:
        where = (f"nothing after {found[-1].name} was saved; the last good checkpoint is {found[-1]}; {changes}, then "
                 f"continue from it with `topoclip train --resume {run_dir} --set train.lr=...`")
    else:
        where = f"no checkpoint was written; {changes} and start a new run"
    return f"training stopped at step {step}: {what}; {where}"


def check_evaluation_sets(config: Config) -> None:
    """List the user's evaluation sets of every split training will use; EvaluationSetError when one is unusable."""
    from topoclip.evaluation.run import user_evaluation_sets

    for split in (["val"] if config.train.eval_every else []) + ["test"]:
        user_evaluation_sets(config, split)


def global_counts(batch, device) -> BadSampleCounter:
    """This step's kept and skipped samples summed over every rank."""
    kinds = sorted(BAD_SAMPLE_KINDS)
    values = sum_across_ranks([len(batch)] + [batch.bad_samples.get(kind, 0) for kind in kinds], device)
    return BadSampleCounter(int(values[0]), {kind: int(v) for kind, v in zip(kinds, values[1:]) if v})


def run_evaluation(model, tokenizer, config: Config, split: str, device) -> dict:
    from topoclip.evaluation.run import evaluate, headline

    return headline(evaluate(model, tokenizer, config, split, device))


def final_evaluation(model, tokenizer, config: Config, device) -> list[dict]:
    """The test-split records; says first what it evaluates on (it can take a minute, silent when piped)."""
    from topoclip.evaluation.run import evaluate, evaluation_sets

    print("final evaluation: preparing the test sets...", flush=True)
    sets = evaluation_sets(config, "test")
    names = [dataset.name for group in sets for dataset in group]
    if names:
        print(f"evaluating on {len(names)} sets ({', '.join(names)})...", flush=True)
    return evaluate(model, tokenizer, config, "test", device, sets=sets)

