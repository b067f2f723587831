"""A user stream's training pixels since issue #59: the crop box drawn before decoding, JPEGs decoded at the reduced
DCT scale the box allows, torch's antialiased resampling on uint8, and the normalisation on the device. The boxes
are today's, the pixels' statistics are today's, and the normalised floats of the same uint8 crop are today's bit
for bit."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from topoclip.data.images import DecodeSettings, decode_for, decode_image
from topoclip.preprocess.transforms import (OPENAI_MEAN, OPENAI_STD, Normalize, RandomResizedCrop, ToTensor, TrainingCrop,
                                 device_pixels, train_transform)

SIZE = 64  # the output side: small, so the pictures below span no reduction (1×) to an eighth (8×)


def picture(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A photo-like picture: a smooth colour field, a 1/f texture and sensor noise (benchmarks/loader.py's kind)."""
    grid = rng.integers(0, 256, (3, 4, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(grid).resize((width, height), Image.BICUBIC), dtype=np.float32)
    fy, fx = np.fft.fftfreq(height)[:, None], np.fft.rfftfreq(width)[None, :]
    frequency = np.sqrt(fx * fx + fy * fy)
    frequency[0, 0] = 1.0
    texture = np.fft.irfft2((rng.standard_normal(frequency.shape) + 1j * rng.standard_normal(frequency.shape))
                            / frequency, s=(height, width))
    pixels = base + (texture * 25 / texture.std())[..., None] + rng.normal(0, 3, (height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def jpeg(image: Image.Image, orientation: int = 1) -> bytes:
    encoded = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    image.save(encoded, "JPEG", quality=90, exif=exif.tobytes() if orientation != 1 else b"")
    return encoded.getvalue()


@pytest.fixture(scope="module")
def samples() -> list[bytes]:
    rng = np.random.default_rng(0)
    sides = [(80, 70), (150, 130), (300, 260), (640, 560)]  # the box's reduction 1, 1–2, 2–4, 8
    return [jpeg(picture(rng, *sides[index % 4])) for index in range(24)] + [
        jpeg(picture(rng, 400, 300), orientation) for orientation in (3, 6, 8)]  # EXIF-turned photos


def todays(data: bytes, generator: torch.Generator) -> tuple[tuple, torch.Tensor]:
    """The path before #59: decode whole, draw the box, PIL's bicubic resize, ToTensor, Normalize."""
    image = decode_image(data)
    crop = RandomResizedCrop(SIZE, generator=generator)
    box = crop.get_params(*image.size)
    generator.manual_seed(generator.initial_seed())  # the transform draws the same box again
    pixels = train_transform(SIZE, generator=generator)(image)
    return box, pixels


def tomorrows(data: bytes, generator: torch.Generator) -> tuple[tuple, torch.Tensor]:
    boxes = []
    crop = TrainingCrop(SIZE, generator=generator)
    get_params = crop.crop.get_params
    crop.crop.get_params = lambda width, height: boxes.append(get_params(width, height)) or boxes[-1]
    pixels = decode_for(crop, data, DecodeSettings())
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, SIZE, SIZE)
    return boxes[0], device_pixels(pixels[None], OPENAI_MEAN, OPENAI_STD)[0]


def test_the_boxes_are_todays(samples):
    """The same draws on the same (upright) size: the same boxes, EXIF-turned photos included."""
    for seed, data in enumerate(samples):
        old, _ = todays(data, torch.Generator().manual_seed(seed))
        new, _ = tomorrows(data, torch.Generator().manual_seed(seed))
        assert old == new


def test_the_pixels_statistics_are_todays(samples):
    """Per picture and channel, in 0–255 levels. The mean: both filters (bicubic, and the DCT's own averaging at a
    reduced scale) keep a region's mean up to where their kernels reach past the box's edge, a pixel or two of a box
    ≥ 64 px wide, so within 2 levels; measured 0.2 on average. The spread: a reduction by 2–8 in the DCT averages
    before the bicubic does, which softens the finest detail; the standard deviation stays within 8 %, measured
    1.5 % on average. A systematic shift in either (a wrong box, a wrong scale, channels swapped) moves them by far
    more."""
    scale = torch.tensor(OPENAI_STD).view(3, 1) * 255
    mean_gaps, spread_ratios = [], []
    for seed, data in enumerate(samples):
        _, old = todays(data, torch.Generator().manual_seed(seed))
        _, new = tomorrows(data, torch.Generator().manual_seed(seed))
        old, new = old.reshape(3, -1) * scale, new.reshape(3, -1) * scale  # normalised units -> levels
        mean_gaps.append((old.mean(1) - new.mean(1)).abs())
        spread_ratios.append(new.std(1) / old.std(1))
    gaps, ratios = torch.stack(mean_gaps), torch.stack(spread_ratios)
    assert gaps.max() < 2.0 and gaps.mean() < 0.5
    assert (ratios - 1).abs().max() < 0.08 and (ratios - 1).abs().mean() < 0.03


def test_unreduced_pixels_are_pils_but_for_rounding_and_the_boxs_edge(samples):
    """Where no reduction applies (the 80 × 70 pictures), torch's antialiased bicubic is PIL's kernel (a = −0.5) in
    integer arithmetic too: inside, each pixel within 1 level of PIL's (their rounding). In the two rows and columns
    at the box's edge PIL's kernel reads the pixels past the box while torch, given the box alone, repeats its edge:
    there within 4 levels (measured 3), and the whole crop within 0.05 on average (measured 0.015)."""
    scale = torch.tensor(OPENAI_STD).view(3, 1, 1) * 255
    for seed, data in list(enumerate(samples))[0:24:4]:
        _, old = todays(data, torch.Generator().manual_seed(seed))
        _, new = tomorrows(data, torch.Generator().manual_seed(seed))
        difference = ((old - new) * scale).abs()
        assert difference[:, 2:-2, 2:-2].max() < 1.0 + 1e-3
        assert difference.max() < 4.0 + 1e-3 and difference.mean() < 0.05


def test_the_device_normalises_as_the_worker_did_bit_for_bit():
    """ToTensor then Normalize in a worker, or device_pixels after the copy: the same operations in the same order
    on the same uint8 values, so the same float32 values exactly."""
    pixels = torch.randint(0, 256, (5, 3, 17, 19), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    mean, std = (0.5, 0.25, 0.75), (0.2, 0.3, 0.4)
    old = torch.stack([Normalize(mean, std)(ToTensor()(image)) for image in pixels])
    assert torch.equal(device_pixels(pixels, mean, std), old)
    floats = torch.randn(2, 3, 4, 4)
    assert device_pixels(floats, mean, std) is floats  # the scenes' batches arrive normalised


def test_a_crop_of_a_decoded_image_is_the_decoded_path(samples):
    """TrainingCrop(image) on an already decoded image: the same box and pixels as from its bytes when no reduction
    applies."""
    data = samples[0]
    by_bytes = decode_for(TrainingCrop(SIZE, generator=torch.Generator().manual_seed(3)), data, DecodeSettings())
    by_image = TrainingCrop(SIZE, generator=torch.Generator().manual_seed(3))(decode_image(data))
    assert torch.equal(by_bytes, by_image)
