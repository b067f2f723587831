"""Zero-shot classification and retrieval runners, with stand-in models that implement the model interface."""
import zlib
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from topoclip.core import geometry
from topoclip.data.types import ClassificationSet, RetrievalSet
from topoclip.run.evaluation.metrics import retrieval_metrics
from topoclip.run.evaluation.retrieval import evaluate_retrieval
from topoclip.run.evaluation.zeroshot import evaluate_classification, record, zero_shot_classifier

from _tolerance import fp32_pair

TOPOLOGIES = ["sphere", "euclidean", "ps-geodesic", "ps-inner"]
M, N = 4, 3  # embeddings (m, n)
SIZE = 4  # images are (SIZE, SIZE, 3) uint8


# --------------------------------------------------------------------------- stand-ins


@dataclass
class TextBatch:
    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)

    def to(self, device):
        return TextBatch(self.input_ids.to(device), self.attention_mask.to(device))


class WordTokenizer:
    """Whitespace words -> ids by a stable hash; padded to the longest text."""

    def __init__(self, vocab_size=97):
        self.vocab_size = vocab_size

    def __call__(self, texts):
        ids = [[zlib.crc32(w.encode()) % self.vocab_size for w in t.split()] for t in texts]
        length = max(len(i) for i in ids)
        input_ids = torch.zeros(len(ids), length, dtype=torch.int64)
        mask = torch.zeros(len(ids), length, dtype=torch.int64)
        for row, i in enumerate(ids):
            input_ids[row, : len(i)] = torch.tensor(i)
            mask[row, : len(i)] = 1
        return TextBatch(input_ids, mask)


class LookupTokenizer:
    """Each whole text -> one id from a fixed table (for oracle models)."""

    def __init__(self, ids):
        self.ids = ids

    def __call__(self, texts):
        input_ids = torch.tensor([[self.ids[t]] for t in texts])
        return TextBatch(input_ids, torch.ones_like(input_ids))


class RandomLinearModel(torch.nn.Module):
    """Images: a fixed random linear map of the pixels. Texts: mean of fixed random word vectors."""

    def __init__(self, topology, vocab_size=97):
        super().__init__()
        self.config = SimpleNamespace(topology=topology)
        self.register_buffer("image_map", torch.randn(3 * SIZE * SIZE, M * N))
        self.register_buffer("word_vectors", torch.randn(vocab_size, M * N))

    def encode_image(self, images):  # (B, 3, H, W) -> (B, m, n)
        return geometry.to_space(self.config.topology, (images.flatten(1) @ self.image_map).view(-1, M, N))

    def encode_text(self, batch):  # -> (B, m, n)
        mask = batch.attention_mask[..., None].float()  # (B, L, 1)
        mean = (self.word_vectors[batch.input_ids] * mask).sum(1) / mask.sum(1)  # (B, m·n)
        return geometry.to_space(self.config.topology, mean.view(-1, M, N))

    def similarity(self, u, v):
        return geometry.similarity(self.config.topology, u, v)


class OracleModel(torch.nn.Module):
    """Image with pixel value k -> image_table[k]; text with id j -> text_table[j]."""

    def __init__(self, topology, image_table, text_table):
        super().__init__()
        self.config = SimpleNamespace(topology=topology)
        self.image_table, self.text_table = image_table, text_table

    def encode_image(self, images):
        return self.image_table[images[:, 0, 0, 0].long()]

    def encode_text(self, batch):
        return self.text_table[batch.input_ids[:, 0]]

    def similarity(self, u, v):
        return geometry.similarity(self.config.topology, u, v)


def to_tensor(image):
    """uint8 (H, W, 3) -> float (3, H, W), unscaled so an oracle can read its index back."""
    return torch.from_numpy(np.asarray(image)).permute(2, 0, 1).float()


def constant_image(value):
    return np.full((SIZE, SIZE, 3), value, dtype=np.uint8)


def random_images(count):
    return [np.random.default_rng(i).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8) for i in range(count)]


