"""One training step's forward + backward of the contrastive loss, with exact gradient accumulation.

The trainer calls :func:`forward_backward`, then unscales (fp16), clips, steps the optimiser and
clamps τ (and a hyperbolic model's curvature). The step works the same for a plain CLIP, DDP(CLIP) and torch.compile'd wrappers: the
forward goes through the wrapper (so DDP sees it), scoring through ``unwrap(model).similarity``.

Distributed (OpenCLIP's local loss): each rank scores its b local rows against the world·b gathered columns,
with gradients flowing back through the gather (:func:`topoclip.core.distributed.gather_features`);
the mean over ranks of the local losses, and DDP's averaged gradients, equal the single-process
loss and gradients on the global batch.

Gradient accumulation (OpenCLIP's ``accum_freq``) is *exact*: a contrastive loss does not split
into a sum over micro-batches (every row's softmax runs over the whole batch), so the step

1. computes every micro-batch's embeddings without gradients and caches them;
2. for each micro-batch j, recomputes j's embeddings with gradients, puts them in place of j's
   cached rows, gathers across ranks, evaluates the loss of the whole local batch against the whole
   global batch and backpropagates. Only j's rows carry gradient, so the k backward passes sum to
   the full-batch gradient.

The recomputation must reproduce pass 1 exactly: true here because the towers have no dropout or
other randomness (a model with dropout would need its RNG state replayed per micro-batch). τ and
β enter every one of the k losses, and so does a hyperbolic model's curvature c where it scores (the
distance, the entailment cones); that gradient is taken from the last micro-batch only (the others see
them detached), so it is counted once, not k times.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from topoclip.core.distributed import gather_features, get_rank, is_initialized, unwrap
from topoclip.core.losses import get_loss
from topoclip.preprocess.tokenizer import TextBatch

PRECISIONS: dict[str, Optional[torch.dtype]] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}



def loss_at(settings, step: int) -> str:
    """The loss of 0-based step `step`: train.loss, except max-hinge's first train.max_hinge_warmup_steps steps,
    which use the triplet loss with the same margin (VSE∞'s warm-up on the sum of hinges)."""
    if settings.loss == "max-hinge" and step < settings.max_hinge_warmup_steps:
        return "triplet"
    return settings.loss


def autocast_context(precision: str, device_type: str):
    """"fp32" -> no autocast; "bf16" / "fp16" -> torch.autocast(device_type, dtype)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {sorted(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def contrastive_loss(model: nn.Module, image_embeds: torch.Tensor, text_embeds: torch.Tensor,
                     scale: torch.Tensor, bias: Optional[torch.Tensor], loss_name: str,
                     distributed: bool, keywords: Optional[dict] = None, entailment_weight: float = 0.0,
                     curvature: Optional[torch.Tensor] = None, terms: Optional[dict] = None) -> torch.Tensor:
    """The 0-d fp32 loss of the local rows against all columns.

    Losses that read only the image→text rows (`Loss.image_rows_only`) skip the text→image block: a second
    gather and a second (b, B) score. keywords: `loss_keywords` (margin, best) for the losses that use them.
    entailment_weight: MERU's entailment loss of the local pairs (caption cone ∋ image), added with this weight; a
    mean over the local rows, so the ranks' average is the global batch's and accumulation's k passes sum to it.
    curvature: a hyperbolic model's c as the forward gave it (`CLIPOutput.curvature`); None: the model's own.
    terms: with the entailment loss, filled with the loss's two parts, detached, as MERU logs them:
    "contrastive_loss" and "entailment_loss" (unweighted); the loss is contrastive + entailment_weight · entailment.

    image_embeds, text_embeds: (b, m, n) this process's embeddings on the model's space.
    distributed: gather the columns from every rank (world·b of them) with gradients; local row i
    is then global column rank·b + i. Without a process group this is the one-process loss.
    """
    core = unwrap(model)
    loss = get_loss(loss_name)
    if distributed and is_initialized():
        if loss.image_rows_only:
            all_text = gather_features(text_embeds)  # (world·b, m, n)
        else:
            # One gather for both: its backward is one collective, so every rank runs the same collectives in the same
            # order whatever its graph (a data-dependent score, e.g. the near pairs a rank recomputes, can reorder two
            # gathers' backwards on one rank only, and gloo/NCCL would then swap the two blocks' gradients silently).
            both = gather_features(torch.stack([image_embeds, text_embeds], dim=1))  # (world·b, 2, m, n)
            all_images, all_text = both[:, 0], both[:, 1]
        similarity_image_text = core.similarity(image_embeds, all_text, curvature=curvature)  # (b, world·b) fp32
        if loss.image_rows_only:
            similarity_text_image = similarity_image_text  # placeholder: the loss does not read it
        else:
            similarity_text_image = core.similarity(text_embeds, all_images, curvature=curvature)  # (b, world·b)
        value = loss(similarity_image_text, similarity_text_image, scale, bias, local_index=get_rank(), **(keywords or {}))
    else:
        similarity_image_text = core.similarity(image_embeds, text_embeds, curvature=curvature)  # (b, b) fp32
        value = loss(similarity_image_text, similarity_image_text.T, scale, bias, local_index=0, **(keywords or {}))
    if entailment_weight:
        entailment = core.entailment(text_embeds, image_embeds, curvature)
        if terms is not None:
            terms.update(contrastive_loss=value.detach(), entailment_loss=entailment.detach())
        value = value + entailment_weight * entailment
    return value


def _backward(loss: torch.Tensor, scaler: Optional[torch.amp.GradScaler]) -> None:
    if scaler is not None:
        scaler.scale(loss).backward()
    else:
        loss.backward()


def forward_backward(model: nn.Module, images: torch.Tensor, text: TextBatch, loss_name: str = "infonce", *,
                     accumulation_steps: int = 1, precision: str = "fp32",
                     scaler: Optional[torch.amp.GradScaler] = None, keywords: Optional[dict] = None,
                     entailment_weight: float = 0.0) -> float:
    """:func:`forward_backward_loss`, its loss read as a float (on a GPU: waits for the step to finish)."""
    return float(forward_backward_loss(model, images, text, loss_name, accumulation_steps=accumulation_steps,
                                       precision=precision, scaler=scaler, keywords=keywords,
                                       entailment_weight=entailment_weight))


def forward_backward_loss(model: nn.Module, images: torch.Tensor, text: TextBatch, loss_name: str = "infonce", *,
                          accumulation_steps: int = 1, precision: str = "fp32",
                          scaler: Optional[torch.amp.GradScaler] = None, keywords: Optional[dict] = None,
                          entailment_weight: float = 0.0, terms: Optional[dict] = None) -> torch.Tensor:
    """Forward + backward of the contrastive loss on this process's batch; returns the 0-d loss, unread.

    Nothing here reads a device value, so on a GPU the host can queue the next step meanwhile.

    model: CLIP, DDP(CLIP) or a compiled wrapper; gradients are accumulated into `.grad` (the caller
        zeroes them). Under DDP they are all-reduced by the last backward.
    images: (b, 3, H, W); text: TextBatch of b captions, on the model's device.
    accumulation_steps: k micro-batches of b/k samples (k must divide b); gradients and loss equal
        the k = 1 step's up to rounding, for one extra forward pass without gradients and the
        activation memory of one micro-batch.
    precision: "fp32", "bf16" or "fp16" (autocast for the towers; similarities and loss stay fp32).
    scaler: required for fp16 (the loss is scaled before backward); the caller unscales and steps.
    keywords: the loss's margin and best (`loss_keywords`); None: each loss's defaults.
    entailment_weight: train.entailment_weight (hyperbolic models; see `contrastive_loss`).
    terms: filled with the loss's parts where it has several (`contrastive_loss`): the whole local batch's at every k.
    Returns: the full local-batch loss (the same number for every k), detached, on the model's device.
    """
    if precision == "fp16" and scaler is None:
        raise ValueError("precision fp16 needs a torch.amp.GradScaler (gradients underflow in fp16 otherwise)")
    batch = images.shape[0]
    if len(text) != batch:
        raise ValueError(f"{batch} images but {len(text)} captions")
    if accumulation_steps < 1 or batch % accumulation_steps:
        raise ValueError(f"accumulation_steps={accumulation_steps} must be ≥ 1 and divide the local batch {batch}")
    distributed = is_initialized()
    device_type = images.device.type

    if accumulation_steps == 1:
        with autocast_context(precision, device_type):
            out = model(images, text)
        loss = contrastive_loss(model, out.image_embeds, out.text_embeds, out.scale, out.bias, loss_name, distributed,
                                keywords, entailment_weight, out.curvature, terms)
        _backward(loss, scaler)
        return loss.detach()

    micro = batch // accumulation_steps
    bounds = [(j * micro, (j + 1) * micro) for j in range(accumulation_steps)]

    # Pass 1: every micro-batch's embeddings, no graph kept. (b, m, n) fp32 each once concatenated.
    with torch.no_grad(), autocast_context(precision, device_type):
        cached = [model(images[lo:hi], text[lo:hi]) for lo, hi in bounds]
    cached_images = torch.cat([out.image_embeds for out in cached])
    cached_text = torch.cat([out.text_embeds for out in cached])
    del cached

    # Pass 2: micro-batch j live, the rest cached; DDP all-reduces only on the last backward. FSDP reduce-scatters
    # every micro-batch's gradient: the sum of the averages is the average of the sums, and the gradient stays
    # sharded (skipping the sync would hold the whole gradient on every rank between micro-batches).
    no_sync = getattr(model, "no_sync", None)  # DDP (also reached through a torch.compile wrapper)
    loss = None
    for j, (lo, hi) in enumerate(bounds):
        last = j == accumulation_steps - 1
        with (no_sync() if no_sync is not None and not last else contextlib.nullcontext()):
            with autocast_context(precision, device_type):
                out = model(images[lo:hi], text[lo:hi])
            image_embeds = torch.cat([cached_images[:lo], out.image_embeds, cached_images[hi:]])  # (b, m, n)
            text_embeds = torch.cat([cached_text[:lo], out.text_embeds, cached_text[hi:]])
            # τ, β and the curvature's direct part: gradient from one of the k identical losses only (see the module
            # docstring); c's part through micro-batch j's exponential map is j's own, as every tower weight's.
            scale = out.scale if last else out.scale.detach()
            bias = out.bias if (last or out.bias is None) else out.bias.detach()
            curvature = out.curvature if (last or out.curvature is None) else out.curvature.detach()
            loss = contrastive_loss(model, image_embeds, text_embeds, scale, bias, loss_name, distributed, keywords,
                                    entailment_weight, curvature, terms)
            _backward(loss, scaler)
    return loss.detach()


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Optional[torch.amp.GradScaler] = None,
                   grad_clip: float = 0.0, skip: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Clip (global norm; 0 = no clip), step (through the fp16 scaler if any), zero the gradients and clamp τ.

    skip: a 0-d device tensor, non-zero when this update must not happen (a non-finite loss). A
        fused optimizer (CUDA) skips on the device — its found-inf input, as for fp16 overflow — so the
        host never waits; any other optimizer, or an fp16 scaler, reads it on the host first.
    Returns the gradient norm before clipping, a 0-d tensor not read here (inf/nan when an fp16 step
    overflowed, nan when skipped on the host).
    """
    if skip is not None and not (scaler is None and skips_on_device(optimizer)):
        if bool(skip):
            optimizer.zero_grad(set_to_none=True)
            return torch.tensor(float("nan"))
        skip = None
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    parameters = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(parameters, grad_clip if grad_clip > 0 else float("inf"))
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    elif skip is not None:
        # The fused kernel leaves weights, moments and step counts untouched where found_inf is 1.
        optimizer.found_inf = skip.to(torch.float32).reshape(())
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    core = unwrap(model)
    core.temperature.clamp_()  # τ ≤ max_scale after every step
    if getattr(core, "curvature", None) is not None:
        core.curvature.clamp_()  # c within [init/10, 10·init], α ≤ 1 (MERU)
    return grad_norm.detach()


def nonfinite_anywhere(loss: torch.Tensor) -> torch.Tensor:
    """0-d float32 on the loss's device: 1 when the loss is inf/NaN on this or any other rank, else 0.

    The ranks' gradients are averaged, so one rank's non-finite loss skips the step on all. Nothing is
    read on the host (the all-reduce of a GPU tensor is queued like a kernel).
    """
    flag = (~torch.isfinite(loss)).to(torch.float32).reshape(())
    if is_initialized():
        torch.distributed.all_reduce(flag)
        flag = flag.clamp(max=1.0)
    return flag


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` can skip an update on the device (torch's fused Adam/AdamW/SGD read `found_inf`)."""
    return bool(optimizer.defaults.get("fused")) and getattr(optimizer, "_step_supports_amp_scaling", False)


def set_tf32(allowed: bool) -> None:
    """Let fp32 matrix products and convolutions on CUDA use TF32 tensor cores (train.allow_tf32).

    TF32 keeps fp32's range with a 10-bit mantissa (as bf16 autocast keeps 7); it is what OpenCLIP's
    trainer sets. No effect on CPU, nor on bf16/fp16 products.
    """
    torch.backends.cuda.matmul.allow_tf32 = allowed
    torch.backends.cudnn.allow_tf32 = allowed


@contextlib.contextmanager
def process_settings(threads: int, tf32: Optional[bool]) -> Iterator[None]:
    """Torch's process-wide CPU threads (0: leave them) and TF32 flags (None: leave them) for the block, restored
    after it: `topoclip.train` in a notebook or a test must not change the precision of the caller's fp32 products
    (the GPU check found a later fp32 comparison running in TF32 after a training run in the same process)."""
    before = (torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        if threads:
            torch.set_num_threads(threads)
        if tf32 is not None:
            set_tf32(tf32)
        yield
    finally:
        torch.set_num_threads(before[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[1:]


def batch_loss(model, images, text, loss_name: str, precision: str, keywords: Optional[dict] = None,
               entailment_weight: float = 0.0) -> torch.Tensor:
    """The loss of the current weights on a batch, without gradients (0-d, on the model's device)."""
    with torch.no_grad():
        with autocast_context(precision, images.device.type):
            out = model(images, text)
        return contrastive_loss(model, out.image_embeds, out.text_embeds, out.scale, out.bias, loss_name,
                                is_initialized(), keywords, entailment_weight, out.curvature)
