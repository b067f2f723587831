"""Image transforms without torchvision: random resized crop, resize + centre crop, to tensor, normalize.

Every transform accepts a PIL.Image in any mode (converted to RGB; transparency composited on white, see
`to_rgb`), a uint8 NumPy array (H, W, 3) or (H, W), or a uint8 torch tensor (3, H, W).
Geometry is done by PIL on uint8 images, as OpenCLIP's preprocessing does. Measured on this project's CPU,
a (32, 32, 3) uint8 crop + bicubic resize + to-tensor costs about 60 us through PIL and about 60 us through
`torch.nn.functional.interpolate(antialias=True)`, so one PIL path serves every input size.

Randomness: `RandomResizedCrop` draws from the `torch.Generator` or `numpy.random.Generator` it was given,
else from torch's global generator, so `torch.manual_seed(s)` reproduces the crops.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
from PIL import Image


# OpenAI CLIP's per-channel pixel statistics (RGB), used by every OpenAI / OpenCLIP checkpoint.
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)

ImageLike = Union[Image.Image, np.ndarray, torch.Tensor]
Generator = Union[torch.Generator, np.random.Generator, None]

INTERPOLATIONS = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}
# ResizeThenCenterCrop's bound on the resized intermediate (about 200 MB of RGB): past it, one resize of the box.
MAX_RESIZED_PIXELS = 224 * 224_000


_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def to_rgb(image: Image.Image) -> Image.Image:
    """PIL image of any mode -> RGB (alpha composited on white, 16-bit scaled to 8-bit; topoclip.data.images
    says why)."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _SIXTEEN_BIT_MODES or mode == "I":
        values = np.asarray(image).astype(np.int64)  # (H, W)
        if mode in _SIXTEEN_BIT_MODES or values.max(initial=0) > 255:
            values = (np.clip(values, 0, 65535) * 255 + 32767) // 65535
        return Image.fromarray(np.clip(values, 0, 255).astype(np.uint8), "L").convert("RGB")
    if mode == "F":
        values = np.asarray(image, dtype=np.float32)  # (H, W)
        values = np.nan_to_num(values, nan=0.0, posinf=255.0, neginf=0.0)
        if values.max(initial=0.0) <= 1.0:
            values = values * 255.0
        return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), "L").convert("RGB")
    if mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")  # L, 1, P, CMYK, YCbCr, LAB, HSV


def to_pil(image: ImageLike) -> Image.Image:
    """PIL RGB image from a PIL image (any mode), uint8 array (H, W, 3) / (H, W), or uint8 tensor (3, H, W)."""
    if isinstance(image, Image.Image):
        return to_rgb(image)
    if isinstance(image, torch.Tensor):
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
            raise TypeError(
                f"an image tensor must be uint8 (3, H, W); got {image.dtype} {tuple(image.shape)}. "
                "Convert float images with (x * 255).round().to(torch.uint8)."
            )
        image = image.permute(1, 2, 0).contiguous().numpy()  # (H, W, 3)
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or not (image.ndim == 2 or (image.ndim == 3 and image.shape[2] == 3)):
            raise TypeError(
                f"an image array must be uint8 (H, W, 3) or (H, W); got {image.dtype} {image.shape}. "
                "Convert float images with (x * 255).round().astype(numpy.uint8)."
            )
        return Image.fromarray(image).convert("RGB") if image.ndim == 2 else Image.fromarray(image)
    raise TypeError(f"expected a PIL.Image, a uint8 numpy array or a uint8 tensor, got {type(image).__name__}")


def _pair(size: Union[int, Sequence[int]]) -> tuple[int, int]:
    """(height, width) from an int or a pair."""
    if isinstance(size, int):
        return size, size
    height, width = size
    return int(height), int(width)


