"""Distributed training equals one process on the global batch.

One torchrun launch (2 gloo processes on CPU, tests/_distributed_worker.py) runs every case; the
test compares each rank's mean loss and post-all-reduce gradients with a one-process step.
"""
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from topoclip.core import distributed
from topoclip.config import load_config
from topoclip.core.distributed import DistributedInfo, gather_features, init_distributed, unwrap
from topoclip.model.clip import CLIP
from topoclip.preprocess.tokenizer import TextBatch
from topoclip.run.training.lock import apply_locks
from topoclip.core.losses import loss_keywords
from topoclip.run.training.step import forward_backward

from _launch import free_port, launch_env
from _tolerance import assert_fp32_close, model_roundings

WORLD = 2
GLOBAL_BATCH = 8
WORKER = Path(__file__).resolve().parents[1] / "_distributed_worker.py"
LAUNCH_TIMEOUT_S = 180

CASES = {  # key: (loss, accumulation steps per rank, config overrides)
    "infonce": ("infonce", 1, []),
    "sigmoid": ("sigmoid", 1, ["model.temperature.bias_init=-10", "train.loss=sigmoid"]),
    "infonce-accum2": ("infonce", 2, []),
    "sigmoid-accum2": ("sigmoid", 2, ["model.temperature.bias_init=-10", "train.loss=sigmoid"]),
    # The metric-learning losses (no τ): the hardest negative is taken over the global batch.
    "contrastive": ("contrastive", 1, ["train.loss=contrastive"]),
    "triplet": ("triplet", 1, ["train.loss=triplet"]),
    "max-hinge": ("max-hinge", 1, ["train.loss=max-hinge", "train.margin=0.5"]),
    "max-hinge-accum2": ("max-hinge", 2, ["train.loss=max-hinge", "train.margin=0.5"]),
    "n-pair": ("n-pair", 1, ["train.loss=n-pair"]),
    # MERU: the hyperbolic distance, its curvature and scalings, and the entailment loss of each rank's pairs. The
    # product case failed once the near pairs an untrained model's directions make were recomputed on one rank and
    # not the other: the two gathers' backwards ran in another order there, and their gradients were swapped.
    "lorentz-entailment-accum2": ("infonce", 2, ["model.topology=lorentz", "train.entailment_weight=0.2"]),
    "lorentz-product-entailment": ("infonce", 1, ["model.topology=lorentz-product", "model.class_tokens=2",
                                                  "train.entailment_weight=0.2"]),
}


# Seven images (shares of 4 and 3) with labels and one caption each, for the evaluation under two ranks.
_pixels = torch.Generator().manual_seed(2)
EVALUATION = {"images": torch.randint(0, 256, (7, 40, 48, 3), generator=_pixels, dtype=torch.uint8),
              "labels": torch.tensor([0, 1, 2, 0, 1, 2, 0]),
              "captions": ["a red circle", "a green square", "a blue star", "two red circles", "one green square",
                           "a blue triangle", "a red star"],
              "state": CLIP(load_config("tiny").model).state_dict()}


def global_batch(config):
    generator = torch.Generator().manual_seed(1)
    size, length = config.vision.image_size, config.text.context_length
    images = torch.randn(GLOBAL_BATCH, 3, size, size, generator=generator)
    ids = torch.randint(5, config.text.vocab_size, (GLOBAL_BATCH, length), generator=generator)
    ids[:, 0] = config.text.cls_token_id
    mask = torch.arange(length)[None] < torch.randint(3, length + 1, (GLOBAL_BATCH, 1), generator=generator)
    return images, TextBatch(ids.masked_fill(~mask, 0), mask)


