"""Bad samples: counted by kind, carried across processes and batches, refused above the threshold; every
documented kind exercised somewhere in the suite."""
import pytest
import torch

from topoclip.data.batch import RawBatch, assemble_batches
from topoclip.data.quality import BAD_SAMPLE_KINDS, BadSample, BadSampleCounter, DataQualityError, check_bad_fraction


def test_counter_merges_and_threshold_message():
    first = BadSampleCounter(kept=90, bad={"corrupt_image": 6})
    second = BadSampleCounter(kept=10)
    second.add("empty_caption", 3)
    first += second
    first += {"corrupt_image": 1}
    first += RawBatch(torch.zeros(2, 3, 4, 4), ["a", "b"], {"tiny_image": 1})
    assert first.as_dict() == {
        "seen": 113,
        "kept": 102,
        "bad": {"corrupt_image": 7, "empty_caption": 3, "tiny_image": 1},
    }
    check_bad_fraction(first, threshold=0.1)  # 11 / 113 = 9.7 %: fine
    with pytest.raises(DataQualityError) as caught:
        check_bad_fraction(first, threshold=0.05)
    message = str(caught.value)
    assert "11 of 113" in message and "data.max_bad_fraction" in message
    assert "corrupt_image 7" in message and "empty_caption 3" in message and "tiny_image 1" in message
    check_bad_fraction(BadSampleCounter(kept=0, bad={"corrupt_image": 1}), 0.0, min_seen=10)  # too early
    with pytest.raises(ValueError, match="unknown bad-sample kind"):
        BadSample("misspelt_kind")

def test_bad_sample_survives_pickling_between_processes():
    import pickle

    restored = pickle.loads(pickle.dumps(BadSample("tiny_image", "1x1")))
    assert (restored.kind, restored.detail) == ("tiny_image", "1x1")

def test_assemble_batches_never_loses_counts():
    image = torch.zeros(3, 2, 2)
    outcomes = [BadSample("corrupt_image")] + [(image, str(i), f"k{i}") for i in range(5)] + [BadSample("tiny_image")] * 2
    batches = list(assemble_batches(iter(outcomes), batch_size=2, epoch=3, worker=1))
    assert [len(batch) for batch in batches] == [2, 2, 1]
    assert [batch.keys for batch in batches] == [["k0", "k1"], ["k2", "k3"], ["k4"]]
    # where each worker stands once a batch is consumed: the last one's cursor is the end of the stream
    assert [batch.positions for batch in batches] == [[(3, 1, 3, 1)], [(3, 1, 5, 2)], [(3, 1, 8, 3)]]
    total = BadSampleCounter()
    for batch in batches:
        total += batch
    assert total.as_dict() == {"seen": 8, "kept": 5, "bad": {"corrupt_image": 1, "tiny_image": 2}}
    dropped = list(assemble_batches(iter(outcomes), batch_size=2, drop_last=True))
    assert [len(batch) for batch in dropped] == [2, 2]
    assert sum(sum(batch.bad_samples.values()) for batch in dropped) == 3  # counts ride on the last batch
    only_bad = list(assemble_batches(iter([BadSample("corrupt_image")] * 3), batch_size=2))
    assert len(only_bad) == 1 and len(only_bad[0]) == 0 and only_bad[0].bad_samples == {"corrupt_image": 3}
    assert len(list(assemble_batches(iter(outcomes), batch_size=1, max_batches=3))) == 3

def test_every_documented_kind_is_exercised():
    exercised = {"corrupt_image", "tiny_image", "huge_image", "missing_file", "empty_caption", "bad_encoding",
                 "unpaired_member", "corrupt_shard", "path_outside_root",
                 "bad_label",  # in test_benchmarks.py (CLIP_benchmark's .cls labels)
                 "long_caption"}  # in test_hostile_inputs.py
    assert exercised == set(BAD_SAMPLE_KINDS)
