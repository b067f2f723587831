"""`topoclip.train(config)`: the training loop, its run folder, checkpoints and resumption.

    runs/NAME/
      config.json         the resolved config (what `--resume` continues)
      tokenizer.json      the tokenizer the run uses
      metrics.jsonl       one JSON object per logged step and per evaluation
      eval.json           the final evaluation records (CLIP_benchmark-style)
      checkpoints/step-NNNNNN/   (see topoclip.checkpoint)
      plots/*.png         loss, temperature, learning rate, evaluation metrics over training
      .lock               while a process trains in it (see topoclip.training.run_folder)

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

import dataclasses
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

from topoclip.checkpoint import (CONFIG, STEP_PREFIX, TOKENIZER, check_weights_fit, load_config_from, load_training_state,
                                 load_weights, prune_checkpoints, save_checkpoint, step_checkpoints)
from topoclip.config import DEFAULT_PRESET, Config, ConfigError, flat_dict, load_config, refuse_folder_commands, to_dict, validate
from topoclip.data.quality import BAD_SAMPLE_KINDS, BadSampleCounter, check_bad_fraction
from topoclip.data.sources import get_source
from topoclip.distributed import (DistributedInfo, barrier, broadcast_object, cleanup, gather_objects,
                                  init_distributed, is_initialized, sum_across_ranks)
from topoclip.errors import (CheckpointError, DiskFullError, NonFiniteError, RunFolderError, UserError,
                             require_device)
from topoclip.model import CLIP
from topoclip.tokenizer import Tokenizer
from topoclip.training.data import StreamPosition, prefetch_to_device, training_batches
from topoclip.training.logger import MetricsLogger
from topoclip.training.optim import build_optimizer, build_scheduler
from topoclip.training.run_folder import RunFolder, claim_run_folder, write_text_atomic
from topoclip.training.step import (SkippedSteps, autocast_context, contrastive_loss, forward_backward_loss,
                                    nonfinite_anywhere, optimizer_step, set_tf32)

# Captions read to train a vocabulary when the config names none.
TOKENIZER_TRAINING_CAPTIONS = 20_000
# Bad-sample fraction is judged only after this many samples (a few bad ones early prove nothing).
BAD_FRACTION_MIN_SEEN = 1000
# Steps with a non-finite loss skipped in a row before the run stops.
MAX_SKIPPED_STEPS = 5
# What a resume may change ("section.*": every key of the section). The rest (the model's shape, the
# data and its order, the batch, the seed, the loss, the optimiser's betas/eps) is fixed by the checkpoint.
RESUMABLE_SETTINGS = ("name", "train.steps", "train.lr", "train.warmup_steps", "train.weight_decay",
                      "train.grad_clip", "train.log_every", "train.eval_every", "train.checkpoint_every",
                      "train.keep_checkpoints", "train.device", "train.threads", "train.num_workers",
                      "train.precision", "train.compile", "train.gradient_checkpointing", "train.accumulation_steps",
                      "train.allow_tf32", "train.fused_optimizer",
                      "model.temperature.max_scale", "data.max_bad_fraction", "evaluate.*")


def build_tokenizer(config: Config, saved: Optional[Path] = None) -> Tokenizer:
    """The run's tokenizer: `saved` (a resumed run's), else data.tokenizer, else trained on the captions.

    A malformed vocabulary or tokenizer file is a UserError naming the file.
    """
    context = config.model.text.context_length
    try:
        if saved is not None:
            return Tokenizer.load(saved, context_length=context)
        if config.train.init_from and not config.data.tokenizer:  # the starting checkpoint's vocabulary
            from topoclip.training.init_from import initial_tokenizer

            return Tokenizer.load(initial_tokenizer(config), context_length=context)
        if config.data.tokenizer:
            return Tokenizer.from_vocab(config.data.tokenizer, context_length=context)
        return Tokenizer.train(training_captions(config), vocab_size=config.model.text.vocab_size, context_length=context)
    except ValueError as error:  # the tokenizer's messages name the file or the captions and the fix
        where = "the run's tokenizer" if saved is not None else ("data.tokenizer" if config.data.tokenizer else "tokenizer")
        raise UserError(f"{where}: {error}") from None


def training_captions(config: Config) -> list[str]:
    """Up to TOKENIZER_TRAINING_CAPTIONS captions of the training data (for a new vocabulary)."""
    return get_source(config.data.source).captions(config.data, TOKENIZER_TRAINING_CAPTIONS)


def check_tokenizer(tokenizer: Tokenizer, config: Config) -> None:
    """The tokenizer must fit the text tower; refused before training starts."""
    text = config.model.text
    if tokenizer.vocab_size > text.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.text.vocab_size={text.vocab_size}; "
                          f"set model.text.vocab_size={tokenizer.vocab_size}")
    if tokenizer.cls_id != text.cls_token_id:
        raise ConfigError(f"the tokenizer's [CLS] id is {tokenizer.cls_id} but model.text.cls_token_id={text.cls_token_id}; "
                          f"set model.text.cls_token_id={tokenizer.cls_id}")


def fit_to_trained_tokenizer(config: Config, tokenizer: Tokenizer) -> Config:
    """A vocabulary topoclip trains (data.tokenizer "") sets model.text.cls_token_id to its own [CLS] id.

    So a paper preset (cls_token_id 101, BERT's) runs on one's own captions as it is; the resolved
    config (config.json) records the id used. model.text.vocab_size stays: the trained vocabulary has
    at most that many tokens, the text tower keeps that many rows (unused ones cost only memory) and
    the model's shape stays the preset's. A given vocabulary (data.tokenizer set) is checked instead.
    """
    if config.data.tokenizer or tokenizer.cls_id == config.model.text.cls_token_id:
        return config
    text = dataclasses.replace(config.model.text, cls_token_id=tokenizer.cls_id)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, text=text))


def resolve_device(name: str, info: DistributedInfo) -> torch.device:
    if info.world_size > 1 or name == "auto":
        return info.device
    return torch.device(name)


def new_run_dir(config: Config) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{config.name or 'run'}-{stamp}"


def flat_settings(config: Config) -> dict[str, Any]:
    """{"train.lr": 0.0005, "model.vision.width": 768, ...}: every leaf setting by its dotted key."""
    return flat_dict(to_dict(config))


def resumable(key: str) -> bool:
    """Whether a resume may change the setting `key` (see RESUMABLE_SETTINGS)."""
    return any(key == allowed or (allowed.endswith(".*") and key.startswith(allowed[:-1]))
               for allowed in RESUMABLE_SETTINGS)


def resume_config(run_dir, config: Optional[Config] = None, typed_train_data: Optional[str] = None) -> Config:
    """The config a resume of `run_dir` trains with: its saved config, or `config` if it changes only
    RESUMABLE_SETTINGS of it. RunFolderError / CheckpointError / ConfigError otherwise, before anything is written.

    The saved config is the folder's, so it may not run a command to read its data (config.refuse_folder_commands)
    unless the user typed that data.train_data (`typed_train_data`); a `config` given is the caller's own.
    """
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG).is_file():
        raise RunFolderError(f"cannot resume {run_dir}: no {CONFIG} there; give the run folder of an earlier run")
    saved = load_config_from(run_dir)
    if config is None:
        refuse_folder_commands(saved, run_dir / CONFIG, typed_train_data)
        return saved
    before, after = flat_settings(saved), flat_settings(config)
    changed = [key for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]
    refused = [key for key in changed if not resumable(key)]
    if refused:
        shown = "; ".join(f"{key} {before.get(key)!r} -> {after.get(key)!r}" for key in refused[:3])
        raise ConfigError(f"--resume cannot change {shown}{'; ...' if len(refused) > 3 else ''}: the checkpoint's "
                          f"weights, optimiser state or data order depend on it (start a new run with --out for that); "
                          f"a resume may change only {', '.join(RESUMABLE_SETTINGS)}")
    return config


def checkpoint_step(folder: Path) -> int:
    """The step of a checkpoint folder `step-NNNNNN`."""
    return int(Path(folder).name[len(STEP_PREFIX):])


def finished(run_dir: Path, config: Config) -> Optional[str]:
    """A one-line note when the run in `run_dir` has trained all train.steps and was evaluated, else None.

    ConfigError when train.steps is below the newest checkpoint's step (nothing could be trained).
    """
    folder, steps = RunFolder(run_dir), config.train.steps
    newest = folder.newest_step()
    if newest is None:
        return None
    if newest > steps:
        raise ConfigError(f"train.steps={steps} is below step {newest} of the newest checkpoint in {run_dir}; "
                          f"to train it longer set train.steps above {newest}")
    if folder.finished(steps):
        return (f"run {run_dir} is complete: it trained all {steps} steps and was evaluated (eval.json); nothing to do. "
                f"To train it longer: topoclip train --resume {run_dir} --set train.steps=N (N > {steps})")
    return None


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


def finish_leftovers(run_dir: Path, config: Config) -> None:
    """What a run killed after writing eval.json left undone: the final record in metrics.jsonl, the plots."""
    from topoclip.evaluation.run import headline
    from topoclip.training.logger import read_metrics

    logger = MetricsLogger(run_dir)
    if not any(record.get("final") for record in read_metrics(logger.path)):
        records = json.loads(RunFolder(run_dir).evaluation.read_text(encoding="utf-8"))
        logger.log({"step": config.train.steps, "eval": headline(records), "final": True})
    if not all((RunFolder(run_dir).plots / f"{name}.png").is_file() for name in ("loss", "evaluation")):
        print(f"topoclip: note: drawing the plots of {run_dir}, which its run did not finish", file=sys.stderr)
        logger.plot()
    logger.close()


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
    device = resolve_device(settings.device, info)
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
    if main and not resuming:
        write_text_atomic(run_dir / CONFIG, json.dumps(to_dict(config), indent=2))
        tokenizer.save(run_dir / TOKENIZER)

    checkpoints_dir = RunFolder(run_dir).checkpoints
    if resuming and step_checkpoints(checkpoints_dir):  # the folder's config: its shapes checked before allocating
        require_fitting_checkpoint(step_checkpoints(checkpoints_dir), config.model)
    model = CLIP(config.model).to(device)
    if settings.init_from and not (resuming and RunFolder(run_dir).step_checkpoints()):
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
        found = step_checkpoints(checkpoints_dir)
        if found:
            start_step, used, streams = resume_newest_good(found, model, optimizer, scheduler, scaler, counter, main)
            streams = streams[min(info.rank, len(streams) - 1)] if streams else None  # this rank's
        # (a stream split another way cannot continue: refused before config.json takes the resume's changes)
        position = StreamPosition(settings.num_workers, info.world_size, streams)
        if main:
            print(f"resuming from {used.name}" if found else "no checkpoint yet: starting from step 0", flush=True)
            # Only now that the checkpoint has loaded does the saved config take the resume's changes.
            text = json.dumps(to_dict(config), indent=2)
            if (run_dir / CONFIG).read_text(encoding="utf-8") != text:
                write_text_atomic(run_dir / CONFIG, text)

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
        write_text_atomic(RunFolder(run_dir).evaluation, json.dumps(records, indent=2))
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


def parameters_finite(model: torch.nn.Module) -> bool:
    """True when every parameter is finite (one device sync for all of them).

    Reads the sum of all weights: an inf or NaN anywhere makes it non-finite (NaN + x = NaN, inf - inf
    = NaN). It is 6x cheaper on CPU than isfinite per element; only weights summing past 3e38, broken
    anyway, would also count as non-finite.
    """
    with torch.no_grad():
        sums = torch.stack([p.sum(dtype=torch.float32) for p in model.parameters()])
        return bool(torch.isfinite(sums.sum()))


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


def rng_states() -> dict:
    """This process's torch RNG states (CPU and every CUDA device), as a checkpoint stores them."""
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def save_checkpoint_and_prune(folder: Path, model, config, tokenizer, optimizer, scheduler, scaler, *, step: int,
                              counter: BadSampleCounter, rng: dict, keep: int, streams: Optional[list] = None) -> None:
    """Write checkpoint `step`, then delete all but the newest `keep` (only once the new one is complete)."""
    write_checkpoint(folder, step, model, config, tokenizer, optimizer, scheduler, scaler, counter, rng, streams)
    prune_checkpoints(folder, keep)


def write_checkpoint(folder: Path, step: int, model, config, tokenizer, optimizer, scheduler, scaler, counter,
                     rng: Optional[dict] = None, streams: Optional[list] = None) -> None:
    """Save checkpoint `step` under `folder`; a full disk is a DiskFullError that says what is intact.

    rng: the RNG states as of `step` (default: now); counter: the data counts as of `step`;
    streams: each rank's StreamPosition.state() as of `step` (user data; None for the scenes).
    """
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else {},
        "rng": rng if rng is not None else rng_states(),
        # The scenes stream is a function of the step; a user stream continues from each rank's position.
        "data": {"step": step, **counter.as_dict(), **({"streams": streams} if streams is not None else {})},
    }
    try:
        save_checkpoint(folder / f"{STEP_PREFIX}{step:06d}", model, config, tokenizer, state)
    except DiskFullError as error:
        earlier = [path for path in step_checkpoints(folder) if checkpoint_step(path) < step]
        intact = (f"the previous checkpoint step {checkpoint_step(earlier[-1])} ({earlier[-1]}) is intact" if earlier
                  else "there is no earlier checkpoint")
        raise DiskFullError(f"no space left on {error.path} while writing checkpoint step {step}; {intact}; free space "
                            f"and run `topoclip train --resume {folder.parent}`", error.path) from error


