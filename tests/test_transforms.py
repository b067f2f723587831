"""Image transforms: shapes, ranges, crop statistics, determinism, centre cropping of non-square images."""

import numpy as np
import pytest
import torch
from PIL import Image

from topoclip.preprocess.transforms import (
    OPENAI_MEAN,
    OPENAI_STD,
    CenterCrop,
    Compose,
    Normalize,
    RandomResizedCrop,
    Resize,
    ResizeCenterCrop,
    ToTensor,
    eval_transform,
    train_transform,
)

from _reference import CAT, CAT_MISSING
from _tolerance import fp32_pair


IDENTITY = dict(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))  # leaves pixel values in [0, 1]


def random_uint8(height, width, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    "image",
    [
        random_uint8(32, 32),
        random_uint8(17, 45),
        Image.fromarray(random_uint8(40, 30)),
        Image.fromarray(random_uint8(40, 30)).convert("L"),
        Image.fromarray(random_uint8(40, 30)).convert("RGBA"),
        Image.fromarray(random_uint8(40, 30)).convert("P"),
        Image.fromarray(random_uint8(40, 30)).convert("CMYK"),
        random_uint8(20, 20)[:, :, 0],  # (H, W) greyscale array
        torch.from_numpy(random_uint8(24, 36)).permute(2, 0, 1),  # (3, H, W) uint8 tensor
    ],
)
@pytest.mark.parametrize("factory", [train_transform, eval_transform])
def test_output_shape_dtype_range(image, factory):
    out = factory(32, **IDENTITY)(image)
    assert out.shape == (3, 32, 32)
    assert out.dtype == torch.float32
    assert out.min() >= 0.0 and out.max() <= 1.0
    assert out.std() > 0.01  # an actual image, not a blank


def test_normalize_uses_openai_statistics():
    grey = np.full((8, 8, 3), 255, dtype=np.uint8)
    out = eval_transform(8)(grey)  # default mean / std are OpenAI's
    expected = (1.0 - torch.tensor(OPENAI_MEAN)) / torch.tensor(OPENAI_STD)
    torch.testing.assert_close(out[:, 4, 4], expected, **fp32_pair(3, 2.2))  # (x/255 − mean)/std ≤ 2.2, 3 roundings


def test_to_tensor_maps_uint8_to_unit_interval_in_chw():
    array = np.zeros((2, 3, 3), dtype=np.uint8)
    array[1, 2] = (255, 51, 0)
    out = ToTensor()(array)
    assert out.shape == (3, 2, 3)
    torch.testing.assert_close(out[:, 1, 2], torch.tensor([1.0, 0.2, 0.0]), **fp32_pair(1))  # one division by 255
    assert out[:, 0, 0].abs().sum() == 0


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(TypeError, match="uint8"):
        train_transform(8)(np.zeros((8, 8, 3), dtype=np.float32))
    with pytest.raises(TypeError, match="uint8"):
        train_transform(8)(torch.zeros(8, 8, 3, dtype=torch.uint8))  # HWC tensor: ambiguous, refused
    with pytest.raises(ValueError, match="scale"):
        RandomResizedCrop(8, scale=(0.5, 1.5))
    with pytest.raises(ValueError, match="interpolation"):
        Resize(8, interpolation="nearest-ish")


def test_crop_box_area_and_aspect_ratio_within_bounds():
    crop = RandomResizedCrop(32, scale=(0.3, 0.6), ratio=(3 / 4, 4 / 3))
    width, height = 1000, 800  # large enough that rounding to whole pixels is negligible
    fractions, ratios = [], []
    for _ in range(3000):
        top, left, box_height, box_width = crop.get_params(width, height)
        assert 0 <= top <= height - box_height and 0 <= left <= width - box_width
        fractions.append(box_height * box_width / (width * height))
        ratios.append(box_width / box_height)
    fractions, ratios = np.array(fractions), np.array(ratios)
    assert fractions.min() >= 0.3 - 2e-3 and fractions.max() <= 0.6 + 2e-3
    assert fractions.min() < 0.32 and fractions.max() > 0.58  # the whole range is used
    assert abs(fractions.mean() - 0.45) < 0.01  # uniform in area
    assert ratios.min() >= 3 / 4 - 1e-2 and ratios.max() <= 4 / 3 + 1e-2
    assert abs(np.log(ratios).mean()) < 0.01  # log-uniform aspect ratio is symmetric about 1


