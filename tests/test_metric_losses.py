"""The metric-learning losses (contrastive, triplet, max-hinge / VSE++, n-pair): float64 references written from
each formula, VSE++'s published loss, and training with them (τ unused and frozen)."""
import math

import pytest
import torch

from topoclip.config import ConfigError, load_config
from topoclip.core.losses import LOSSES, max_hinge_loss, n_pair_loss, pairwise_contrastive_loss, triplet_loss
from topoclip.core.losses import loss_keywords
from topoclip.run.training.step import loss_at
from topoclip.run.training.trainer import train


def reference(name: str, s_it: torch.Tensor, s_ti: torch.Tensor, local: int, margin: float, best: float) -> float:
    """Each loss by its formula, one query at a time, in float64 (rows: local queries, columns: the global batch)."""
    rows, columns = s_it.shape
    total = 0.0
    for i in range(rows):
        p = local * rows + i  # the positive column
        negatives = [j for j in range(columns) if j != p]
        if name == "contrastive":
            d = lambda j: best - s_it[i, j].item()  # noqa: E731
            total += d(p) ** 2 + sum(max(0.0, margin - d(j)) ** 2 for j in negatives) / len(negatives)
            continue
        for s in (s_it, s_ti):
            hinges = [max(0.0, margin - s[i, p].item() + s[i, j].item()) for j in negatives]
            if name == "triplet":
                total += sum(hinges)
            elif name == "max-hinge":
                total += max(hinges)
            else:  # n-pair: log(1 + Σ exp(s_ij − s_ii)), the two directions halved
                total += math.log(1 + sum(math.exp(s[i, j].item() - s[i, p].item()) for j in negatives)) / 2
    return total / rows


HAND_MADE = torch.tensor([[0.9, 0.1, 0.8], [0.0, 0.5, 0.7], [-0.2, 0.3, 0.6]], dtype=torch.float64)


def test_hand_made_values():
    # triplet, margin 0.2, image rows: row 0: [0.2-0.9+0.1]₊ + [0.2-0.9+0.8]₊ = 0 + 0.1; row 1: 0 + 0.4; row 2: 0 + 0;
    # text rows (Sᵀ): row 0: 0.2-0.9+0.0, -0.2 -> 0 + 0; row 1: 0.2-0.5+0.1 = -0.2 -> 0, 0.2-0.5+0.3 = 0 -> 0;
    # row 2: 0.2-0.6+0.8 = 0.4, 0.2-0.6+0.7 = 0.3 -> 0.7. Sum 1.2 over 3 rows.
    got = triplet_loss(HAND_MADE, HAND_MADE.T, margin=0.2)
    assert got.item() == pytest.approx(1.2 / 3, abs=1e-15)
    # max-hinge: image rows 0.1, 0.4, 0; text rows 0, 0, 0.4 -> 0.9 / 3
    assert max_hinge_loss(HAND_MADE, HAND_MADE.T, margin=0.2).item() == pytest.approx(0.9 / 3, abs=1e-15)


@pytest.mark.parametrize("name", ["contrastive", "triplet", "max-hinge", "n-pair"])
@pytest.mark.parametrize("local, rows, columns", [(0, 6, 6), (1, 3, 6), (2, 2, 6)])
def test_each_loss_equals_its_formula_in_float64(name, local, rows, columns):
    generator = torch.Generator().manual_seed(local * 10 + rows)
    s_it = torch.rand(rows, columns, generator=generator, dtype=torch.float64) * 2 - 1
    s_ti = torch.rand(rows, columns, generator=generator, dtype=torch.float64) * 2 - 1
    got = LOSSES[name](s_it, s_ti, torch.tensor(1.0, dtype=torch.float64), None, local_index=local, margin=0.3,
                       best=1.0)
    # float64 throughout, at most a few dozen terms: the two sums differ by ulps of the float64 result.
    assert got.item() == pytest.approx(reference(name, s_it, s_ti, local, 0.3, 1.0), rel=1e-12, abs=1e-12)


