"""Retrieval and classification metrics against values computed by hand in the comments."""
import pytest
import torch

from topoclip.run.evaluation.metrics import (
    ClassificationAccumulator,
    RetrievalAccumulator,
    classification_metrics,
    rank_order,
    retrieval_metrics,
    retrieval_per_query,
)

# --------------------------------------------------------------------------- retrieval fixture
# 4 image queries × 6 captions. Relevant captions: image 0 -> {0}, image 1 -> {1, 2},
# image 2 -> {3, 4, 5}, image 3 -> {0}  (1, 2, 3 and 1 positives).
SCORES = torch.tensor(
    [
        [0.9, 0.1, 0.8, 0.3, 0.2, 0.0],
        [0.7, 0.6, 0.2, 0.5, 0.4, 0.1],
        [0.5, 0.4, 0.6, 0.8, 0.1, 0.7],
        [0.1, 0.9, 0.3, 0.4, 0.5, 0.6],
    ]
)
RELEVANT = torch.tensor(
    [
        [1, 0, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 1],
        [1, 0, 0, 0, 0, 0],
    ],
    dtype=torch.bool,
)

# Image -> text, ranking each row (best first), relevant marked *:
#   image 0: c0* c2 c3 c4 c1 c5       rel ranks {1}     R@1 1, R@5 1, R@10 1; R=1: P@1 = 1
#            R-P = 1,   mAP@R = 1
#   image 1: c0 c1* c3 c4 c2* c5      rel ranks {2, 5}  R@1 0, R@5 1, R@10 1; R=2: top-2 has 1 hit
#            R-P = 1/2, mAP@R = (1/2)(P@1·0 + P@2·1) = (1/2)(1/2) = 1/4
#   image 2: c3* c5* c2 c0 c1 c4*     rel ranks {1,2,6} R@1 1, R@5 1, R@10 1; R=3: top-3 has 2 hits
#            R-P = 2/3, mAP@R = (1/3)(1·1 + 1·1 + (2/3)·0) = 2/3
#   image 3: c1 c5 c4 c3 c2 c0*       rel ranks {6}     R@1 0, R@5 0, R@10 1 (N = 6 < 10)
#            R-P = 0,   mAP@R = 0
# Means: R@1 = 2/4 = 50, R@5 = 3/4 = 75, R@10 = 100, mean_recall = (50+75+100)/3 = 75,
#        mAP@R = (1 + 1/4 + 2/3 + 0)/4 = (23/12)/4 = 23/48, R-P = (1 + 1/2 + 2/3 + 0)/4 = 13/24.
IMAGE_TO_TEXT = {
    "R@1": 50.0,
    "R@5": 75.0,
    "R@10": 100.0,
    "mean_recall": 75.0,
    "mAP@R": 100 * 23 / 48,
    "R-Precision": 100 * 13 / 24,
}

# Text -> image on the transpose (6 caption queries × 4 images):
#   c0: scores [.9 .7 .5 .1] rel {i0, i3}: i0* i1 i2 i3*  ranks {1,4}  R@1 1; R=2: top-2 has 1 hit
#       R-P = 1/2, mAP@R = (1/2)(1·1 + (1/2)·0) = 1/2
#   c1: [.1 .6 .4 .9] rel {i1}: i3 i1* i2 i0      rank 2   R@1 0, R-P 0, mAP 0
#   c2: [.8 .2 .6 .3] rel {i1}: i0 i2 i3 i1*      rank 4   R@1 0, R-P 0, mAP 0
#   c3: [.3 .5 .8 .4] rel {i2}: i2* i1 i3 i0      rank 1   R@1 1, R-P 1, mAP 1
#   c4: [.2 .4 .1 .5] rel {i2}: i3 i1 i0 i2*      rank 4   R@1 0, R-P 0, mAP 0
#   c5: [.0 .1 .7 .6] rel {i2}: i2* i3 i1 i0      rank 1   R@1 1, R-P 1, mAP 1
#   R@5 = R@10 = 1 everywhere (only 4 images).
# Means: R@1 = 3/6 = 50, R@5 = R@10 = 100, mean_recall = 250/3,
#        mAP@R = R-P = (1/2 + 0 + 0 + 1 + 0 + 1)/6 = 5/12.
TEXT_TO_IMAGE = {
    "R@1": 50.0,
    "R@5": 100.0,
    "R@10": 100.0,
    "mean_recall": 250 / 3,
    "mAP@R": 100 * 5 / 12,
    "R-Precision": 100 * 5 / 12,
}


