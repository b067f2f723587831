"""The built-in captioned scenes: determinism, disjoint splits, noise, hold-outs, true captions, evaluation sets."""
import hashlib
import pickle
from itertools import combinations, permutations

import numpy as np
import pytest
import torch

from topoclip.data.scenes import (
    COLOURS,
    RELATIONS,
    SHAPES,
    SceneConfig,
    SceneDataset,
    SceneObject,
    classification_sets,
    object_coverage,
    relation_holds,
    retrieval_set,
)
from topoclip.data.types import ClassificationSet, RetrievalSet


def small_config(**changes) -> SceneConfig:
    settings = dict(train_size=3000, val_size=400, test_size=1500, seed=3)
    settings.update(changes)
    return SceneConfig(**settings)


def centroid(obj: SceneObject, image_size: int) -> tuple[float, float]:
    """Centre of mass (x, y) of the pixels the object covers when rendered."""
    coverage = object_coverage(obj, image_size)
    ys, xs = np.mgrid[:image_size, :image_size] + 0.5
    return float((coverage * xs).sum() / coverage.sum()), float((coverage * ys).sum() / coverage.sum())


def pixel_relation_holds(first, relation, second) -> bool:
    (xa, ya), (xb, yb) = first, second
    return {"to the left of": xa < xb, "to the right of": xa > xb, "above": ya < yb, "below": ya > yb}[relation]


@pytest.mark.parametrize("style", ["in-domain", "out-of-domain"])
@pytest.mark.parametrize("image_size", [32, 48])
def test_items_are_uint8_images_and_captions(style, image_size):
    dataset = SceneDataset(small_config(style=style, image_size=image_size), "train")
    image, caption = dataset[7]
    assert image.dtype == np.uint8 and image.shape == (image_size, image_size, 3)
    assert isinstance(caption, str) and caption
    images, captions = dataset.batch([7, 8])
    assert images.shape == (2, image_size, image_size, 3) and images.dtype == np.uint8
    assert np.array_equal(images[0], image) and captions[0] == caption
    assert len(dataset) == 3000
    with pytest.raises(IndexError):
        dataset[3000]


def test_transform_is_applied():
    dataset = SceneDataset(small_config(), "val", transform=lambda a: torch.from_numpy(a).permute(2, 0, 1))
    image, _ = dataset[0]
    assert isinstance(image, torch.Tensor) and image.shape == (3, 32, 32)


def test_same_seed_same_bytes_other_seed_differs():
    first, second = SceneDataset(small_config(), "train"), SceneDataset(small_config(), "train")
    other = SceneDataset(small_config(seed=4), "train")
    for i in (0, 1, 2999):
        assert first[i][0].tobytes() == second[i][0].tobytes()
        assert first[i][1] == second[i][1]
    assert sum(first[i][0].tobytes() != other[i][0].tobytes() for i in range(20)) == 20


def test_item_does_not_depend_on_access_order_or_process():
    config = small_config(noise=0.3)
    fresh = SceneDataset(config, "train")
    expected = {i: fresh[i] for i in (5, 17)}
    busy = SceneDataset(config, "train")
    for i in range(40, 0, -1):  # touch many other items first, in reverse
        busy[i]
    copied = pickle.loads(pickle.dumps(busy))  # what a DataLoader worker receives
    for i, (image, caption) in expected.items():
        for dataset in (busy, copied):
            got_image, got_caption = dataset[i]
            assert np.array_equal(got_image, image) and got_caption == caption
    loader = torch.utils.data.DataLoader(busy, batch_size=None, num_workers=2, sampler=[17, 5])
    produced = {17: None, 5: None}
    for index, (image, caption) in zip([17, 5], loader):
        produced[index] = (np.asarray(image), caption)
    for i, (image, caption) in expected.items():
        assert np.array_equal(produced[i][0], image) and produced[i][1] == caption


def test_splits_never_share_a_sample():
    # "The same sample" = same Scene.key() (every render parameter) or the same image bytes.
    config = small_config()
    keys, images = {}, {}
    for split in ("train", "val", "test"):
        dataset = SceneDataset(config, split)
        count = min(len(dataset), 1500)
        keys[split] = {dataset.scene(i).key() for i in range(count)}
        images[split] = {hashlib.sha1(dataset.image(i).tobytes()).hexdigest() for i in range(0, count, 3)}
        assert len(keys[split]) == count  # no duplicates within a split either
    for a, b in combinations(("train", "val", "test"), 2):
        assert not keys[a] & keys[b], (a, b)
        assert not images[a] & images[b], (a, b)


