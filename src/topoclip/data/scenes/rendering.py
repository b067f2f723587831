"""Rendering a `Scene` to a uint8 image: numpy, 2x supersampled coverage inside each object's bounding box.

Decisions (tests rely on them):
- The scene fixes every render parameter except the background's random texture and grain, which come
  from the `rng` given to `render_scene` (the sample's own Generator, after the scene's draws).
- Domain shift: in-domain scenes have low-contrast, desaturated backgrounds (smooth noise, gradients,
  stripes) and filled objects; out-of-domain ones the same objects on darker, busy backgrounds
  (checkerboards, high-frequency texture), outlined or striped. `sample_scene` picks which.
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

import numpy as np

from .config import SHAPES
from .layout import Scene, SceneObject

_SUPERSAMPLE = 2
_STAR_INNER = 0.5  # inner / outer radius
_STAR_P2 = (_STAR_INNER * math.cos(math.pi / 5), _STAR_INNER * math.sin(math.pi / 5))
_OUTLINE_INNER = 0.55  # outline = shape minus the same shape scaled by this
_STRIPE_DARKEN = 0.45


def _shape_mask(shape: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Bool mask of a unit shape (fits in [-1, 1]^2) at local coordinates u (right), v (down)."""
    if shape == "circle":
        return u * u + v * v <= 0.9
    if shape == "square":
        return np.maximum(np.abs(u), np.abs(v)) <= 0.72
    if shape == "diamond":
        return np.abs(u) + np.abs(v) <= 1.0
    if shape == "triangle":  # apex up at (0, -1), base at v = 0.5
        return (v <= 0.5) & (v >= -1.0 + 1.7320508 * np.abs(u))
    if shape == "cross":
        au, av = np.abs(u), np.abs(v)
        return ((au <= 0.3) & (av <= 0.95)) | ((av <= 0.3) & (au <= 0.95))
    if shape == "star":  # 5 points, one up; fold the angle into one half-spike and test one edge
        radius = np.sqrt(u * u + v * v)
        angle = np.mod(np.arctan2(u, -v), np.float32(2 * math.pi / 5))
        folded = np.minimum(angle, np.float32(2 * math.pi / 5) - angle)
        px, py = radius * np.cos(folded), radius * np.sin(folded)
        (qx, qy) = _STAR_P2
        return (qx - 1.0) * py - qy * (px - 1.0) >= 0.0
    if shape == "heart":  # (x^2 + y^2 - 1)^3 <= x^2 y^3 with y up, scaled into the unit box
        x = u * 1.14
        y = 0.118 - v * 1.14
        t = x * x + y * y - 1.0
        return t * t * t <= x * x * y * y * y
    if shape == "crescent":  # a disc minus a disc shifted right; opens to the right
        return (u * u + v * v <= 0.9) & ((u - 0.45) ** 2 + v * v > 0.56)
    raise ValueError(f"unknown shape {shape!r}; use one of {list(SHAPES)}")