def require_fitting_checkpoint(found: list[Path], model_config) -> None:
    """The newest error of check_weights_fit when no checkpoint of `found` fits `model_config` (nothing allocated)."""
    errors = []
    for folder in reversed(found):
        try:
            return check_weights_fit(folder, model_config)
        except CheckpointError as error:
            errors.append(error)
    raise errors[0]


def resume_newest_good(found: list[Path], model, optimizer, scheduler, scaler, counter: BadSampleCounter,
                       main: bool) -> tuple[int, Path, Optional[list]]:
    """Resume from the newest of `found` that loads (weights, finite, and training state), falling back to
    the one before with a note when the newest is damaged; returns (step, the checkpoint used, the ranks'
    stream positions or None)."""
    for folder in reversed(found):
        try:
            step, streams = resume_from(folder, model, optimizer, scheduler, scaler, counter)
            return step, folder, streams
        except CheckpointError as error:
            if folder == found[0]:
                raise CheckpointError(f"no checkpoint of {folder.parent} can be resumed; the oldest: {error}") from None
            if main:
                print(f"topoclip: note: skipping damaged checkpoint {folder.name} ({error}); trying the one before",
                      file=sys.stderr)
    raise AssertionError("unreachable: found is not empty")


def resume_from(folder: Path, model, optimizer, scheduler, scaler, counter: BadSampleCounter) -> tuple[int, Optional[list]]:
    """Load weights and training state from a checkpoint folder; returns (the step to continue from, each
    rank's data-stream position, or None when the checkpoint has none: the scenes, or an older topoclip).

    CheckpointError when the weights or the state cannot be read, or the weights are not finite.
    """
    load_weights(model, folder)
    if not parameters_finite(model):
        raise CheckpointError(f"{folder} holds inf/NaN weights")
    state = load_training_state(folder)
    # The hyperparameters follow the *current* config (a resume may change train.lr, weight decay,
    # steps): keep the ones the optimizer was just built with, and recompute this step's lr.
    current = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state["optimizer"])
    for group, settings in zip(optimizer.param_groups, current):
        group.update(settings)
    scheduler.load_state_dict(state["scheduler"])
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    for group, base, schedule in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * schedule(scheduler.last_epoch)
    if scaler is not None and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    if torch.cuda.is_available() and state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    data = state["data"]
    counter += BadSampleCounter(data["kept"], data["bad"])
    return int(state["step"]), data.get("streams")
