"""`topoclip.train(config)`: the training loop in its run folder (layout: topoclip.io.run_folder).

The run reads top-down: `build` (training.build: the tokenizer, the model and its TrainState, restored when
resuming), `train_steps` (the loop), `finish` (the final evaluation). Around them: the tokenizer (training.tokenizer_setup), the training
state a checkpoint saves and a resume restores (training.state), what a resume may change (training.resume), the
step (training.step) and its guards (training.guard), the batches (training.data).

Only rank 0 writes; every rank resumes from the same checkpoint. The data stream of the built-in
scenes is a function of the step, so an interrupted and resumed CPU fp32 run reproduces the
losses of an uninterrupted one.

A run folder is never reused silently: a fresh run needs a new or empty folder, and one process at
a time holds a folder. A resume continues the saved config and may change only RESUMABLE_SETTINGS
(how long and how fast it trains, how often it logs, evaluates and saves, where it computes, what
it is evaluated on); any other change is refused before anything is written, and config.json is
replaced (atomically) only once the checkpoint has loaded. Resuming a finished run says so and
changes nothing.

Non-finite values never reach a checkpoint: the step's guards (training.guard) skip a step whose
loss is inf/NaN and stop the run, in one line, on weights that became inf/NaN.
"""
from __future__ import annotations

import contextlib
import json
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional, Union

from tqdm.auto import tqdm

from topoclip.config import (DEFAULT_PRESET, Config, ConfigError, load_config, require_lora_library, to_dict, validate,
                             validate_readable)
from topoclip.data.quality import BAD_SAMPLE_KINDS, BadSampleCounter, check_bad_fraction
from topoclip.core.distributed import (DistributedInfo, barrier, broadcast_object, cleanup, gather_objects, init_distributed,
                                  launch_rank, sum_across_ranks)
from topoclip.core.errors import UserError, require_device
from topoclip.run.training.data import prefetch_to_device, training_batches
from topoclip.run.training.logger import MetricsLogger
from topoclip.run.training.resume import finish_leftovers, finished, resume_config
from topoclip.run.training.state import TrainState
from topoclip.core.atomic import write_text_atomic
from topoclip.io.run_folder import RunFolder, claim_run_folder
from topoclip.run.training.guard import StepGuard
from topoclip.core.losses import loss_keywords
from topoclip.run.training.step import (batch_loss, forward_backward_loss, loss_at, optimizer_step,
                                     process_settings)
from topoclip.run.training.build import Run, build

# Bad-sample fraction is judged only after this many samples (a few bad ones early prove nothing).
BAD_FRACTION_MIN_SEEN = 1000