class RandomResizedCrop:
    """Crop a random box (area fraction in `scale`, aspect ratio in `ratio`) and resize it to `size`.

    The box is sampled with torchvision's algorithm: up to 10 tries of (uniform area fraction, log-uniform
    aspect ratio, uniform position), then a centre crop clamped to `ratio` as a fallback. Each try takes
    its four numbers from one draw, so the random stream differs from torchvision's, not the distribution.
    Output: PIL RGB image of `size` (int: square).
    """

    def __init__(
        self,
        size: Union[int, Sequence[int]],
        scale: tuple[float, float] = (0.8, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        interpolation: str = "bicubic",
        generator: Generator = None,
    ):
        if not (0 < scale[0] <= scale[1] <= 1):
            raise ValueError(f"scale must satisfy 0 < min <= max <= 1, got {scale}")
        if not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"ratio must satisfy 0 < min <= max, got {ratio}")
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {sorted(INTERPOLATIONS)}, got {interpolation!r}")
        self.size = _pair(size)
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.interpolation = interpolation
        self.generator = generator

    def _draw(self) -> list[float]:
        """Four uniform numbers in [0, 1): area, aspect ratio, top, left of one try (one RNG call, ~3 us)."""
        if isinstance(self.generator, np.random.Generator):
            return self.generator.random(4).tolist()
        return torch.rand(4, generator=self.generator, dtype=torch.float64).tolist()

    def get_params(self, width: int, height: int) -> tuple[int, int, int, int]:
        """Sample a crop box for an image of (width, height): (top, left, box_height, box_width)."""
        area = height * width
        log_low, log_high = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            u_area, u_ratio, u_top, u_left = self._draw()
            target_area = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u_area)
            aspect_ratio = math.exp(log_low + (log_high - log_low) * u_ratio)
            box_width = int(round(math.sqrt(target_area * aspect_ratio)))
            box_height = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < box_width <= width and 0 < box_height <= height:
                # Uniform integer offsets in [0, height - box_height] and [0, width - box_width].
                top = min(int(u_top * (height - box_height + 1)), height - box_height)
                left = min(int(u_left * (width - box_width + 1)), width - box_width)
                return top, left, box_height, box_width
        # Fallback: the largest centred box whose aspect ratio lies within `ratio`.
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            box_width, box_height = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            box_height, box_width = height, int(round(height * self.ratio[1]))
        else:
            box_width, box_height = width, height
        return (height - box_height) // 2, (width - box_width) // 2, box_height, box_width

    def __call__(self, image: ImageLike) -> Image.Image:
        image = to_pil(image)
        top, left, box_height, box_width = self.get_params(*image.size)
        height, width = self.size
        return image.resize(
            (width, height), INTERPOLATIONS[self.interpolation], box=(left, top, left + box_width, top + box_height)
        )

    def __repr__(self) -> str:
        return f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, {self.interpolation})"


class Resize:
    """Resize so the shorter side is `size`, keeping the aspect ratio (torchvision's rounding)."""

    def __init__(self, size: int, interpolation: str = "bicubic"):
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {sorted(INTERPOLATIONS)}, got {interpolation!r}")
        self.size = int(size)
        self.interpolation = interpolation

    def __call__(self, image: ImageLike) -> Image.Image:
        image = to_pil(image)
        width, height = image.size
        if width <= height:
            new_width, new_height = self.size, int(self.size * height / width)
        else:
            new_width, new_height = int(self.size * width / height), self.size
        if (new_width, new_height) == (width, height):
            return image
        return image.resize((new_width, new_height), INTERPOLATIONS[self.interpolation])

    def __repr__(self) -> str:
        return f"Resize({self.size}, {self.interpolation})"


class CenterCrop:
    """Crop the centred box of `size` (int: square); an image smaller than that is padded with black."""

    def __init__(self, size: Union[int, Sequence[int]]):
        self.size = _pair(size)

    def __call__(self, image: ImageLike) -> Image.Image:
        image = to_pil(image)
        width, height = image.size
        crop_height, crop_width = self.size
        top = int(round((height - crop_height) / 2.0))
        left = int(round((width - crop_width) / 2.0))
        # PIL fills the part of the box outside the image with zeros.
        return image.crop((left, top, left + crop_width, top + crop_height))

    def __repr__(self) -> str:
        return f"CenterCrop({self.size})"