CLASSNAMES = ["cat", "dog", "car", "tree", "boat"]
TEMPLATES = ["a photo of a {}.", "a drawing of the {}", "{} in the wild", "a blurry {} photo"]


def random_classification_set(num_images=13, templates=TEMPLATES):
    labels = torch.randint(0, len(CLASSNAMES), (num_images,))
    return ClassificationSet("random", random_images(num_images), labels, CLASSNAMES, list(templates))


# --------------------------------------------------------------------------- classification


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_one_template_modes_agree(topology):
    model = RandomLinearModel(topology)
    tokenizer = WordTokenizer()
    images = model.encode_image(torch.stack([to_tensor(i) for i in random_images(7)]))
    by_distance = zero_shot_classifier(model, tokenizer, CLASSNAMES, TEMPLATES[:1], "distance")
    by_embedding = zero_shot_classifier(model, tokenizer, CLASSNAMES, TEMPLATES[:1], "embedding")
    # Two fp32 orders of one mean and one product over M·N coordinates, scores ≤ M (ps-inner's range)
    torch.testing.assert_close(by_distance.scores(model, images), by_embedding.scores(model, images),
                               **fp32_pair(2 * M * N + len(TEMPLATES), M))

    dataset = random_classification_set(templates=TEMPLATES[:1])
    distance = evaluate_classification(model, tokenizer, dataset, to_tensor, mode="distance", batch_size=4)
    embedding = evaluate_classification(model, tokenizer, dataset, to_tensor, mode="embedding", batch_size=4)
    assert distance.pop("mode") == "distance" and embedding.pop("mode") == "embedding"
    assert distance == embedding


def test_ps_inner_distance_mode_is_the_inner_product_with_the_mean_embedding():
    model, tokenizer = RandomLinearModel("ps-inner"), WordTokenizer()
    images = model.encode_image(torch.stack([to_tensor(i) for i in random_images(6)]))  # (6, m, n)
    prompts = [t.format(c) for c in CLASSNAMES for t in TEMPLATES]
    texts = model.encode_text(tokenizer(prompts)).view(len(CLASSNAMES), len(TEMPLATES), M, N)
    mean = texts.mean(dim=1)  # (C, m, n), sub-spheres NOT renormalised
    by_distance = zero_shot_classifier(model, tokenizer, CLASSNAMES, TEMPLATES, "distance").scores(model, images)
    # Linearity: (1/T) Σ_t ⟨u, v_t⟩ = ⟨u, (1/T) Σ_t v_t⟩.
    pair = fp32_pair(M * N + len(TEMPLATES), M)  # a mean of T prompts, then M·N products; scores ≤ M
    torch.testing.assert_close(by_distance, images.flatten(1) @ mean.flatten(1).T, **pair)
    # The embedding mode renormalises each sub-sphere of the mean, so its scores differ.
    by_embedding = zero_shot_classifier(model, tokenizer, CLASSNAMES, TEMPLATES, "embedding").scores(model, images)
    renormalised = images.flatten(1) @ geometry.to_space("ps-inner", mean).flatten(1).T
    torch.testing.assert_close(by_embedding, renormalised, **pair)
    assert (by_embedding - by_distance).abs().max() > 1e-2


def test_ps_geodesic_modes_differ_with_several_templates():
    model, tokenizer = RandomLinearModel("ps-geodesic"), WordTokenizer()
    images = model.encode_image(torch.stack([to_tensor(i) for i in random_images(6)]))
    by_distance = zero_shot_classifier(model, tokenizer, CLASSNAMES, TEMPLATES, "distance").scores(model, images)
    by_embedding = zero_shot_classifier(model, tokenizer, CLASSNAMES, TEMPLATES, "embedding").scores(model, images)
    assert by_distance.shape == by_embedding.shape == (6, len(CLASSNAMES))
    assert (by_distance - by_embedding).abs().max() > 1e-2