@pytest.mark.parametrize("noise, train_size", [(0.25, 1000), (0.3, 333), (1.0, 50)])
def test_noise_replaces_exactly_round_p_n_captions(noise, train_size):
    clean = SceneDataset(small_config(train_size=train_size), "train")
    noisy = SceneDataset(small_config(train_size=train_size, noise=noise), "train")
    expected = round(noise * train_size)
    assert len(noisy.noisy_indices) == expected
    clean_texts = [clean[i][1] for i in range(train_size)]
    changed = [i for i in range(train_size) if noisy[i][1] != clean_texts[i]]
    assert changed == noisy.noisy_indices.tolist()
    for i in noisy.noisy_indices[:50]:
        assert noisy.is_noisy(int(i))
        assert not noisy.paired_caption(int(i)).describes(noisy.scene(int(i)))  # the borrowed caption is wrong
        assert noisy[int(i)][1] in clean_texts  # and it is another pair's caption
        assert np.array_equal(noisy[int(i)][0], clean[int(i)][0])  # images are untouched
    first_noisy = int(noisy.noisy_indices[0])
    assert noisy.captions_for(first_noisy, 3)[0] == clean_texts[first_noisy]  # retrieval captions stay clean


def test_true_pairs_marks_each_caption_against_each_scene():
    dataset = SceneDataset(small_config(train_size=200, noise=0.25), "train")
    indices = list(range(40))
    truth = dataset.true_pairs(indices)
    assert truth.shape == (40, 40)
    assert np.array_equal(~truth.diagonal(), np.array([dataset.is_noisy(i) for i in indices]))  # a clean pair is true
    for j, k in [(0, 1), (5, 3), (17, 30), (39, 0)]:
        assert truth[j, k] == dataset.paired_caption(j).describes(dataset.scene(k))
    texts = [dataset.paired_caption(i).text for i in indices]
    duplicates = [(j, k) for j in indices for k in indices if j != k and texts[j] == texts[k]]
    assert all(truth[j, k] == truth[k, k] for j, k in duplicates)  # one text, one truth


def test_only_the_train_split_is_noisy():
    config = small_config(noise=0.5)
    for split in ("val", "test"):
        assert len(SceneDataset(config, split).noisy_indices) == 0
    assert len(SceneDataset(config, "train").noisy_indices) == 1500


def test_held_out_compositions_never_in_training_but_in_test_and_composition_sets():
    config = small_config(held_out=["red circle", "blue star", "white heart"])
    held_out = {tuple(item.split()) for item in config.held_out}
    for split in ("train", "val"):
        dataset = SceneDataset(config, split)
        seen = {(o.colour, o.shape) for i in range(len(dataset)) for o in dataset.scene(i).objects}
        assert not seen & held_out, split
        assert len(seen) == len(COLOURS) * len(SHAPES) - len(held_out)  # everything else does occur
    test = SceneDataset(config, "test")
    seen = {(o.colour, o.shape) for i in range(len(test)) for o in test.scene(i).objects}
    assert held_out <= seen
    sets = {s.name: s for s in classification_sets(config, size=64, include_out_of_domain=False)}
    composition = sets["composition"]
    labelled = {composition.classnames[k] for k in composition.labels.tolist()}
    assert {" ".join(pair) for pair in held_out} <= labelled
    only_held_out = sets["composition-held-out"]
    assert {only_held_out.classnames[k] for k in only_held_out.labels.tolist()} == set(config.held_out)
    assert only_held_out.classnames == composition.classnames


def test_relations_are_true_of_rendered_pixels():
    dataset = SceneDataset(small_config(style="out-of-domain"), "train")
    checked = 0
    for i in range(300):
        scene = dataset.scene(i)
        centres = [centroid(o, scene.image_size) for o in scene.objects]
        for a, relation, b in scene.relations:
            assert pixel_relation_holds(centres[a], relation, centres[b]), (i, a, relation, b)
        for caption in dataset.annotated_captions_for(i, 5):
            if caption.relation is None:
                continue
            assert caption.relation in caption.text
            first, second = caption.mentions
            assert any(  # some pair of objects fits the mentions AND the relation holds in pixels
                first.matches(scene.objects[a]) and second.matches(scene.objects[b])
                and pixel_relation_holds(centres[a], caption.relation, centres[b])
                for a, b in permutations(range(len(scene.objects)), 2)
            ), (i, caption.text)
            checked += 1
    assert checked > 100


def test_every_caption_names_a_colour_or_shape_of_each_mention_and_is_true():
    dataset = SceneDataset(small_config(), "test")
    templates = set()
    for i in range(300):
        scene = dataset.scene(i)
        captions = dataset.annotated_captions_for(i, 5)
        assert len({c.text for c in captions}) == 5
        assert captions[0].text == dataset[i][1]  # the training caption is the first true caption
        for caption in captions:
            assert caption.describes(scene), caption.text
            for mention in caption.mentions:
                assert mention.colour is not None or mention.shape is not None
                named = [w for w in (mention.colour, mention.shape) if w is not None]
                assert all(w in caption.text for w in named)
            skeleton = caption.text
            for word in [*COLOURS, *SHAPES, *RELATIONS, "small", "large", "object", "shape", "two", "three"]:
                skeleton = skeleton.replace(word, "_")
            templates.add(skeleton.split(" ")[0] + str(len(caption.mentions)) + str(caption.count is not None))
    assert len(templates) >= 6  # several phrasings are in use