@lru_cache(maxsize=16)
def _pixel_grid(image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates x (1, S), y (S, 1), float32."""
    centres = np.arange(image_size, dtype=np.float32) + 0.5
    return centres[None, :], centres[:, None]


@lru_cache(maxsize=16)
def _upsample_matrix(image_size: int, low: int) -> np.ndarray:
    """(S, low) bilinear interpolation matrix: smooth noise = M @ coarse @ M.T."""
    positions = (np.arange(image_size) + 0.5) / image_size * (low - 1)
    left = np.clip(np.floor(positions).astype(int), 0, low - 2)
    weight = positions - left
    matrix = np.zeros((image_size, low), np.float32)
    matrix[np.arange(image_size), left] = 1 - weight
    matrix[np.arange(image_size), left + 1] = weight
    return matrix


def _background(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    """(S, S, 3) float32 background: low-contrast, desaturated (in-domain); dark, busy (out-of-domain)."""
    size = scene.image_size
    p = scene.background_parameters
    base = np.array(p[:3], np.float32)
    angle, amplitude, period, phase = p[3] * 2 * math.pi, p[4], p[5], p[6]
    x, y = _pixel_grid(size)
    if scene.background == "noise":  # smooth blobs, +-(6..12)
        low = size // 6 + 2
        coarse = rng.random((low, low), dtype=np.float32) * 2 - 1
        matrix = _upsample_matrix(size, low)
        field_ = (matrix @ coarse @ matrix.T) * (6 + 6 * amplitude)
    elif scene.background == "gradient":  # linear ramp, total swing 15..35
        ramp = (math.cos(angle) * x + math.sin(angle) * y) / size - 0.5
        field_ = ramp * (15 + 20 * amplitude)
    elif scene.background == "stripes":  # sinusoidal stripes, period 3..8 px, +-(5..10)
        wave = (math.cos(angle) * x + math.sin(angle) * y) * (2 * math.pi / (3 + 5 * period)) + phase * 2 * math.pi
        field_ = np.sin(wave) * (5 + 5 * amplitude)
    elif scene.background == "checkerboard":  # 2..4 px checks, contrast 35..60
        check = int(2 + 3 * period) if period < 1 else 4
        cells = ((np.floor(x / check) + np.floor(y / check)) % 2).astype(np.float32)
        field_ = cells * (35 + 25 * amplitude)
    elif scene.background == "texture":  # per-pixel noise, +-(25..40)
        field_ = (rng.random((size, size), dtype=np.float32) * 2 - 1) * (25 + 15 * amplitude)
    else:
        raise ValueError(f"unknown background {scene.background!r}")
    grain = rng.random((size, size), dtype=np.float32) * 8 - 4  # fine luminance grain, +-4
    return (field_ + grain)[:, :, None] + base  # broadcasts ramps and stripes to (S, S, 3)


def _coverage(mask: np.ndarray, h: int, w: int) -> np.ndarray:
    """(h*2, w*2) bool sub-pixel mask -> (h, w, 1) float32 fraction covered."""
    counts = mask.reshape(h, _SUPERSAMPLE, w, _SUPERSAMPLE).sum((1, 3), dtype=np.float32)
    return counts[:, :, None] * np.float32(1.0 / _SUPERSAMPLE**2)


def _draw(image: np.ndarray, obj: SceneObject) -> None:
    """Composite `obj` into `image` (S, S, 3) float32 in place, with 2x2 supersampled coverage."""
    size = image.shape[0]
    radius = obj.diameter / 2
    reach = radius * 1.15  # unit shapes fit in [-1, 1]^2; rotation adds a little
    x0, x1 = max(int(math.floor(obj.x - reach)), 0), min(int(math.ceil(obj.x + reach)), size)
    y0, y1 = max(int(math.floor(obj.y - reach)), 0), min(int(math.ceil(obj.y + reach)), size)
    if x1 <= x0 or y1 <= y0:
        return
    step = 1.0 / _SUPERSAMPLE
    xs = (np.arange(x0 * _SUPERSAMPLE, x1 * _SUPERSAMPLE, dtype=np.float32) + 0.5) * step - obj.x  # (w*2,)
    ys = (np.arange(y0 * _SUPERSAMPLE, y1 * _SUPERSAMPLE, dtype=np.float32) + 0.5) * step - obj.y  # (h*2,)
    cos, sin = math.cos(math.radians(obj.rotation)) / radius, math.sin(math.radians(obj.rotation)) / radius
    u = xs[None, :] * cos + ys[:, None] * sin  # (h*2, w*2) rotated, unit-scaled
    v = ys[:, None] * cos - xs[None, :] * sin
    mask = _shape_mask(obj.shape, u, v)
    if obj.style == "outline":
        mask &= ~_shape_mask(obj.shape, u / _OUTLINE_INNER, v / _OUTLINE_INNER)
    h, w = y1 - y0, x1 - x0
    rgb = np.array(obj.rgb, np.float32)
    patch = image[y0:y1, x0:x1]
    if obj.style == "striped":  # alternate the colour and a darker shade in diagonal bands
        light = mask & (np.mod(u + v, 0.6) < 0.3)
        dark = mask & ~light
        a_light, a_dark = _coverage(light, h, w), _coverage(dark, h, w)
        patch *= 1 - a_light - a_dark
        patch += a_light * rgb + a_dark * (rgb * _STRIPE_DARKEN)
        return
    alpha = _coverage(mask, h, w)  # (h, w, 1)
    patch *= 1 - alpha
    patch += alpha * rgb


def render_scene(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    """Render a scene to a uint8 image (S, S, 3); `rng` supplies the background texture only."""
    image = _background(scene, rng)  # (S, S, 3) float32, a fresh array
    for obj in scene.objects:
        _draw(image, obj)
    image += 0.5  # round, not truncate
    return np.clip(image, 0, 255, out=image).astype(np.uint8)


def object_coverage(obj: SceneObject, image_size: int) -> np.ndarray:
    """(S, S) float32 in [0, 1]: the fraction of each pixel `obj` covers (for checks and analyses)."""
    canvas = np.zeros((image_size, image_size, 3), np.float32)
    _draw(canvas, replace(obj, rgb=(255, 255, 255), style="filled"))
    return canvas[:, :, 0] / 255.0