class ResizeCenterCrop(Resize):
    """Resize (shorter side to `size`) then centre crop (size x size), done as one resize of the source box.

    Same geometry as Compose([Resize(size), CenterCrop(size)]) up to sub-pixel rounding, but only the
    cropped part is resampled: a 100000 x 2 image costs size x size pixels, not a 11 M x 224 intermediate.
    """

    def __call__(self, image: ImageLike) -> Image.Image:
        image = to_pil(image)
        width, height = image.size
        short, long = min(width, height), max(width, height)
        resized_long = int(self.size * long / short)  # Resize's rounding
        offset = int(round((resized_long - self.size) / 2.0))  # CenterCrop's rounding, in resized pixels
        scale = long / resized_long  # source pixels per resized pixel along the long side
        start, end = offset * scale, (offset + self.size) * scale
        box = (start, 0.0, end, float(height)) if width >= height else (0.0, start, float(width), end)
        return image.resize((self.size, self.size), INTERPOLATIONS[self.interpolation], box=box)

    def __repr__(self) -> str:
        return f"ResizeCenterCrop({self.size}, {self.interpolation})"


class ResizeThenCenterCrop(Resize):
    """OpenCLIP's evaluation geometry exactly: Resize (shorter side to `size`) then CenterCrop, PIL's own steps.

    An image whose resized copy would exceed MAX_RESIZED_PIXELS (an aspect ratio past 1,000:1 at 224)
    takes ResizeCenterCrop's one-step path instead: the same box, without a gigapixel intermediate.
    """

    def __call__(self, image: ImageLike) -> Image.Image:
        image = to_pil(image)
        width, height = image.size
        short, long = min(width, height), max(width, height)
        if self.size * int(self.size * long / short) > MAX_RESIZED_PIXELS:
            return ResizeCenterCrop.__call__(self, image)
        return CenterCrop(self.size)(Resize.__call__(self, image))

    def __repr__(self) -> str:
        return f"ResizeThenCenterCrop({self.size}, {self.interpolation})"


class ResizeSquash(Resize):
    """The whole image resized to size × size, its aspect ratio not kept and nothing cropped (SigLIP's evaluation
    geometry: transformers' SiglipImageProcessor resizes to {height, width})."""

    def __call__(self, image: ImageLike) -> Image.Image:
        return to_pil(image).resize((self.size, self.size), INTERPOLATIONS[self.interpolation])

    def __repr__(self) -> str:
        return f"ResizeSquash({self.size}, {self.interpolation})"


class ToTensor:
    """uint8 image (H, W, 3) -> float tensor (3, H, W) in [0, 1]."""

    def __call__(self, image: ImageLike) -> torch.Tensor:
        array = np.asarray(to_pil(image))  # (H, W, 3) uint8, read-only view of the PIL buffer
        return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(255.0)

    def __repr__(self) -> str:
        return "ToTensor()"