def new_run_dir(config: Config, parent: Union[str, Path] = "runs") -> Path:
    """PARENT/NAME-TIMESTAMP: a new run's folder when none is given."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(parent) / f"{config.name or 'run'}-{stamp}"


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
        from topoclip.run.training.init_from import check_initial_checkpoint, check_initial_weights_finite

        check_initial_checkpoint(config)
        check_initial_weights_finite(config)
    if resume is not None:
        note = finished(run_dir, config)
        if note is not None:
            if launch_rank() == 0:  # (no process group yet: the launcher's variables say which process this is)
                with claim_run_folder(run_dir, resuming=True):
                    finish_leftovers(run_dir, config)
                print(note)
            return run_dir
    train_config = config.train
    info = init_distributed(train_config.device, group_of_one=train_config.parallelism == "fsdp")
    try:
        with process_settings(train_config.threads, train_config.allow_tf32 if info.device.type == "cuda" else None):
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
    # The default folder's name holds the second its process started, which two ranks need not share: rank 0's
    # folder is the run's on every rank.
    run_dir = Path(broadcast_object(str(run_dir)))
    # The user's evaluation sets are listed now, not found broken after hours of training; the training data's
    # table opened before a run folder is made for it.
    require_lora_library(config)  # (a model trained with LoRA loads without it: its checkpoints are merged)
    on_main(info.rank == 0, lambda: (check_evaluation_sets(config), validate_readable(config.data, config.train.batch_size)))
    created = []  # the folders this run makes: the run folder and those above it that do not exist yet
    if info.rank == 0 and not resuming:
        folder = run_dir
        while not folder.exists() and folder != folder.parent:
            created.append(folder)
            folder = folder.parent
    lock = on_main(info.rank == 0, lambda: claim_run_folder(run_dir, resuming))
    failed = True
    try:
        result = _train_in_folder(config, run_dir, resuming, info, progress)
        failed = False
        return result
    finally:
        def remove_empty() -> None:  # the folders a failed run made and left empty, the run folder first
            with contextlib.suppress(OSError):  # one that is not empty holds what was written there: kept, and above
                for folder in created if failed else ():
                    folder.rmdir()

        if lock is not None:  # removed under the lock: no other process can claim the folder in between
            lock.release(before_unlocking=remove_empty)
        else:
            remove_empty()


def _train_in_folder(config: Config, run_dir: Path, resuming: bool, info: DistributedInfo, progress: bool) -> Path:
    run = build(config, RunFolder(run_dir), resuming, info)
    logger = MetricsLogger(run_dir, enabled=run.main, resume_step=run.state.step, report_to=run.config.train.report_to,
                           config=to_dict(run.config))
    train_steps(run, logger, progress)
    finish(run, logger)
    return run_dir


def train_steps(run: Run, logger: MetricsLogger, progress: bool) -> None:
    """From the state's step to train.steps: each step the batch, the loss and its gradient, the guards' verdict
    and the update; the log, the validation and the checkpoint when due."""
    config, state, device, main = run.config, run.state, run.device, run.main
    settings, model = config.train, state.model
    batches = prefetch_to_device(training_batches(config, state.step, run.info.rank, run.info.world_size,
                                                  tokenizer=run.tokenizer, pin_memory=device.type == "cuda",
                                                  stream=run.resumed_stream), device, config.model.vision.mean,
                                 config.model.vision.std)
    bar = tqdm(range(state.step, settings.steps), initial=state.step, total=settings.steps,
               disable=not (progress and main), desc="train", dynamic_ncols=True)
    window_start, window_images = time.perf_counter(), 0
    guard = StepGuard(device, run.folder, config, main, state.skipped)
    keywords = loss_keywords(config)  # the loss's margin and the topology's best similarity
    for step in bar:
        batch = next(batches)
        run.position.advance(batch)
        done = step + 1
        # Every rank judges (and rank 0 logs) the counts of all ranks, so all stop together.
        state.counter += global_counts(batch, device)
        check_bad_fraction(state.counter, config.data.max_bad_fraction, BAD_FRACTION_MIN_SEEN)
        images = batch.images.to(device, non_blocking=True)
        text = (batch.text if batch.text is not None else run.tokenizer(batch.captions)).to(device, non_blocking=True)
        model.train()
        loss_name = loss_at(settings, step)  # train.loss, or triplet during max-hinge's warm-up
        terms = {}  # the loss's parts, where it has several (MERU's contrastive and entailment losses)
        loss = forward_backward_loss(run.trained, images, text, loss_name, accumulation_steps=settings.accumulation_steps,
                                     precision=settings.precision, scaler=state.scaler, keywords=keywords,
                                     entailment_weight=settings.entailment_weight, terms=terms)
        checkpoint_due = done == settings.steps or (settings.checkpoint_every and done % settings.checkpoint_every == 0)
        evaluation_due = settings.eval_every and (done % settings.eval_every == 0 or done == settings.steps)
        verdict = guard.judge(model, loss, done, reads_due=checkpoint_due or evaluation_due
                              or done % settings.log_every == 0)
        if verdict.vouched is not None:  # the checkpoint held at the last step: its weights gave a finite loss
            save(run, verdict.vouched)
        grad_norm = update(state, guard, verdict, settings.grad_clip, done)
        advance_schedule(state.scheduler)
        window_images += settings.batch_size
        if done % settings.log_every == 0 or done == settings.steps:
            elapsed = time.perf_counter() - window_start
            scale = float(model.temperature.scale.detach())
            # the global batch's loss, and its parts: each a mean over the rows, so the mean over the ranks
            loss_value, *parts = (value / run.info.world_size for value in
                                  sum_across_ranks([verdict.loss, *map(float, terms.values())], device))
            logger.log({"step": done, "loss": loss_value, **dict(zip(terms, parts)), "scale": scale,
                        "t": float(model.temperature.t.detach()),
                        "lr": state.scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                        "images_per_s": window_images / max(elapsed, 1e-9), "data": state.counter.as_dict(),
                        **(learned_geometry(model) if model.curvature is not None else {}),
                        # fp16: GradScaler's scale, halved at each step whose gradients overflowed (that step skipped)
                        **({"loss_scale": state.scaler.get_scale()} if state.scaler is not None else {}),
                        **({"skipped_steps": guard.skipped} if guard.skipped else {})})
            bar.set_postfix(loss=f"{loss_value:.3f}", tau=f"{scale:.2f}")
            window_start, window_images = time.perf_counter(), 0
        if evaluation_due:  # every rank embeds its share of the images (the last step too: the schedule's end on val)
            values = run_evaluation(model, run.tokenizer, config, "val", device)
            if main:
                logger.log({"step": done, "eval": values})
        if checkpoint_due:
            snapshot = state.snapshot(done, gather_objects(run.position.state()) if run.user_stream else None,
                                      guard.skipped)
            if done < settings.steps:
                guard.hold(snapshot)
            else:
                guard.vouch_last(batch_loss(model, images, text, loss_name, settings.precision, keywords,
                                            settings.entailment_weight), done)
                save(run, snapshot)
        # Kept from the first trainer: every rank waits for the others at the end of each step. DDP's all-reduce
        # and the guards' already synchronise the ranks, so this costs only time; removing it is left for a
        # measurement on GPUs.
        barrier()
    bar.close()


def learned_geometry(model) -> dict[str, float]:
    """A hyperbolic model's learned c and tower scalings α, logged as MERU logs them (its curv, visual_alpha and
    textual_alpha): c on its clamp's floor or α at 1 is where the space stopped learning its scale."""
    curvature = model.curvature
    return {"curvature": float(model.curvature_value.detach()), "alpha_image": float(curvature.scale("image").detach()),
            "alpha_text": float(curvature.scale("text").detach())}


