"""The ceiling of the built-in retrieval set (issue #44): the generator's probability of each caption for each
scene, checked against the generator itself by sampling, and the Bayes-optimal recall it gives."""
import collections
import math

import numpy as np
import pytest
import torch

from topoclip.config import load_config
from topoclip.data.scenes import SceneDataset
from topoclip.data.scenes.captions import sample_caption
from topoclip.data.scenes.ceiling import ceiling, likelihoods, realized, retrieval_ceiling

DRAWS = 40_000


@pytest.mark.slow
@pytest.mark.parametrize("objects", [1, 3])
def test_the_likelihood_is_the_generator_s_frequency(objects):
    """For scenes of 1 and of 3 objects: every text sample_caption writes has a computed probability > 0; each one
    expected at least 20 times in 40,000 draws has its frequency within 5 binomial standard deviations (the normal
    approximation holds there; about 1e-6 false alarms a text, at a fixed seed); and the computed probabilities of
    the texts seen sum to 1 less the Good–Turing estimate of what was never drawn."""
    config = load_config("tiny", [f"data.scenes.min_objects={objects}", f"data.scenes.max_objects={objects}"]).data.scenes
    dataset = SceneDataset(config, "test")
    rng = np.random.default_rng(0)
    for index in range(3):
        scene = dataset.scene(index)
        drawn = [sample_caption(scene, rng) for _ in range(DRAWS)]
        frequency = collections.Counter(caption.text for caption in drawn)
        captions = list({caption.text: caption for caption in drawn}.values())
        probability = likelihoods([scene], captions)[:, 0]
        assert (probability > 0).all()
        for caption, p in zip(captions, probability.tolist()):
            observed = frequency[caption.text] / DRAWS
            if p * DRAWS >= 20:
                assert abs(observed - p) <= 5 * math.sqrt(p * (1 - p) / DRAWS), (caption.text, observed, p)
        # The mass of the texts never drawn: Good–Turing estimates it as the share of texts drawn once, with a
        # standard error of about √(texts drawn once) / draws; 5 of those bound it here.
        unseen = 1 - probability.sum().item()
        once = sum(1 for count in frequency.values() if count == 1)
        assert abs(unseen - once / DRAWS) <= 5 * math.sqrt(max(once, 1)) / DRAWS, (unseen, once / DRAWS)


def test_a_caption_false_of_a_scene_has_probability_zero_and_true_ones_do_not():
    config = load_config("tiny", ["data.scenes.max_objects=3"]).data.scenes
    dataset = SceneDataset(config, "test")
    scenes = [dataset.scene(i) for i in range(40)]
    captions = [c for i in range(40) for c in dataset.annotated_captions_for(i, 3)]
    table = likelihoods(scenes, captions)
    true = torch.tensor([[caption.describes(scene) for scene in scenes] for caption in captions])
    assert (table[~true] == 0).all() and (table[true] > 0).all()


def test_the_ceiling_is_perfect_when_each_caption_fits_one_image_and_chance_when_it_fits_all():
    owners = torch.arange(4).repeat_interleave(2)
    unique = torch.zeros(8, 4, dtype=torch.float64)
    unique[torch.arange(8), owners] = 0.5
    assert all(value == pytest.approx(100.0) for value in ceiling(unique, owners).values())
    assert all(value == pytest.approx(100.0) for value in realized(unique, owners).values())
    flat = torch.full((8, 4), 0.25, dtype=torch.float64)
    result = ceiling(flat, owners)
    assert result["image_retrieval_recall@1"] == pytest.approx(25.0)  # 1 of 4 images
    assert result["text_retrieval_recall@1"] == pytest.approx(25.0)  # each caption is an image's with 1/4
    on_this_set = realized(flat, owners)  # every tie broken at random
    assert on_this_set["image_retrieval_recall@1"] == pytest.approx(25.0)
    assert on_this_set["text_retrieval_recall@1"] == pytest.approx(2 / 8 * 100)  # 2 own captions of 8, one taken


def test_the_default_task_s_ceiling_is_below_100():
    config = load_config("cpu-multi").data.scenes
    result = retrieval_ceiling(config, "test", size=200, captions_per_image=5)
    for values in result.values():
        assert 0 < values["mean_recall"] < 100 and values["image_retrieval_recall@1"] < values["image_retrieval_recall@10"]
    assert abs(result["expected"]["mean_recall"] - result["this_set"]["mean_recall"]) < 10