class Normalize:
    """(x - mean) / std per channel on a float tensor (3, H, W) or (B, 3, H, W)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        if len(mean) != 3 or len(std) != 3:
            raise ValueError(f"mean and std need one value per RGB channel, got {list(mean)} and {list(std)}")
        if min(std) <= 0:
            raise ValueError(f"std must be positive, got {list(std)}")
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if not torch.is_floating_point(tensor):
            raise TypeError(f"Normalize needs a float tensor in [0, 1] (use ToTensor first), got {tensor.dtype}")
        return (tensor - self.mean.to(tensor.dtype)) / self.std.to(tensor.dtype)

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean.flatten().tolist()}, std={self.std.flatten().tolist()})"


class Compose:
    """Apply transforms in order."""

    def __init__(self, transforms: Sequence[Callable]):
        self.transforms = list(transforms)

    def __call__(self, image):
        for transform in self.transforms:
            image = transform(image)
        return image

    def __repr__(self) -> str:
        return "Compose(" + ", ".join(repr(t) for t in self.transforms) + ")"


def resized_crops(
    images: torch.Tensor,
    boxes: torch.Tensor,
    size: int,
    mean: Sequence[float] = OPENAI_MEAN,
    std: Sequence[float] = OPENAI_STD,
) -> torch.Tensor:
    """Crop each image to its box and resize to `size`, in one batched call; then scale and normalize.

    images: (B, 3, H, W) uint8; boxes: (B, 4) (top, left, box_height, box_width) as
    `RandomResizedCrop.get_params` draws them. Returns (B, 3, size, size) float32. Bilinear sampling at the
    output pixels' centres (`grid_sample`, align_corners=False), so a full-image box at the same size is
    the identity. The built-in scenes train through this (one call per batch instead of a PIL resize per
    image); user images go through `train_transform`.
    """
    batch, _, height, width = images.shape
    top, left, box_height, box_width = boxes.to(torch.float32).unbind(1)  # (B,) each
    theta = torch.zeros(batch, 2, 3)
    # Output coordinate u in [-1, 1] reads input coordinate centre + half-extent * u (normalised to [-1, 1]).
    theta[:, 0, 0] = box_width / width
    theta[:, 0, 2] = (2 * left + box_width) / width - 1
    theta[:, 1, 1] = box_height / height
    theta[:, 1, 2] = (2 * top + box_height) / height - 1
    grid = torch.nn.functional.affine_grid(theta, [batch, 3, size, size], align_corners=False)
    pixels = torch.nn.functional.grid_sample(images.to(torch.float32), grid, mode="bilinear",
                                             padding_mode="border", align_corners=False)  # (B, 3, size, size)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1) * 255
    std_t = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1) * 255
    return (pixels - mean_t) / std_t


# torch's antialiased resampling of uint8 images: PIL's kernels (bicubic a = −0.5, bilinear) with PIL's support
# scaled by the reduction, in integer arithmetic like PIL's; measured here beside PIL on 240 → 224 px photo crops:
# at most 2 apart in a pixel, 0.004 on average, at a fifth of PIL's time (0.19 ms against 0.90 on one core).
TORCH_MODES = {"bicubic": "bicubic", "bilinear": "bilinear"}


class TrainingCrop:
    """A user stream's training pixels: RandomResizedCrop's box (the same draws, so the same boxes), cut from the
    decoded image and resized by torch's antialiased resampling, as a uint8 tensor (3, size, size). The normalisation
    waits for the device the step runs on (`device_pixels`): a quarter of the bytes cross the workers' pipe and the
    host copy, and the worker does neither the float conversion nor the normalisation.

    topoclip.data.images.decode_for decodes image bytes or a file for it: the box is drawn from the header's size
    before any pixel is decoded (`draw`), and a JPEG whose box holds at least twice the output's pixels on each side
    is decoded at the reduced DCT scale (1/2, 1/4, 1/8) that still holds the box at full output resolution."""

    def __init__(self, size: int, scale: tuple[float, float] = (0.8, 1.0), interpolation: str = "bicubic",
                 generator: Generator = None):
        self.crop = RandomResizedCrop(size, scale=scale, interpolation=interpolation, generator=generator)

    def __call__(self, image: ImageLike) -> torch.Tensor:
        image = to_pil(image)
        return self.cut(image, image.size, self.crop.get_params(*image.size))

    def draw(self, width: int, height: int) -> tuple[tuple[int, int, int, int], Optional[tuple[int, int]]]:
        """(box, needed): this sample's box (top, left, height, width) for an image of `width` × `height`, and the
        smallest size that holds the box at the output's resolution when it is at least twice the output on each
        side (a reduction of 2, 4 or 8, as a JPEG's DCT can decode), else None (decode it whole)."""
        box = self.crop.get_params(width, height)
        _, _, box_height, box_width = box
        height_out, width_out = self.crop.size
        reduction = 1
        while reduction < 8 and box_width >= 2 * reduction * width_out and box_height >= 2 * reduction * height_out:
            reduction *= 2
        return box, None if reduction == 1 else (-(-width // reduction), -(-height // reduction))

    def cut(self, image: Image.Image, drawn_on: tuple[int, int], box: tuple[int, int, int, int]) -> torch.Tensor:
        """The box (top, left, height, width) drawn on an image of size `drawn_on`, cut from `image` (that image,
        or it decoded at a reduced scale) and resized to the output size."""
        top, left, box_height, box_width = box
        scale_x, scale_y = image.size[0] / drawn_on[0], image.size[1] / drawn_on[1]
        x0, y0 = round(left * scale_x), round(top * scale_y)
        x1 = max(x0 + 1, min(image.size[0], round((left + box_width) * scale_x)))
        y1 = max(y0 + 1, min(image.size[1], round((top + box_height) * scale_y)))
        pixels = torch.from_numpy(np.array(image))[y0:y1, x0:x1]  # (h, w, 3) uint8
        out = torch.nn.functional.interpolate(pixels.permute(2, 0, 1)[None], size=self.crop.size,
                                              mode=TORCH_MODES[self.crop.interpolation], antialias=True)
        return out[0]

    def __repr__(self) -> str:
        return f"TrainingCrop({self.crop!r}, uint8)"


def device_pixels(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """A batch of training pixels as the model takes them, on the images' device: uint8 (B, 3, H, W) from
    `TrainingCrop` scaled and normalised with ToTensor's and Normalize's operations in their order (so the floats
    equal what a worker computed before: x / 255, then (x − mean) / std); float images (already normalised, e.g.
    the built-in scenes') as they are."""
    if images.dtype != torch.uint8:
        return images
    mean_t = torch.tensor(mean, dtype=torch.float32, device=images.device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32, device=images.device).view(1, 3, 1, 1)
    return images.float().div_(255.0).sub_(mean_t).div_(std_t).contiguous()


def train_transform(
    image_size: int,
    mean: Sequence[float] = OPENAI_MEAN,
    std: Sequence[float] = OPENAI_STD,
    scale: tuple[float, float] = (0.8, 1.0),
    interpolation: str = "bicubic",
    generator: Generator = None,
) -> Compose:
    """Training transform: image -> float tensor (3, image_size, image_size), random resized crop, normalized."""
    return Compose(
        [
            RandomResizedCrop(image_size, scale=scale, interpolation=interpolation, generator=generator),
            ToTensor(),
            Normalize(mean, std),
        ]
    )


EVAL_RESIZES = {"crop-box": ResizeCenterCrop, "shortest": ResizeThenCenterCrop, "squash": ResizeSquash}


def eval_transform(
    image_size: int,
    mean: Sequence[float] = OPENAI_MEAN,
    std: Sequence[float] = OPENAI_STD,
    interpolation: str = "bicubic",
    resize: str = "crop-box",
) -> Compose:
    """Evaluation transform: image -> float tensor (3, image_size, image_size): shorter side resize, centre crop.

    resize: "crop-box" (one resize of the crop box) or "shortest" (OpenCLIP's two steps; see
    model.vision.eval_resize): the two give the same box, their pixels differ by resampling only; or "squash"
    (the whole image to size × size, SigLIP's).
    """
    if resize not in EVAL_RESIZES:
        raise ValueError(f"resize must be one of {sorted(EVAL_RESIZES)}, got {resize!r}")
    return Compose([EVAL_RESIZES[resize](image_size, interpolation), ToTensor(), Normalize(mean, std)])