def test_retrieval_relevance_is_vectorised_ground_truth():
    config = small_config()
    retrieval = retrieval_set(config, size=120, captions_per_image=4)
    assert isinstance(retrieval, RetrievalSet)
    assert len(retrieval.images) == 120 and len(retrieval.captions) == 480
    images, captions = torch.arange(120), torch.arange(480)
    relevant = retrieval.relevant(images, captions)
    paired = retrieval.paired(images, captions)
    assert relevant.shape == (120, 480) and relevant.dtype == torch.bool
    assert bool(relevant[paired].all())  # every paired caption is relevant
    assert relevant.sum() > paired.sum()  # and other images match some captions too (ambiguity)
    assert relevant.float().mean() < 0.5  # but captions are discriminative
    dataset = SceneDataset(config, "test")
    annotated = [c for i in range(120) for c in dataset.annotated_captions_for(i, 4)]
    assert [c.text for c in annotated] == retrieval.captions
    rng = np.random.default_rng(0)
    for k, j in zip(rng.integers(120, size=400), rng.integers(480, size=400)):
        assert bool(relevant[k, j]) == annotated[j].describes(dataset.scene(int(k)))
    sub = retrieval.relevant(torch.tensor([5, 3]), torch.tensor([7, 100, 2]))  # arbitrary chunks agree
    assert torch.equal(sub, relevant[[5, 3]][:, [7, 100, 2]])


def test_classification_sets():
    config = small_config()
    sets = classification_sets(config, size=40)
    names = [s.name for s in sets]
    for name in ("shape", "colour", "composition", "composition-held-out", "shape-ood", "colour-ood"):
        assert name in names
    for s in sets:
        assert isinstance(s, ClassificationSet)
        assert len(s.images) == len(s.labels) == 40
        assert s.images[0].dtype == np.uint8 and s.images[0].shape == (32, 32, 3)
        assert s.labels.dtype == torch.int64 and 0 <= int(s.labels.min()) and int(s.labels.max()) < len(s.classnames)
        assert len(s.templates) >= 4 and all(t.count("{}") == 1 for t in s.templates)
    by_name = {s.name: s for s in sets}
    assert by_name["shape"].classnames == list(SHAPES) and by_name["colour"].classnames == list(COLOURS)
    assert torch.bincount(by_name["shape"].labels).tolist() == [5] * len(SHAPES)  # balanced
    assert not np.array_equal(by_name["shape"].images[0], by_name["shape-ood"].images[0])
    again = classification_sets(config, size=40)
    assert all(np.array_equal(a, b) for a, b in zip(sets[0].images, again[0].images))


def test_shapes_are_visually_distinct():
    # At 32 px a large object (~14 px) of each shape must differ from every other shape's mask.
    masks = {
        shape: object_coverage(SceneObject(shape, "red", "large", 1, 1, 16.0, 16.0, 14.0, 0.0, (255, 0, 0)), 32)
        for shape in SHAPES
    }
    for a, b in combinations(SHAPES, 2):
        overlap = np.minimum(masks[a], masks[b]).sum() / np.maximum(masks[a], masks[b]).sum()
        assert overlap < 0.8, (a, b, overlap)
    for shape, mask in masks.items():
        assert 25 < mask.sum() < 14 * 14, shape  # visible, and inside its box


def test_relation_holds_rejects_unknown_relation():
    obj = SceneObject("star", "red", "small", 0, 0, 5.0, 5.0, 8.0, 0.0, (255, 0, 0))
    with pytest.raises(ValueError, match="relation"):
        relation_holds(obj, "near", obj)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(image_size=8), "image_size"),
        (dict(noise=1.5), "noise"),
        (dict(noise=-0.1), "noise"),
        (dict(style="cartoon"), "style"),
        (dict(held_out=["pink circle"]), "held_out"),
        (dict(held_out="red circle"), "held_out"),
        (dict(held_out=[f"{c} star" for c in COLOURS]), "held_out"),
        (dict(min_objects=3, max_objects=2), "min_objects"),
        (dict(max_objects=10), "max_objects"),
        (dict(train_size=-1), "train_size"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_config_is_rejected_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        small_config(**changes)


def test_bad_split_and_sizes_are_rejected():
    with pytest.raises(ValueError, match="split"):
        SceneDataset(small_config(), "training")
    with pytest.raises(ValueError, match="size"):
        retrieval_set(small_config(), size=10_000)
    config = small_config()
    object.__setattr__(config, "noise", 2.0)  # changed after construction (around the freeze): caught when used
    with pytest.raises(ValueError, match="noise"):
        SceneDataset(config, "train")