def test_crop_positions_cover_the_image():
    crop = RandomResizedCrop(8, scale=(0.25, 0.25), ratio=(1.0, 1.0))
    lefts = {crop.get_params(100, 100)[1] for _ in range(2000)}
    assert min(lefts) == 0 and max(lefts) == 50  # box of 50 px: every offset 0..50 is reachable


def test_crop_falls_back_to_centre_for_extreme_aspect_ratio():
    crop = RandomResizedCrop(32, scale=(0.8, 1.0), ratio=(3 / 4, 4 / 3))
    # 20000 x 4: no box with ratio <= 4/3 covers 80 % of the area, so every try fails.
    assert crop.get_params(20000, 4) == (0, (20000 - 5) // 2, 4, 5)
    out = train_transform(32, **IDENTITY)(np.zeros((4, 20000, 3), dtype=np.uint8))
    assert out.shape == (3, 32, 32)


def test_deterministic_under_torch_manual_seed():
    image = random_uint8(48, 64)
    transform = train_transform(32)
    torch.manual_seed(123)
    first = torch.stack([transform(image) for _ in range(5)])
    torch.manual_seed(123)
    second = torch.stack([transform(image) for _ in range(5)])
    torch.manual_seed(124)
    third = torch.stack([transform(image) for _ in range(5)])
    assert torch.equal(first, second)
    assert not torch.equal(first, third)
    assert not torch.equal(first[0], first[1])  # successive calls draw different crops


def test_explicit_generators_are_reproducible_and_independent_of_the_global_seed():
    image = random_uint8(48, 64)
    boxes = []
    for generator in (torch.Generator().manual_seed(7), np.random.default_rng(7)):
        crop = RandomResizedCrop(32, scale=(0.2, 1.0), generator=generator)
        torch.manual_seed(0)
        boxes.append([crop.get_params(64, 48) for _ in range(20)])
    crop_torch = RandomResizedCrop(32, scale=(0.2, 1.0), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(999)  # the global seed must not matter
    assert [crop_torch.get_params(64, 48) for _ in range(20)] == boxes[0]
    crop_numpy = RandomResizedCrop(32, scale=(0.2, 1.0), generator=np.random.default_rng(7))
    assert [crop_numpy.get_params(64, 48) for _ in range(20)] == boxes[1]
    assert len(set(boxes[0])) > 10
    assert crop_torch(image).size == (32, 32)


def _red_centre_blue_sides(width, height):
    """A (height, width, 3) image: red in the centred height x height square (or width x width), blue outside."""
    image = np.zeros((height, width, 3), dtype=np.uint8)
    image[..., 2] = 255
    side = min(width, height)
    top, left = (height - side) // 2, (width - side) // 2
    image[top : top + side, left : left + side] = (255, 0, 0)
    return image


@pytest.mark.parametrize("width,height", [(90, 60), (60, 90)])
def test_eval_transform_centre_crops_non_square_image(width, height):
    out = eval_transform(30, **IDENTITY)(_red_centre_blue_sides(width, height))  # (3, 30, 30)
    assert out.shape == (3, 30, 30)
    # Away from the resampling seam at the border, the crop is the red centre: a crop shifted towards
    # either side would put blue into these pixels.
    interior = out[:, 2:-2, 2:-2]
    assert torch.all(interior[0] > 0.95) and torch.all(interior[2] < 0.05)


def test_resize_keeps_aspect_ratio_and_center_crop_pads_small_images():
    resized = Resize(20)(random_uint8(40, 100))
    assert resized.size == (50, 20)  # (W, H): shorter side 20
    cropped = CenterCrop(8)(np.full((4, 4, 3), 200, dtype=np.uint8))
    array = np.asarray(cropped)
    assert array.shape == (8, 8, 3)
    assert array[0, 0].tolist() == [0, 0, 0] and array[4, 4].tolist() == [200, 200, 200]


def test_compose_and_normalize_compose_in_order():
    pipeline = Compose([CenterCrop(4), ToTensor(), Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    out = pipeline(np.full((6, 6, 3), 255, dtype=np.uint8))
    torch.testing.assert_close(out, torch.ones(3, 4, 4), **fp32_pair(3))  # 255/255, then (1 − 0.5)/0.5
    with pytest.raises(TypeError, match="ToTensor"):
        Normalize((0.5,) * 3, (0.5,) * 3)(torch.zeros(3, 2, 2, dtype=torch.uint8))


@pytest.mark.parametrize("height,width", [(60, 90), (90, 60), (37, 50), (200, 300)])
def test_resize_center_crop_matches_resize_then_center_crop(height, width):
    noise = Image.fromarray(random_uint8(height // 4 + 1, width // 4 + 1))
    smooth = noise.resize((width, height), Image.Resampling.BICUBIC)  # a smooth image: rounding matters little
    two_steps = np.asarray(CenterCrop(32)(Resize(32)(smooth))).astype(float)
    one_step = np.asarray(ResizeCenterCrop(32)(smooth)).astype(float)
    assert np.abs(two_steps - one_step).mean() < 0.5  # of 255


def test_eval_transform_of_extremely_wide_image_stays_small():
    # Resize-then-crop would build a 11 M x 224 intermediate (7 GB); the one-step crop reads 2 x 2 pixels.
    out = eval_transform(224, **IDENTITY)(np.full((2, 100_000, 3), 77, dtype=np.uint8))
    assert out.shape == (3, 224, 224)
    # a constant image: interpolation weights summing to 1 (≤ 16 bicubic taps) times 77/255
    torch.testing.assert_close(out, torch.full((3, 224, 224), 77 / 255), **fp32_pair(16 + 1))


# --------------------------------------------------------------------------- OpenCLIP's evaluation pixels


def pil_resize_then_crop(image: Image.Image, size: int) -> np.ndarray:
    """OpenCLIP's eval geometry written out with PIL alone (torchvision's Resize / CenterCrop arithmetic)."""
    width, height = image.size
    if width <= height:
        resized = image.resize((size, int(size * height / width)), Image.Resampling.BICUBIC)
    else:
        resized = image.resize((int(size * width / height), size), Image.Resampling.BICUBIC)
    left = int(round((resized.width - size) / 2.0))
    top = int(round((resized.height - size) / 2.0))
    return np.asarray(resized.crop((left, top, left + size, top + size)), dtype=np.float32) / 255.0


@pytest.mark.parametrize("shape", ["cat", (37, 53), (224, 224), (225, 300), (301, 97), (1, 224), (640, 7)])
def test_shortest_eval_pixels_equal_pil_resize_then_centre_crop(shape):
    # Both sides run the same PIL resize and crop on the same uint8 image, then the same division by 255, so
    # the only room for a difference is none: the bound is 1/255 (one uint8 step), and the result is exact.
    if shape == "cat":
        if CAT is None:
            pytest.skip(CAT_MISSING)
        image = Image.open(CAT).convert("RGB")
    else:
        image = Image.fromarray(np.random.default_rng(sum(shape)).integers(0, 256, (*shape, 3), dtype=np.uint8))
    transform = eval_transform(224, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), resize="shortest")
    ours = transform(image).permute(1, 2, 0).numpy()
    assert np.abs(ours - pil_resize_then_crop(image, 224)).max() <= 1 / 255


def test_the_two_eval_resizes_crop_the_same_box():
    # A horizontal ramp: bicubic reproduces a linear ramp, so the two differ only by where the box falls, at most
    # half a resized pixel (the rounding of the crop offset) = 0.5 * 255 / 106 = 1.2 levels here, plus the
    # rounding to uint8 on each side: under 4 levels.
    ramp = np.tile(np.linspace(0, 255, 500).astype(np.uint8)[None, :, None], (300, 1, 3))
    plain = dict(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    one_step = eval_transform(64, resize="crop-box", **plain)(ramp)
    two_steps = eval_transform(64, resize="shortest", **plain)(ramp)
    assert (one_step - two_steps).abs().max() < 4 / 255
    with pytest.raises(ValueError, match="resize must be one of"):
        eval_transform(64, resize="stretch")


def test_squash_keeps_the_whole_image():
    """SigLIP's resize: the ramp's ends stay in the picture (a crop would cut its sides) and rows stay equal."""
    ramp = np.tile(np.linspace(0, 255, 500).astype(np.uint8)[None, :, None], (300, 1, 3))
    pixels = eval_transform(64, resize="squash", mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))(ramp)
    assert pixels.shape == (3, 64, 64) and float(pixels[0, :, 0].max()) < 4 / 255 and float(pixels[0, :, -1].min()) > 251 / 255