@pytest.mark.parametrize("mode", ["distance", "embedding"])
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_images_equal_to_their_class_text_score_100(topology, mode):
    table = geometry.to_space(topology, torch.randn(len(CLASSNAMES), M, N))  # one embedding per class
    template = TEMPLATES[0]
    tokenizer = LookupTokenizer({template.format(c): k for k, c in enumerate(CLASSNAMES)})
    labels = torch.tensor([0, 0, 0, 1, 2, 3, 4, 4])
    dataset = ClassificationSet("oracle", [constant_image(int(k)) for k in labels], labels, CLASSNAMES, [template])
    result = evaluate_classification(OracleModel(topology, table, table), tokenizer, dataset, to_tensor, mode=mode, batch_size=3)
    assert result == {"top1": 100.0, "top5": 100.0, "mean_per_class_recall": 100.0, "mode": mode}


def test_classification_restores_training_mode_and_rejects_unknown_mode():
    model, tokenizer = RandomLinearModel("sphere"), WordTokenizer()
    model.train()
    evaluate_classification(model, tokenizer, random_classification_set(), to_tensor)
    assert model.training
    with pytest.raises(ValueError, match="mode"):
        evaluate_classification(model, tokenizer, random_classification_set(), to_tensor, mode="average")


# --------------------------------------------------------------------------- retrieval


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_images_equal_to_their_captions_score_100(topology):
    # 5 images, 2 captions each; both captions of image k embed exactly as image k (they tie).
    table = geometry.to_space(topology, torch.randn(5, M, N))
    caption_image = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    captions = [f"caption {j}" for j in range(10)]
    tokenizer = LookupTokenizer({c: int(caption_image[j]) for j, c in enumerate(captions)})
    dataset = RetrievalSet("oracle", [constant_image(k) for k in range(5)], captions, caption_image)
    result = evaluate_retrieval(OracleModel(topology, table, table), tokenizer, dataset, to_tensor, batch_size=2, chunk_size=3)
    assert set(result.values()) == {100.0}
    assert len(result) == 11


def test_retrieval_hand_computed_both_directions():
    # m = 1, n = 3 (ps-inner = cosine). Images: i0 = e0, i1 = e1, i2 = e1 (a look-alike of i1).
    # Captions: c0 -> i0 = e0, c1 -> i1 = e1, c2 -> i2 = (0, .6, .8), c3 -> i2 = e2.
    e = torch.eye(3)
    images = torch.stack([e[0], e[1], e[1]])[:, None, :]
    texts = torch.stack([e[0], e[1], torch.tensor([0.0, 0.6, 0.8]), e[2]])[:, None, :]
    captions = ["c0", "c1", "c2", "c3"]
    tokenizer = LookupTokenizer({c: j for j, c in enumerate(captions)})
    dataset = RetrievalSet("hand", [constant_image(k) for k in range(3)], captions, torch.tensor([0, 1, 2, 2]))
    result = evaluate_retrieval(OracleModel("ps-inner", images, texts), tokenizer, dataset, to_tensor)
    # Text -> image ("image_retrieval"): c0: i0 first. c1: i1, i2 tie at 1, i1 first by index.
    # c2: scores (0, .6, .6), i1 before i2 -> rank 2. c3: (0, 0, 0), index order -> i2 rank 3.
    # R@1 = 2/4, R@5 = R@10 = 1 (3 images); mAP@R = R-P = (1 + 1 + 0 + 0)/4.
    # Image -> text ("text_retrieval"): i0: c0 first. i1: c1 (1) > c2 (.6) -> first.
    # i2 = e1: c1 (1), c2 (.6), c0 (0), c3 (0): positives c2, c3 at ranks 2, 4 -> R@1 0, R@5 1.
    # R@1 = 2/3; i2 has R = 2, top-2 holds 1 hit: R-P = 1/2, mAP@R = (1/2)(0 + 1/2) = 1/4.
    expected = {
        "image_retrieval_recall@1": 50.0,
        "image_retrieval_recall@5": 100.0,
        "image_retrieval_recall@10": 100.0,
        "text_retrieval_recall@1": 200 / 3,
        "text_retrieval_recall@5": 100.0,
        "text_retrieval_recall@10": 100.0,
        "mean_recall": (50 + 100 + 100 + 200 / 3 + 100 + 100) / 6,
        "image_to_text_mAP@R": 100 * (1 + 1 + 1 / 4) / 3,
        "image_to_text_R-Precision": 100 * (1 + 1 + 1 / 2) / 3,
        "text_to_image_mAP@R": 50.0,
        "text_to_image_R-Precision": 50.0,
    }
    assert list(result) == list(expected)
    for name, value in expected.items():
        assert result[name] == pytest.approx(value, abs=1e-12), name  # ranks of a few items: float64 arithmetic


