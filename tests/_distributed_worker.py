"""Worker for tests/test_distributed.py, started by `python -m torch.distributed.run --nproc-per-node 2`.

usage: _distributed_worker.py INPUTS.pt OUT_DIR [ddp|fsdp]

Each rank joins the gloo group through topoclip.core.distributed.init_distributed (torchrun's env),
checks the collectives, then for every case in INPUTS wraps the same CLIP in DDP (or shards it with FSDP2, as
train.parallelism=fsdp does), takes its half of the global batch, runs forward_backward (twice) and writes the
mean loss, its gradients (after DDP's all-reduce; FSDP's shards put together), their global norm and whether the
weights read as finite to OUT_DIR/rank{r}.pt for the test to compare with a one-process run; and evaluates
zero-shot classification and retrieval, each rank embedding its share of an odd number of images.
"""
import atexit
import shutil
import sys
import tempfile
from pathlib import Path

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from topoclip.config import load_config  # noqa: E402
from topoclip.core.distributed import (  # noqa: E402
    barrier, broadcast_object, cleanup, gather_features, init_distributed, is_main, local_part, unwrap)
from topoclip.model.clip import CLIP  # noqa: E402
from topoclip.preprocess.tokenizer import TextBatch  # noqa: E402
from topoclip.run.training.lock import apply_locks  # noqa: E402
from topoclip.core.losses import loss_keywords  # noqa: E402
from topoclip.run.training.guard import parameters_finite  # noqa: E402
from topoclip.run.training.sharding import shard  # noqa: E402
from topoclip.run.training.step import forward_backward  # noqa: E402


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A gradient as one process holds it: an FSDP shard's full tensor, else itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def check_collectives(rank: int, world: int) -> dict:
    # Rank r holds rows filled with r + 1; the gather puts them in rank order.
    x = torch.full((3, 2), float(rank + 1), requires_grad=True)
    gathered = gather_features(x)  # (world·3, 2)
    # Every rank's loss weights all gathered rows; rank r's rows must receive Σ_r' of the weights.
    weights = torch.arange(world * 3 * 2, dtype=torch.float32).view(world * 3, 2) * (rank + 1)
    (gathered * weights).sum().backward()
    return {
        "gathered": gathered.detach(),
        "grad": x.grad,
        "broadcast": broadcast_object({"from": rank}),
        "is_main": is_main(),
    }


def main(inputs_path: str, out_dir: str, parallelism: str = "ddp") -> None:
    info = init_distributed("cpu")
    result = {"rank": info.rank, "local_rank": info.local_rank, "world_size": info.world_size,
              "device": str(info.device), "backend": dist.get_backend()}
    result.update(check_collectives(info.rank, info.world_size))

    inputs = torch.load(inputs_path)
    images, text = inputs["images"], TextBatch(inputs["input_ids"], inputs["attention_mask"])
    local = images.shape[0] // info.world_size
    lo, hi = info.rank * local, (info.rank + 1) * local
    result["cases"] = {}
    for key, case in inputs["cases"].items():
        config = load_config("tiny", case["overrides"])
        model = CLIP(config.model)
        model.load_state_dict(case["state"])
        apply_locks(model, config.train)  # as the trainer: τ frozen for the losses without one
        if parallelism == "fsdp":
            ddp = shard(model)
        else:
            ddp = DistributedDataParallel(model)
        assert unwrap(ddp) is model
        # Two steps (no optimiser step between, so the same numbers): DDP raises on the second one
        # if the first left its reducer waiting for a gradient (e.g. τ's under no_sync).
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss = forward_backward(ddp, images[lo:hi], text[lo:hi], case["loss"],
                                    accumulation_steps=case["accumulation_steps"], keywords=loss_keywords(config),
                                    entailment_weight=config.train.entailment_weight)
        mean_loss = torch.tensor(loss)
        dist.all_reduce(mean_loss)
        trained = [p for p in model.parameters() if p.requires_grad]
        result["cases"][key] = {
            "loss": mean_loss.item() / info.world_size,
            "grads": {name: whole(p.grad).clone() for name, p in model.named_parameters() if p.requires_grad},
            # the norm the trainer clips by: over every rank's gradients (FSDP: every shard), not this rank's
            "grad_norm": float(whole(torch.nn.utils.clip_grad_norm_(trained, float("inf")))),
            "finite": parameters_finite(model),
        }
    result["nan_on_rank_1_seen"] = nan_on_rank_1_seen(model, info.rank)
    result["evaluation"] = evaluation(inputs["evaluation"], parallelism)
    torch.save(result, Path(out_dir) / f"rank{info.rank}.pt")
    barrier()
    cleanup()


def nan_on_rank_1_seen(model, rank: int) -> bool:
    """Whether this rank's guard reads the weights as non-finite once rank 1 alone holds a NaN (its shard of the
    first parameter under FSDP; its replica under DDP, where a rank checks its own)."""
    with torch.no_grad():
        first = next(model.parameters())
        if rank == 1:
            local_part(first).view(-1)[0] = float("nan")
    return not parameters_finite(model)


def evaluation(case: dict, parallelism: str) -> dict:
    """Zero-shot classification and retrieval, each rank embedding its share of the images in a decoding worker
    (a sharded model: every rank runs as many forwards, its share or not)."""
    from topoclip.run.evaluation.retrieval import evaluate_retrieval
    from topoclip.run.evaluation.zeroshot import evaluate_classification_modes

    from topoclip.run.evaluation.zeroshot import embed_images

    classification, retrieval, model, tokenizer, transform = evaluation_inputs(case)
    if parallelism == "fsdp":
        shard(model)
    return {"classification": evaluate_classification_modes(model, tokenizer, classification, transform,
                                                             ["distance", "embedding"], batch_size=1, workers=1),
            "retrieval": evaluate_retrieval(model, tokenizer, retrieval, transform, batch_size=1, workers=1),
            "one_image": embed_images(model, classification.images[:1], transform, batch_size=1)}  # fewer than ranks


def evaluation_inputs(case: dict):
    """(classification set, retrieval set, model, tokenizer, transform) of tests/test_distributed.py's case."""
    from PIL import Image

    from topoclip.data.folders import LazyImages
    from topoclip.data.types import ClassificationSet, RetrievalSet
    from topoclip.preprocess.tokenizer import Tokenizer
    from topoclip.preprocess.transforms import eval_transform

    config = load_config("tiny")
    model = CLIP(config.model).eval()
    model.load_state_dict(case["state"])
    # PNG files (lossless): decoded on access, so in a decoding worker (a fork server's under torch.distributed).
    folder = Path(tempfile.mkdtemp(prefix="topoclip-evaluation-"))
    atexit.register(shutil.rmtree, folder, True)
    for index, array in enumerate(case["images"]):
        Image.fromarray(array.numpy()).save(folder / f"{index}.png")
    images = LazyImages([folder / f"{index}.png" for index in range(len(case["images"]))])
    tokenizer = Tokenizer.train(case["captions"], vocab_size=128, context_length=config.model.text.context_length)
    classification = ClassificationSet("odd", images, case["labels"], ["red", "green", "blue"], ["a {}.", "the {}!"])
    retrieval = RetrievalSet("pairs", images, case["captions"], torch.arange(len(images)))
    vision = config.model.vision
    return classification, retrieval, model, tokenizer, eval_transform(vision.image_size, vision.mean, vision.std)


if __name__ == "__main__":
    main(*sys.argv[1:])