def assert_metrics(actual, expected):
    assert list(actual) == list(expected)
    for name, value in expected.items():
        # percentages of ranks of a few items in float64 (|error| ≲ 100·10·2⁻⁵³ ≈ 1e-13)
        assert actual[name] == pytest.approx(value, abs=1e-9), name


def test_image_to_text_hand_computed():
    assert_metrics(retrieval_metrics(SCORES, RELEVANT), IMAGE_TO_TEXT)


def test_text_to_image_on_the_transpose_hand_computed():
    assert_metrics(retrieval_metrics(SCORES.T, RELEVANT.T), TEXT_TO_IMAGE)


def test_per_query_values_hand_computed():
    values = retrieval_per_query(SCORES, RELEVANT)
    assert values["R@1"].tolist() == [1, 0, 1, 0]
    assert values["R@5"].tolist() == [1, 1, 1, 0]
    assert values["R@10"].tolist() == [1, 1, 1, 1]
    assert values["mAP@R"].tolist() == pytest.approx([1, 1 / 4, 2 / 3, 0])
    assert values["R-Precision"].tolist() == pytest.approx([1, 1 / 2, 2 / 3, 0])


@pytest.mark.parametrize("bounds", [(0, 2, 4), (0, 1, 3, 4), (0, 3, 4)])
def test_chunked_rows_equal_unchunked(bounds):
    for scores, relevant, expected in [(SCORES, RELEVANT, IMAGE_TO_TEXT), (SCORES.T, RELEVANT.T, TEXT_TO_IMAGE)]:
        edges = [round(b * scores.shape[0] / 4) for b in bounds]
        accumulator = RetrievalAccumulator()
        for start, stop in zip(edges[:-1], edges[1:]):
            accumulator.update(scores[start:stop], relevant[start:stop])
        assert accumulator.num_queries == scores.shape[0]
        assert_metrics(accumulator.compute(), expected)


def test_chunked_random_equals_unchunked():
    scores = torch.randn(50, 37)
    relevant = torch.rand(50, 37) < 0.2
    relevant[torch.arange(50), torch.randint(0, 37, (50,))] = True  # at least one per query
    paired = torch.zeros_like(relevant)
    paired[torch.arange(50), torch.randint(0, 37, (50,))] = True
    whole = retrieval_metrics(scores, relevant, paired)
    accumulator = RetrievalAccumulator()
    for start in range(0, 50, 16):
        accumulator.update(scores[start : start + 16], relevant[start : start + 16], paired[start : start + 16])
    chunked = accumulator.compute()
    assert chunked == pytest.approx(whole, abs=1e-9)  # float64 means of 50 ranks in two orders: γ_50·100 ≈ 6e-13


def test_recall_uses_paired_and_precision_uses_relevant():
    # One query, 4 items ranked i0 i1 i2 i3. Paired positive: i2 (rank 3). Relevant: i0, i2.
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6]])
    paired = torch.tensor([[0, 0, 1, 0]], dtype=torch.bool)
    relevant = torch.tensor([[1, 0, 1, 0]], dtype=torch.bool)
    result = retrieval_metrics(scores, relevant, paired, ks=(1, 2, 3))
    # R@1 = R@2 = 0 (i2 is third), R@3 = 1; R=2: top-2 = i0* i1 -> R-P = 1/2, mAP@R = (1/2)(1) = 1/2.
    assert_metrics(
        result,
        {"R@1": 0.0, "R@2": 0.0, "R@3": 100.0, "mean_recall": 100 / 3, "mAP@R": 50.0, "R-Precision": 50.0},
    )


def test_ties_are_broken_by_index():
    scores = torch.tensor([[0.5, 0.5, 0.5, 0.1, 0.5, 0.9]])
    # Order: item 5 (0.9), then the tied 0.5s in index order 0 1 2 4, then item 3.
    assert rank_order(scores).tolist() == [[5, 0, 1, 2, 4, 3]]

    def first_rank_recall(item):
        relevant = torch.zeros(1, 6, dtype=torch.bool)
        relevant[0, item] = True
        return retrieval_per_query(scores, relevant, ks=(1, 2, 3))

    # Item 0 is second (after item 5): R@1 0, R@2 1. Item 1 is third: R@2 0, R@3 1.
    assert first_rank_recall(0)["R@1"].item() == 0 and first_rank_recall(0)["R@2"].item() == 1
    assert first_rank_recall(1)["R@2"].item() == 0 and first_rank_recall(1)["R@3"].item() == 1
    # Item 4 is fifth though it is tied with items 0-2: not in the top 3.
    assert first_rank_recall(4)["R@3"].item() == 0