def vsepp_contrastive_loss(scores: torch.Tensor, margin: float) -> torch.Tensor:
    """VSE++'s ContrastiveLoss(max_violation=True) (fartashf/vsepp, model.py), as its paper and code define it: with
    scores = im·sᵀ, compare each diagonal score with the scores of its row (caption retrieval) and of its column
    (image retrieval), clear the diagonal, keep each query's largest violation, and sum over the batch."""
    n = scores.shape[0]
    diagonal = scores.diagonal()
    caption_costs = (margin + scores - diagonal[:, None]).clamp(min=0)  # row i against its positive s_ii
    image_costs = (margin + scores - diagonal[None, :]).clamp(min=0)  # column j against its positive s_jj
    eye = torch.eye(n, dtype=torch.bool)
    caption_costs, image_costs = caption_costs.masked_fill(eye, 0), image_costs.masked_fill(eye, 0)
    return caption_costs.max(dim=1).values.sum() + image_costs.max(dim=0).values.sum()


@pytest.mark.parametrize("seed", range(5))
def test_max_hinge_is_vsepp_s_loss_divided_by_the_batch(seed):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(9, 9, generator=generator, dtype=torch.float64)
    ours = max_hinge_loss(scores, scores.T, margin=0.2)
    # VSE++ sums over the batch; ours is a mean over queries (exact over ranks): ours · B is theirs.
    assert (ours * 9).item() == pytest.approx(vsepp_contrastive_loss(scores, 0.2).item(), rel=1e-12)


def test_the_losses_without_a_temperature_ignore_it():
    s = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    scale = torch.tensor(7.0, dtype=torch.float64, requires_grad=True)
    for loss in (pairwise_contrastive_loss, triplet_loss, max_hinge_loss, n_pair_loss):
        (grad,) = torch.autograd.grad(loss(s, s.T, scale, None), [scale], allow_unused=True)
        assert grad is None


def test_the_margin_can_follow_the_similarity_range():
    sphere = load_config("tiny", ["model.topology=sphere", "model.class_tokens=1", "train.margin_relative=true"])
    product = load_config("tiny", ["train.margin_relative=true", "train.margin=0.25"])  # ps-inner, m = 4: [−4, 4]
    assert loss_keywords(sphere) == {"margin": 0.2, "best": 1.0}
    assert loss_keywords(product) == {"margin": 1.0, "best": 4.0}
    assert loss_keywords(load_config("tiny", ["model.topology=ps-geodesic"]))["best"] == 0.0
    with pytest.raises(ConfigError, match="unbounded"):
        load_config("tiny", ["model.topology=euclidean", "train.margin_relative=true"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["contrastive", "triplet", "max-hinge", "n-pair"])
def test_training_with_a_loss_without_temperature_keeps_tau_at_its_start(name, tmp_path):
    from topoclip.io.checkpoint import load_checkpoint

    config = load_config("tiny", [f"train.loss={name}", "train.steps=3", "evaluate.size=16"])
    run = train(config, out_dir=tmp_path / name, progress=False)
    model, _, _ = load_checkpoint(run)
    assert model.temperature.t.item() == pytest.approx(config.model.temperature.init)


def test_max_hinge_warmup_uses_the_triplet_loss_for_its_first_steps():
    config = load_config("tiny", ["train.loss=max-hinge", "train.max_hinge_warmup_steps=2"])
    assert [loss_at(config.train, step) for step in range(4)] == ["triplet", "triplet", "max-hinge", "max-hinge"]
    triplet = load_config("tiny", ["train.loss=triplet"])
    assert [loss_at(triplet.train, step) for step in range(2)] == ["triplet", "triplet"]
    with pytest.raises(ConfigError, match="max-hinge loss's warm-up"):
        load_config("tiny", ["train.loss=triplet", "train.max_hinge_warmup_steps=2"])


@pytest.mark.slow
def test_a_run_all_warmup_trains_exactly_as_the_triplet_loss(tmp_path):
    # Same seed, data and operations in the same order on one machine: the weights are bit-identical, and a warm-up
    # one step shorter is not (its last step takes the hardest negative).
    from topoclip.io.checkpoint import load_checkpoint

    def weights(name, overrides):
        config = load_config("tiny", ["train.steps=3", "evaluate.size=16", *overrides])
        model, _, _ = load_checkpoint(train(config, out_dir=tmp_path / name, progress=False))
        return model.state_dict()

    triplet = weights("triplet", ["train.loss=triplet"])
    warm = weights("warm", ["train.loss=max-hinge", "train.max_hinge_warmup_steps=3"])
    shorter = weights("shorter", ["train.loss=max-hinge", "train.max_hinge_warmup_steps=2"])
    assert all(torch.equal(triplet[key], warm[key]) for key in triplet)
    assert not all(torch.equal(triplet[key], shorter[key]) for key in triplet)