@pytest.fixture(scope="module", params=["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def run(tmp_path_factory, request):
    """(models, images, text, results per rank) of one 2-process launch over every case, under DDP or FSDP."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp(request.param)
    models = {key: CLIP(load_config("tiny", overrides).model) for key, (_, _, overrides) in CASES.items()}
    images, text = global_batch(next(iter(models.values())).config)
    torch.save({
        "images": images, "input_ids": text.input_ids, "attention_mask": text.attention_mask,
        "cases": {key: {"loss": loss, "accumulation_steps": steps, "overrides": overrides,
                        "state": models[key].state_dict()}
                  for key, (loss, steps, overrides) in CASES.items()},
        "evaluation": EVALUATION,
    }, folder / "inputs.pt")

    env = launch_env()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(WORLD),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               str(WORKER), str(folder / "inputs.pt"), str(folder), request.param]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    results = [torch.load(folder / f"rank{r}.pt") for r in range(WORLD)]
    return models, images, text, results


@pytest.mark.slow
def test_workers_join_a_gloo_group_from_torchruns_environment(run):
    *_, results = run
    for rank, result in enumerate(results):
        assert (result["rank"], result["local_rank"], result["world_size"]) == (rank, rank, WORLD)
        assert result["device"] == "cpu" and result["backend"] == "gloo"
        assert result["is_main"] == (rank == 0)
        assert result["broadcast"] == {"from": 0}


def test_gather_features_orders_blocks_by_rank_and_sums_gradients(run):
    *_, results = run
    expected = torch.cat([torch.full((3, 2), float(r + 1)) for r in range(WORLD)])
    # Rank r' weighted the gathered rows by arange · (r' + 1): rank r's rows get Σ_r' of those.
    weights = torch.arange(WORLD * 3 * 2, dtype=torch.float32).view(WORLD * 3, 2)
    total = weights * sum(r + 1 for r in range(WORLD))
    for rank, result in enumerate(results):
        # small integers: exact in fp32 in any order
        torch.testing.assert_close(result["gathered"], expected, atol=0, rtol=0)
        torch.testing.assert_close(result["grad"], total[rank * 3:(rank + 1) * 3], atol=0, rtol=0)


@pytest.mark.parametrize("key", sorted(CASES))
def test_two_ranks_equal_one_process_on_the_global_batch(run, key):
    models, images, text, results = run
    loss_name = CASES[key][0]
    # The exact answer: one process on the global batch in float64. Each rank's fp32 result sums the
    # same terms in another order (its half, then the all-reduce), so it is held to the fp32 bound of
    # the network's reductions (tests/_tolerance.py), which no summation order can exceed.
    reference = copy.deepcopy(models[key]).double()
    config = load_config("tiny", CASES[key][2])
    apply_locks(reference, config.train)
    expected_loss = forward_backward(reference, images.double(), text, loss_name, keywords=loss_keywords(config),
                                     entailment_weight=config.train.entailment_weight)
    expected = {name: p.grad for name, p in reference.named_parameters() if p.requires_grad}
    roundings = model_roundings(reference.config, GLOBAL_BATCH)
    for rank, result in enumerate(results):
        case = result["cases"][key]
        assert_fp32_close(torch.tensor(case["loss"]), torch.tensor(expected_loss, dtype=torch.float64), roundings,
                          f"rank {rank}: loss")
        assert set(case["grads"]) == set(expected)
        for name, grad in expected.items():
            assert grad.abs().max() > 0, f"{name}: zero gradient, the comparison would be vacuous"
            assert_fp32_close(case["grads"][name], grad, roundings, f"rank {rank}: {name}")
        # The norm clipping uses: of the whole gradient (every rank's, every shard's). It is a sum of the squares
        # the assertions above bound elementwise, so within the same fp32 bound of the float64 norm.
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in expected.values()]))
        assert_fp32_close(torch.tensor(case["grad_norm"]), norm, roundings, f"rank {rank}: gradient norm")
        assert case["finite"] is True


def test_a_non_finite_weight_on_one_rank_is_seen(run, request):
    # The guards read the weights every so often; under FSDP each rank holds other shards, so a NaN in rank 1's must
    # stop every rank (the check is all-reduced), else rank 0 would save a checkpoint holding it.
    *_, results = run
    seen = [result["nan_on_rank_1_seen"] for result in results]
    assert seen == ([True, True] if request.node.callspec.params["run"] == "fsdp" else [False, True])


def test_two_ranks_evaluate_as_one_process(run):
    """Each rank embeds its share of the images (4 and 3, in a decoding worker) and gathers the features: every
    rank gets the one-process records. Each image is embedded alone (batch 1) in both runs, the same fp32
    operations on one thread, so the records are equal, not merely close."""
    from _distributed_worker import evaluation_inputs

    from topoclip.run.evaluation.retrieval import evaluate_retrieval
    from topoclip.run.evaluation.zeroshot import evaluate_classification_modes

    *_, results = run
    torch.set_num_threads(1)
    classification, retrieval, model, tokenizer, transform = evaluation_inputs(EVALUATION)
    from topoclip.run.evaluation.zeroshot import embed_images

    expected = {"classification": evaluate_classification_modes(model, tokenizer, classification, transform,
                                                                 ["distance", "embedding"], batch_size=1),
                "retrieval": evaluate_retrieval(model, tokenizer, retrieval, transform, batch_size=1)}
    one_image = embed_images(model, classification.images[:1], transform, batch_size=1)
    for result in results:
        assert {key: value for key, value in result["evaluation"].items() if key != "one_image"} == expected
        assert torch.equal(result["evaluation"]["one_image"], one_image)  # a rank with no image still gathers


# ------------------------------------------------------------------ single process, no launcher


def test_without_a_launcher_everything_is_one_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    info = init_distributed("cpu")
    assert info == DistributedInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    assert not info.distributed and not distributed.is_initialized()
    assert distributed.is_main(info) and distributed.is_main()
    x = torch.randn(3, 4)
    assert gather_features(x) is x
    assert distributed.broadcast_object({"a": 1}) == {"a": 1}
    distributed.barrier()
    distributed.cleanup()


def test_srun_without_torchrun_sets_the_env_that_torch_reads(monkeypatch):
    environ = {"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "1234",
               "SLURM_JOB_NODELIST": "gpu[07-08]"}
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr(distributed.subprocess, "run", _no_scontrol)
    assert distributed._launch_env() == (3, 1, 4)
    assert environ["MASTER_ADDR"] == "gpu07"
    assert environ["MASTER_PORT"] == str(distributed.MASTER_PORT_BASE + 1234)
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["LOCAL_RANK"]) == ("3", "4", "1")


def test_the_launch_rank_is_read_before_any_variable_is_set(monkeypatch):
    monkeypatch.setattr(os, "environ", {"SLURM_NTASKS": "4", "SLURM_PROCID": "3"})
    assert (distributed.launch_rank(), distributed.launch_world_size()) == (3, 4) and "RANK" not in os.environ
    monkeypatch.setattr(os, "environ", {"WORLD_SIZE": "2", "RANK": "1", "SLURM_NTASKS": "4", "SLURM_PROCID": "3"})
    assert (distributed.launch_rank(), distributed.launch_world_size()) == (1, 2)  # torchrun's, inside an srun step
    monkeypatch.setattr(os, "environ", {})
    assert (distributed.launch_rank(), distributed.launch_world_size()) == (0, 1)


def test_one_slurm_task_or_torchrun_env_wins(monkeypatch):
    monkeypatch.setattr(os, "environ", {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"})
    assert distributed._launch_env() == (0, 0, 1)  # python inside sbatch: a single process
    monkeypatch.setattr(os, "environ", {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "WORLD_SIZE": "2",
                                        "RANK": "1", "LOCAL_RANK": "1"})
    assert distributed._launch_env() == (1, 1, 2)


def _no_scontrol(*args, **kwargs):
    raise FileNotFoundError("scontrol")


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch.compile's import
def test_unwrap_sees_through_compile_and_ddp_like_wrappers():
    model = CLIP(load_config("tiny").model)
    assert unwrap(model) is model
    assert unwrap(torch.nn.DataParallel(model)) is model
    compiled = torch.compile(model)  # wrapping only; nothing is compiled until it is called
    assert unwrap(compiled) is model