def test_constant_scores_rank_in_index_order():
    # A collapsed scorer: relevant {1, 3} ranked 2nd and 4th -> R=2: R-P = 1/2, mAP@R = (1/2)(1/2).
    relevant = torch.tensor([[0, 1, 0, 1]], dtype=torch.bool)
    values = retrieval_per_query(torch.zeros(1, 4), relevant)
    assert values["R-Precision"].item() == pytest.approx(0.5)
    assert values["mAP@R"].item() == pytest.approx(0.25)


def test_query_without_relevant_items_is_an_error_naming_it():
    accumulator = RetrievalAccumulator()
    accumulator.update(SCORES[:2], RELEVANT[:2])
    relevant = RELEVANT[2:].clone()
    relevant[1] = False  # global query 3
    with pytest.raises(ValueError, match="query 3 has no relevant"):
        accumulator.update(SCORES[2:], relevant)


def test_query_without_paired_items_is_an_error():
    paired = RELEVANT.clone()
    paired[0] = False
    with pytest.raises(ValueError, match="query 0 has no paired"):
        retrieval_metrics(SCORES, RELEVANT, paired)


def test_nan_scores_are_an_error():
    scores = SCORES.clone()
    scores[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        retrieval_metrics(scores, RELEVANT)


def test_empty_accumulators_are_an_error():
    with pytest.raises(ValueError):
        RetrievalAccumulator().compute()
    with pytest.raises(ValueError):
        ClassificationAccumulator(3).compute()


# --------------------------------------------------------------------------- classification
# 6 samples, 6 classes, imbalanced labels: class 0 has 4 samples, classes 1 and 2 one each,
# classes 3-5 none.
CLASS_SCORES = torch.tensor(
    [
        [0.9, 0.1, 0.0, 0.0, 0.0, 0.0],  # label 0: rank 1
        [0.8, 0.1, 0.1, 0.0, 0.0, 0.0],  # label 0: rank 1
        [0.7, 0.2, 0.1, 0.0, 0.0, 0.0],  # label 0: rank 1
        [0.0, 0.5, 0.4, 0.3, 0.2, 0.1],  # label 0: rank 6 -> outside the top 5
        [0.6, 0.3, 0.1, 0.0, 0.0, 0.0],  # label 1: rank 2 -> top-5 only
        [0.1, 0.1, 0.8, 0.0, 0.0, 0.0],  # label 2: rank 1
    ]
)
CLASS_LABELS = torch.tensor([0, 0, 0, 0, 1, 2])
# top1 = 4/6, top5 = 5/6; per-class top-1 recall: class 0: 3/4, class 1: 0/1, class 2: 1/1,
# classes 3-5 have no samples and are left out -> mean = (3/4 + 0 + 1)/3 = 7/12.
# (Plain accuracy 4/6 = 66.7 differs from the balanced 58.3: the imbalance matters.)
CLASSIFICATION = {"top1": 100 * 4 / 6, "top5": 100 * 5 / 6, "mean_per_class_recall": 100 * 7 / 12}


def test_classification_hand_computed():
    assert_metrics(classification_metrics(CLASS_SCORES, CLASS_LABELS), CLASSIFICATION)


def test_classification_chunked_equals_unchunked():
    accumulator = ClassificationAccumulator(6)
    for start, stop in [(0, 1), (1, 4), (4, 6)]:
        accumulator.update(CLASS_SCORES[start:stop], CLASS_LABELS[start:stop])
    assert accumulator.num_samples == 6
    assert_metrics(accumulator.compute(), CLASSIFICATION)


def test_top5_with_fewer_than_five_classes_uses_all_classes():
    scores = torch.tensor([[0.1, 0.2, 0.7], [0.3, 0.6, 0.1]])
    labels = torch.tensor([0, 2])  # ranks 3 and 3: top1 wrong, but within min(5, 3) = 3
    result = classification_metrics(scores, labels)
    assert result["top1"] == 0.0
    assert result["top5"] == 100.0


def test_classification_ties_are_broken_by_index():
    scores = torch.tensor([[0.5, 0.5, 0.1], [0.5, 0.5, 0.1]])
    labels = torch.tensor([0, 1])  # class 0 wins the tie: first right, second wrong
    assert classification_metrics(scores, labels)["top1"] == 50.0


def test_classification_rejects_bad_labels():
    with pytest.raises(ValueError, match="labels"):
        classification_metrics(CLASS_SCORES, torch.tensor([0, 0, 0, 0, 1, 6]))
    with pytest.raises(ValueError, match="scores must be"):
        ClassificationAccumulator(5).update(CLASS_SCORES, CLASS_LABELS)
