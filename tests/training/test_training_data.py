"""The built-in scenes' training stream: rendered once, cropped in batch, a pure function of the step."""
import torch

from topoclip.config import load_config
from topoclip.data.scenes import SceneConfig, SceneDataset
from topoclip.data.scene_batches import StepBatchSampler
from topoclip.run.training.data import LOADER_BATCHES_IN_FLIGHT, prefetch_factor, training_batches
from topoclip.preprocess.transforms import Normalize, OPENAI_MEAN, OPENAI_STD, ToTensor, resized_crops

from _tolerance import fp32_pair


def test_a_full_image_box_at_the_same_size_is_to_tensor_and_normalize():
    images, _ = SceneDataset(SceneConfig(train_size=4), "train").batch(range(4))  # (4, 32, 32, 3) uint8
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2)
    cropped = resized_crops(pixels, torch.tensor([[0, 0, 32, 32]] * 4), 32)
    expected = torch.stack([Normalize(OPENAI_MEAN, OPENAI_STD)(ToTensor()(image)) for image in images])
    # (x/255 − mean)/std in two orders: 3 fp32 roundings each on values ≤ |0 − 0.41|/0.26 ≈ 2.1
    torch.testing.assert_close(cropped, expected, **fp32_pair(3, 2.1))


def test_a_crop_box_reads_only_its_pixels():
    image = torch.zeros(1, 3, 8, 8, dtype=torch.uint8)
    image[..., 2:6, 4:8] = 255  # a white block; the box (top 2, left 4, 4 x 4) is all white
    out = resized_crops(image, torch.tensor([[2, 4, 4, 4]]), 8, mean=(0, 0, 0), std=(1, 1, 1))  # 2x upsampling
    torch.testing.assert_close(out[..., 1:7, 1:7], torch.ones(1, 3, 6, 6))
    # The outermost output pixels sample a quarter pixel outside the box (bilinear, as PIL's box resize).
    assert (out[..., 0, 1:7] == 0.75).all() and (out[..., 1:7, 0] == 0.75).all()


def test_the_sampler_lists_exactly_the_indices_it_will_read():
    sampler = StepBatchSampler(size=100, global_batch=8, seed=3, start_step=5)
    wanted = sampler.indices(4)
    batches = iter(sampler)
    read = {index for _ in range(4) for _, index in next(batches)}
    assert wanted.tolist() == sorted(read)


def test_resuming_the_stream_gives_the_same_batches():
    config = load_config("tiny", ["data.scenes.train_size=64", "train.batch_size=16", "train.num_workers=0"])
    whole = training_batches(config, start_step=0)
    first = [next(whole) for _ in range(6)]
    resumed = training_batches(config, start_step=4)
    for expected in first[4:]:
        batch = next(resumed)
        torch.testing.assert_close(batch.images, expected.images, atol=0, rtol=0)  # the same crops: exact
        assert batch.captions == expected.captions


def test_more_loader_workers_queue_no_more_batches():
    # Each queued item is a whole local batch (GBs at the paper's batch): 8 workers must not hold 4x what 2 did,
    # and the CPU presets' 2 workers keep their prefetch of 4.
    assert prefetch_factor(2) == 4
    for workers in range(1, 33):
        queued = workers * prefetch_factor(workers)
        assert prefetch_factor(workers) >= 1 and LOADER_BATCHES_IN_FLIGHT <= queued < LOADER_BATCHES_IN_FLIGHT + workers