def random_retrieval_set():
    # 9 images (image 8 has no caption: a distractor), 20 captions; semantic relevance: same group
    # (image index mod 3), which includes the pairing.
    caption_image = torch.randint(0, 8, (20,))
    caption_image[:8] = torch.arange(8)
    captions = [f"word{int(k)} and w{j % 4} w{j % 7}" for j, k in enumerate(caption_image)]

    def same_group(image_index, caption_index):
        return (image_index[:, None] % 3) == (caption_image[caption_index][None, :] % 3)

    return RetrievalSet("random", random_images(9), captions, caption_image, relevance=same_group)


@pytest.mark.parametrize("topology", ["ps-geodesic", "euclidean"])
def test_retrieval_chunk_size_does_not_change_results(topology):
    model, tokenizer, dataset = RandomLinearModel(topology), WordTokenizer(), random_retrieval_set()
    one_chunk = evaluate_retrieval(model, tokenizer, dataset, to_tensor, batch_size=4, chunk_size=1024)
    for chunk_size in (1, 3, 7):
        assert evaluate_retrieval(model, tokenizer, dataset, to_tensor, batch_size=5, chunk_size=chunk_size) == pytest.approx(one_chunk, abs=1e-9)


def test_retrieval_matches_metrics_on_the_full_matrix():
    model, tokenizer, dataset = RandomLinearModel("ps-inner"), WordTokenizer(), random_retrieval_set()
    result = evaluate_retrieval(model, tokenizer, dataset, to_tensor, chunk_size=4)
    with torch.no_grad():
        images = model.encode_image(torch.stack([to_tensor(i) for i in dataset.images]))
        texts = model.encode_text(tokenizer(dataset.captions))
    scores = model.similarity(images, texts)  # (9, 20)
    all_images, all_captions, queries = torch.arange(9), torch.arange(20), torch.arange(8)  # image 8: no caption
    to_text = retrieval_metrics(
        scores[queries], dataset.relevant(queries, all_captions), dataset.paired(queries, all_captions)
    )
    to_image = retrieval_metrics(
        scores.T, dataset.relevant(all_images, all_captions).T, dataset.paired(all_images, all_captions).T
    )
    assert result["text_retrieval_recall@5"] == pytest.approx(to_text["R@5"])
    assert result["image_retrieval_recall@1"] == pytest.approx(to_image["R@1"])
    assert result["image_to_text_mAP@R"] == pytest.approx(to_text["mAP@R"])
    assert result["text_to_image_R-Precision"] == pytest.approx(to_image["R-Precision"])
    assert result["mean_recall"] == pytest.approx((to_text["mean_recall"] + to_image["mean_recall"]) / 2)
    # Semantic relevance (3 groups) is not the pairing: mAP@R differs from R@1-based numbers.
    assert result["image_to_text_mAP@R"] != result["text_retrieval_recall@1"]


# --------------------------------------------------------------------------- records


def test_record_shape_and_task_names():
    metrics = {"top1": 50.0}
    assert record("cifar10", "ps-inner-tiny", "zeroshot_classification", metrics) == {
        "dataset": "cifar10",
        "model": "ps-inner-tiny",
        "task": "zeroshot_classification",
        "metrics": {"top1": 50.0},
    }
    with pytest.raises(ValueError, match="task"):
        record("cifar10", "m", "linear_probe", metrics)
