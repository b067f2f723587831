"""The analyses: each runs on one short tiny-preset training (made once for the module) and writes
its PNG + JSON; values are checked where they can be (hand computations, identities with the
model's own loss and accuracy, a separable probe)."""
import json
import math

import pytest
import torch

from topoclip.analysis import cost, equilibrium, experts, gradcam, landscape, probe, similarities, temperature
from topoclip.analysis.inputs import encode_pairs, load_model, scene_pairs
from topoclip.cli import main
from topoclip.config import load_config
from topoclip.data.scenes import classification_sets
from topoclip.run.evaluation.zeroshot import evaluate_classification
from topoclip.core.geometry import to_space
from topoclip.core.losses import infonce_loss

from _tolerance import TINY, fp32_pair, gamma, model_roundings

# Small and fast: 32 px scenes, tiny towers, a few steps, small evaluation sets.
SMALL = ["train.num_workers=0", "train.log_every=1", "train.steps=8", "train.batch_size=16", "evaluate.size=16",
         "evaluate.template_modes=[\"distance\"]", "data.scenes.train_size=512", "data.scenes.val_size=64",
         "data.scenes.test_size=64"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from topoclip.run.training.trainer import train

    return train(load_config("tiny", SMALL), out_dir=tmp_path_factory.mktemp("analysis") / "run", progress=False)


@pytest.fixture(scope="module")
def loaded(run):
    return load_model(run, device="cpu")


def written(out, name):
    assert (out / f"{name}.png").is_file()
    return json.loads((out / f"{name}.json").read_text())


# --------------------------------------------------------------------------- inputs


@pytest.mark.slow
def test_load_model_from_run_or_checkpoint(run, loaded):
    assert loaded.run_dir == run and loaded.checkpoint.parent.name == "checkpoints"
    again = load_model(loaded.checkpoint, device="cpu")
    assert again.run_dir == run and not again.model.training
    with pytest.raises(FileNotFoundError):
        load_model(run / "nothing-here")


def test_encode_pairs_one_caption_per_image(loaded):
    encoded = encode_pairs(loaded, 12, "out-of-domain")
    m, n = loaded.model.embedding_shape
    assert encoded.images.shape == encoded.texts.shape == (12, m, n)
    assert len(encoded.pairs.captions) == 12 and encoded.pairs.name.endswith("-ood")


# --------------------------------------------------------------------------- temperature


def test_convergence_step_definition():
    steps = list(range(0, 100, 10))
    rising_then_flat = [1.0, 2.0, 4.0, 8.0, 10.0, 10.1, 10.05, 10.1, 10.0, 10.1]
    assert temperature.convergence_step(steps, rising_then_flat, window=30) == 40
    # A 3 % step inside the window is not convergence; a window that would end after the run never counts.
    step_up = [1.0] * 3 + [1.03] * 7
    assert temperature.convergence_step(steps, step_up, window=30) == 30
    assert temperature.convergence_step(steps, step_up, window=80) is None
    assert temperature.convergence_step(steps, [float(s + 1) for s in steps], window=10) is None


def test_temperature_overlays_runs(run, tmp_path):
    result = temperature.analyze_temperature([run, run], tmp_path, window=2)
    written(tmp_path, "temperature")
    first = result["runs"][0]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scales = [r["scale"] for r in logged if "scale" in r]
    assert len(result["runs"]) == 2 and first["scale"] == scales and first["window"] == 2
    # t and τ = exp(t) are fp32: one rounding of τ moves log τ by at most u = 2⁻²⁴ (+ one of t's)
    assert first["final_t"] == pytest.approx(math.log(scales[-1]), abs=2 * 2.0**-24 * max(1.0, abs(first["final_t"])))
    assert first["convergence_step"] == temperature.convergence_step(first["steps"], scales, 2)


# --------------------------------------------------------------------------- similarities


def test_similarity_distributions(loaded, tmp_path):
    result = similarities.analyze_similarities(loaded, tmp_path, size=20)
    assert written(tmp_path, "similarities")["size"] == 20
    assert (tmp_path / "similarities_per_sphere.png").is_file()
    m = loaded.model.embedding_shape[0]
    for domain in ("in-domain", "out-of-domain"):
        summed = result["domains"][domain]["summed"]
        assert summed["positive image-text"]["count"] == 20
        assert summed["negative image-text"]["count"] == summed["negative text-text"]["count"] == 20 * 19
        per_sphere = result["domains"][domain]["per_sphere"]
        assert len(per_sphere) == m
        # ps-inner: the summed similarity is the sum of the sub-sphere cosines, so the means add up.
        for kind in similarities.KINDS:
            total = sum(sphere[kind]["mean"] for sphere in per_sphere)
            # fp32 sums of ≤ 20·19 values of magnitude ≤ m, in two orders (per sphere, then summed): 2·γ·m
            assert total == pytest.approx(summed[kind]["mean"], abs=fp32_pair(20 * 19 + 64, m)["atol"])
            # a cosine of unit rows of ≤ 64 coordinates: |s| ≤ 1 + γ_64
            assert all(-1.0 - gamma(64) <= sphere[kind]["min"] <= sphere[kind]["max"] <= 1.0 + gamma(64)
                       for sphere in per_sphere)


# --------------------------------------------------------------------------- equilibrium


def test_equilibrium_terms_match_hand_computation():
    s = [[0.9, 0.1, -0.2], [0.3, 0.8, 0.0], [-0.5, 0.2, 0.7]]
    tau = 2.0
    alignment = -tau * (0.9 + 0.8 + 0.7) / 3
    rows = [math.log(sum(math.exp(tau * x) for x in row)) for row in s]
    columns = [math.log(sum(math.exp(tau * s[i][j]) for i in range(3))) for j in range(3)]
    uniformity = (sum(rows) / 3 + sum(columns) / 3) / 2
    terms = equilibrium.equilibrium_terms(torch.tensor(s), tau)
    assert terms["alignment"].item() == pytest.approx(alignment, rel=1e-6)
    assert terms["uniformity"].item() == pytest.approx(uniformity, rel=1e-6)
    assert terms["ratio"].item() == pytest.approx(alignment / uniformity, rel=1e-6)
    # the same 3×3 InfoNCE by two routes in fp32: logits ≤ τ = 2, a dozen roundings
    torch.testing.assert_close(terms["loss"], infonce_loss(torch.tensor(s), torch.tensor(s).T, torch.tensor(tau)),
                               **fp32_pair(12, 2 * 3))
    several = equilibrium.equilibrium_terms(torch.tensor(s), [1.0, tau])
    assert several["ratio"].shape == (2,) and several["ratio"][1].item() == pytest.approx(alignment / uniformity, rel=1e-6)


def test_shuffled_pairing_moves_exactly_the_fraction():
    generator = torch.Generator().manual_seed(0)
    for batch, fraction, moved in [(8, 0.5, 4), (10, 0.0, 0), (10, 0.1, 2), (4, 1.0, 4)]:
        pairing = equilibrium.shuffled_pairing(batch, fraction, generator)
        assert sorted(pairing.tolist()) == list(range(batch))
        assert int((pairing != torch.arange(batch)).sum()) == moved


def test_equilibrium_analysis(loaded, tmp_path):
    result = equilibrium.analyze_equilibrium(loaded, tmp_path, size=24, fractions=(0.0, 0.5), batch_sizes=(8, 24),
                                             scales=(0.5, 1.0, 10.0), draws=2)
    assert len(written(tmp_path, "equilibrium")["curves"]) == 4
    for curve in result["curves"]:
        assert len(curve["ratio"]) == 3 and curve["best_scale"] in (0.5, 1.0, 10.0)
        assert all(math.isfinite(r) for r in curve["ratio"])


# --------------------------------------------------------------------------- landscape


def test_filter_normalized_direction_matches_filter_norms(loaded):
    weights = landscape.trainable_weights(loaded.model)
    assert not any(name.startswith("temperature.") for name in weights)
    direction = landscape.filter_normalized_direction(weights, torch.Generator().manual_seed(0))
    for name, weight in weights.items():
        if weight.dim() <= 1:
            assert not direction[name].any()
        else:
            norms = weight.detach().flatten(1).norm(dim=1)  # two fp32 norms of one filter length
            torch.testing.assert_close(direction[name].flatten(1).norm(dim=1), norms,
                                       **fp32_pair(2 * weight[0].numel(), float(norms.max())))


@pytest.mark.slow
def test_landscape_origin_equals_model_loss(loaded, tmp_path):
    result = landscape.analyze_landscape(loaded, tmp_path, batch_size=12, resolution=3, plane_scales=(1.0, 100.0),
                                         gradient_scales=(1.0, 100.0), gradient_points=3)
    written(tmp_path, "landscape")
    assert (result["loss"], result["entailment_weight"]) == ("infonce", 0.0)  # the loss drawn, whole
    pairs = scene_pairs(loaded.config, 12)
    model = loaded.model
    with torch.no_grad():
        output = model(loaded.pixels(pairs.images), loaded.tokenizer(pairs.captions))
        similarity = model.similarity(output.image_embeds, output.text_embeds)
    for plane in result["planes"]:
        expected = infonce_loss(similarity, similarity.T, torch.tensor(plane["scale"])).item()
        # the same forward pass batched differently (12 pairs vs the analysis' batches): the loss of
        # 12×12 logits (≤ τ·m) in two fp32 orders, within 2·γ of the roundings of the tiny towers
        assert plane["loss_at_origin"] == pytest.approx(
            expected, abs=fp32_pair(model_roundings(TINY, 12), plane["scale"] * loaded.model.embedding_shape[0])["atol"])
        assert plane["loss"][1][1] == plane["loss_at_origin"]
    norms = torch.tensor(result["gradient"]["norms"])
    assert norms.shape == (2, 3) and torch.isfinite(norms).all() and (norms > 0).all()


# --------------------------------------------------------------------------- Grad-CAM


def test_gradcam_maps_are_finite_and_shaped(loaded, tmp_path):
    result = gradcam.analyze_gradcam(loaded, tmp_path, examples=2, pairs_shown=2)
    assert len(written(tmp_path, "gradcam")["examples"]) == 2
    model = loaded.model
    grid = model.config.vision.image_size // model.config.vision.patch_size
    m = model.embedding_shape[0]
    pair = scene_pairs(loaded.config, 1)
    maps = gradcam.grad_cam(model, loaded.tokenizer, loaded.pixels(pair.images), pair.captions[0])
    length = int(loaded.tokenizer(pair.captions).attention_mask.sum())  # [CLS] w₁ … [SEP]: the caption's own tokens
    assert maps.image_maps.shape == (1 + m, grid, grid) and maps.text_maps.shape == (1 + m, length)
    assert len(maps.tokens) == length and maps.tokens[0] == "[CLS]" and maps.tokens[-1] == "[SEP]"
    assert maps.score_names[0] == "total"
    for tensor in (maps.image_maps, maps.text_maps, maps.scores):
        assert torch.isfinite(tensor).all()
    assert (maps.image_maps >= 0).all() and (maps.text_maps >= 0).all()
    # ps-inner: the total score is the sum of the class-token pairs' scores.
    # a sum of m fp32 scores ≤ 1 each, in two orders
    assert maps.scores[0].item() == pytest.approx(maps.scores[1:].sum().item(), abs=fp32_pair(2 * 64, len(maps.scores))["atol"])
    assert result["examples"][0]["score_names"] == maps.score_names


# --------------------------------------------------------------------------- mixture of experts


def test_subsets():
    assert experts.subset_sizes(8) == [1, 2, 4, 8] and experts.subset_sizes(6) == [1, 2, 4, 6]
    assert experts.subset_sizes(1) == [1]
    generator = torch.Generator().manual_seed(0)
    assert experts.draw_subsets(4, 2, 10, generator) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    drawn = experts.draw_subsets(16, 4, 5, generator)
    assert len(set(drawn)) == 5 and all(len(s) == 4 and len(set(s)) == 4 for s in drawn)


def test_all_subspheres_equal_the_full_model(loaded, tmp_path):
    result = experts.analyze_experts(loaded, tmp_path, size=24, draws=3, sets=["shape"])
    written(tmp_path, "experts")
    shape = [s for s in classification_sets(loaded.config.data.scenes, "test", 24) if s.name == "shape"][0]
    full = evaluate_classification(loaded.model, loaded.tokenizer, shape, loaded.transform, "distance")
    curve = result["sets"]["shape"]["subsets"]
    m = loaded.model.embedding_shape[0]
    assert [row["k"] for row in curve] == experts.subset_sizes(m)
    assert [tuple(subset) for subset in curve[-1]["subsets"]] == [tuple(range(m))]
    assert curve[-1]["mean"] == full["top1"] == result["sets"]["shape"]["full_model_top1"]


# --------------------------------------------------------------------------- linear probe


def test_probe_on_separable_features_is_perfect():
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(5, 32, generator=generator) * 4

    def sample(count):
        labels = torch.arange(count) % 5
        return centres[labels] + 0.3 * torch.randn(count, 32, generator=generator), labels

    fitted = probe.train_linear_probe(*sample(200), *sample(50), num_classes=5)
    assert fitted.accuracy(*sample(500)) >= 99.0
    assert set(fitted.sweep) == set(probe.WEIGHT_DECAYS) and fitted.weight_decay in fitted.sweep


def test_probe_features_are_class_tokens_before_projection(loaded, tmp_path):
    model = loaded.model
    pixels = loaded.pixels(scene_pairs(loaded.config, 3).images)
    with torch.no_grad():
        features = probe.class_token_features(model, pixels)
        width = model.config.vision.width
        assert features.shape == (3, model.config.class_tokens * width)
        # Projected and mapped to the space, they are the model's image embeddings.
        projected = features.view(3, model.config.class_tokens, width) @ model.visual.proj
        torch.testing.assert_close(to_space(model.config.topology, projected), model.encode_image(pixels),
                                   **fp32_pair(model_roundings(TINY, 3)))
    result = probe.analyze_probe(loaded, tmp_path, tasks=["colour"], train_size=32, validation_size=16, test_size=16)
    colour = written(tmp_path, "probe")["tasks"]["colour"]
    assert colour["classes"] == 8 and 0 <= colour["test_top1"] <= 100 and "test_ood_top1" in colour
    assert result["tasks"]["colour"]["weight_decay"] in probe.WEIGHT_DECAYS


# --------------------------------------------------------------------------- cost


def test_cost_counts():
    config = load_config("tiny")
    result = cost.preset_cost(config, batch_sizes=(4, 1024))
    from topoclip.model.clip import CLIP

    model = CLIP(config.model)
    assert result["parameters"]["total"] == sum(p.numel() for p in model.parameters())
    vision, m = config.model.vision, config.model.class_tokens
    tokens = (vision.image_size // vision.patch_size) ** 2 + m
    assert result["flops_formula"]["image"] == 2 * tokens * vision.layers * (12 * vision.width**2 + 2 * tokens * vision.width)
    # Counted: every block's matmuls (the last only for the class tokens) plus the patch convolution.
    assert 0.5 < result["flops_counted"]["image"] / result["flops_formula"]["image"] < 1.2
    assert [r["logit_bytes"] for r in result["logit_memory"]] == [4 * 4 * 4, 4 * 1024 * 1024]
    geodesic = cost.logit_memory(load_config("tiny", ["model.topology=ps-geodesic"]).model, [16384])[0]
    assert geodesic["naive_intermediate_bytes"] == 4 * 16384 * 16384 * m
    assert geodesic["intermediate_bytes"] <= 4 * 2**25


# --------------------------------------------------------------------------- the command line


@pytest.mark.slow
def test_cli_analyze(run, tmp_path, capsys):
    assert main(["analyze", "similarities", str(run), "--size", "8", "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "similarities.json").is_file()
    assert main(["analyze", "temperature", str(run), "--out", str(tmp_path)]) == 0
    assert main(["analyze", "cost", "--preset", "tiny", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "cost.json").read_text())["configs"][0]["name"] == "tiny"
    equilibrium_args = ["analyze", "equilibrium", str(run), "--size", "16", "--batch-sizes", "8", "--fractions", "0",
                        "--draws", "1", "--device", "cpu", "--out", str(tmp_path)]
    assert main(equilibrium_args) == 0 and main(equilibrium_args + ["--split", "train"]) == 0
    test, train = written(tmp_path, "equilibrium"), written(tmp_path, "equilibrium-train")  # the train one replaced nothing
    assert (test["split"], train["split"]) == ("test", "train") and test["curves"] != train["curves"]  # other scenes
    capsys.readouterr()
    assert main(["analyze", "probe", str(tmp_path / "no-run")]) == 2
    assert main(["analyze", "landscape", str(run), "--resolution", "4", "--out", str(tmp_path)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(line.startswith("topoclip: error:") for line in errors)