def save(run: Run, snapshot: dict) -> None:
    """Checkpoint `snapshot` of the run's state: made on every rank (FSDP gathers the weights and writes the
    optimiser's shards), the rest written by rank 0."""
    gathered = run.state.gathered(run.folder.checkpoints, snapshot["step"], run.main)
    on_main(run.main, lambda: run.state.save(run.folder.checkpoints, run.config, run.tokenizer, snapshot,
                                             run.config.train.keep_checkpoints, gathered))


def update(state: TrainState, guard: StepGuard, verdict, grad_clip: float, step: int) -> float:
    """The optimiser step the guards' verdict allows; the gradient norm (nan for a skipped step the host saw)."""
    if not verdict.checked:  # not read on the host: a non-finite loss skips the update on the device
        return optimizer_step(state.model, state.optimizer, state.scaler, grad_clip, skip=verdict.nonfinite)
    if not verdict.finite:
        state.optimizer.zero_grad(set_to_none=True)
        return float("nan")
    grad_norm = optimizer_step(state.model, state.optimizer, state.scaler, grad_clip)
    guard.check_update(state.model, step)
    return grad_norm


def finish(run: Run, logger: MetricsLogger) -> None:
    """The final evaluation on every rank; rank 0 writes eval.json, the last metrics record, the plots and the
    summary."""
    config, model, main = run.config, run.state.model, run.main
    records = final_evaluation(model, run.tokenizer, config, run.device, main)  # every rank embeds its share
    if main:
        from topoclip.run.evaluation.run import (headline, no_evaluation_sets, summary_table, table_rows,
                                             temperature_summary)

        steps = config.train.steps
        write_text_atomic(run.folder.evaluation, json.dumps(records, indent=2))
        logger.log({"step": steps, "eval": headline(records), "final": True})
        logger.final_table(*table_rows(records), step=steps)
        plots = logger.plot()
        print(summary_table(records) if records else no_evaluation_sets(config))
        print(f"\n{temperature_summary(model)}")
        print(f"plots: {run.folder.plots.resolve()}  ({', '.join(path.stem for path in plots)})")
        print(f"run folder: {run.folder.path.resolve()}  (config.json, metrics.jsonl, eval.json, checkpoints/, plots/)")
    logger.close()
    # Every rank leaves together: a rank that destroys its gloo group while rank 0 still evaluates can abort
    # ("terminate called without an active exception"; seen in tests/training/test_train_distributed.py).
    barrier()


def advance_schedule(scheduler) -> None:
    """One step of the lr schedule. A skipped step (non-finite loss) advances it too, deliberately: the lr
    follows the step count, as under a GradScaler; torch's warning when the very first step was skipped
    ("lr_scheduler.step() before optimizer.step()") is about the opposite mistake, and is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before", category=UserWarning)
        scheduler.step()


def check_evaluation_sets(config: Config) -> None:
    """List the user's evaluation sets of every split training will use; EvaluationSetError when one is unusable."""
    from topoclip.run.evaluation.run import user_evaluation_sets

    for split in (["val"] if config.train.eval_every else []) + ["test"]:
        user_evaluation_sets(config, split)


def global_counts(batch, device) -> BadSampleCounter:
    """This step's kept and skipped samples summed over every rank."""
    kinds = sorted(BAD_SAMPLE_KINDS)
    values = sum_across_ranks([len(batch)] + [batch.bad_samples.get(kind, 0) for kind in kinds], device)
    return BadSampleCounter(int(values[0]), {kind: int(v) for kind, v in zip(kinds, values[1:]) if v})


def run_evaluation(model, tokenizer, config: Config, split: str, device) -> dict:
    from topoclip.run.evaluation.run import evaluate, headline

    return headline(evaluate(model, tokenizer, config, split, device))


def final_evaluation(model, tokenizer, config: Config, device, main: bool = True) -> list[dict]:
    """The test-split records; the main process says first what it evaluates on (it can take a minute)."""
    from topoclip.run.evaluation.run import evaluate, evaluation_sets

    if main:
        print("final evaluation: preparing the test sets...", flush=True)
    sets = evaluation_sets(config, "test")
    names = [dataset.name for group in sets for dataset in group]
    if names and main:
        print(f"evaluating on {len(names)} sets ({', '.join(names)})...", flush=True)
    return evaluate(model, tokenizer, config, "test", device, sets=sets)

