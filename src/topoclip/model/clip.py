"""The CLIP model: two towers with m class tokens, a topology, a temperature (and, hyperbolic, a curvature).

``model(images, text)`` returns a :class:`CLIPOutput` whose embeddings already lie on the chosen
space (B, m, n); ``model.similarity(u, v)`` scores them (fp32, chunked, = −distance).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from topoclip.core import geometry
from topoclip.config import Config, ConfigError, ModelConfig, load_config, validate_model
from topoclip.core.curvature import Curvature
from topoclip.core.temperature import Temperature
from topoclip.model.text import TextTransformer
from topoclip.model.vision import VisionTransformer


@dataclass
class CLIPOutput:
    """What the model returns, always with these fields."""

    image_embeds: Optional[torch.Tensor]  # (B, m, n) on the space, fp32; None if no images given
    text_embeds: Optional[torch.Tensor]  # (B, m, n) on the space, fp32; None if no text given
    scale: torch.Tensor  # τ = exp(t), 0-d fp32
    bias: Optional[torch.Tensor]  # SigLIP β (0-d) or None
    curvature: Optional[torch.Tensor] = None  # a hyperbolic model's c (0-d fp32), None for the other spaces


# The most parameters a model may have: 2^34 fp32 numbers are 64 GiB, about five times ViT-bigG/14 with its text
# tower. Each size has its own bound in topoclip.config; this bounds them together (width × layers, patches × width).
MAX_PARAMETERS = 2**34


def parameter_count(config: ModelConfig) -> int:
    """The number of parameters CLIP(config) has, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return sum(parameter.numel() for parameter in CLIP(config).parameters())


class CLIP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        validate_model(config)
        if torch.empty(()).device.type != "meta":  # counted on the meta device first: refused before it is allocated
            count = parameter_count(config)
            if count > MAX_PARAMETERS:
                raise ConfigError(f"the model has {count:,} parameters ({count * 4 / 2**30:,.0f} GiB in fp32), over the "
                                  f"{MAX_PARAMETERS:,} topoclip builds; lower model.vision/text width or layers")
        self.config = config
        self.visual = VisionTransformer(config.vision, config.class_tokens, config.embed_dim)
        self.text = TextTransformer(config.text, config.class_tokens, config.embed_dim)
        t = config.temperature
        self.temperature = Temperature(t.init, t.max_scale, t.learnable, t.bias_init)
        # The hyperbolic topologies' curvature and tower scalings (MERU); the other spaces have none.
        self.curvature = None
        if geometry.get_topology(config.topology).curved:
            c = config.curvature
            self.curvature = Curvature(c.init, config.class_tokens * config.embed_dim, c.learnable)

    @property
    def embedding_shape(self) -> tuple[int, int]:
        """(m, n) of one embedding."""
        return self.config.sphere_count, self.config.sphere_dim

    @property
    def curvature_value(self) -> Optional[torch.Tensor]:
        """c (0-d fp32) of a hyperbolic model, None for the others: what `geometry`'s functions take as curvature."""
        return None if self.curvature is None else self.curvature.curvature

    def project(self, raw: torch.Tensor, tower: str) -> torch.Tensor:
        """A tower's raw output (B, class_tokens, embed_dim) -> (B, m, n) on the space. The single-token product
        sphere reshapes one d-vector into m rows; the multi-token one keeps a row per class token. A hyperbolic
        model scales it by the tower's α first ("image" or "text")."""
        raw = raw.reshape(raw.shape[0], *self.embedding_shape)
        if self.curvature is None:
            return geometry.to_space(self.config.topology, raw)
        # α in fp32 (raw may be fp16 under autocast): its gradient sums over every coordinate, which fp16 overflows
        return geometry.to_space(self.config.topology, geometry.fp32_or_wider(raw) * self.curvature.scale(tower),
                                 self.curvature.curvature)

    def encode_image(self, images: torch.Tensor, flat: bool = False) -> torch.Tensor:
        """images (B, 3, H, W) normalised -> (B, m, n) on the space; flat: (B, m·n), see `flatten`."""
        points = self.project(self.visual(images), "image")
        return self.flatten(points) if flat else points

    def encode_text(self, text, attention_mask: Optional[torch.Tensor] = None, flat: bool = False) -> torch.Tensor:
        """A TextBatch (or ids (B, L) and mask (B, L)) -> (B, m, n) on the space; flat: (B, m·n), see `flatten`."""
        if hasattr(text, "input_ids"):
            text, attention_mask = text.input_ids, text.attention_mask
        points = self.project(self.text(text, attention_mask), "text")
        return self.flatten(points) if flat else points

    def flatten(self, points: torch.Tensor) -> torch.Tensor:
        """(B, m, n) points -> (B, m·n) vectors whose inner product is `similarity` (sphere and ps-inner; the
        other topologies raise a ValueError saying why): what an inner-product index or CLIP-style code needs.
        (A lorentz model's index takes `geometry.lorentz_index_vectors` instead.)"""
        return geometry.flatten(self.config.topology, points)

    def forward(self, images: Optional[torch.Tensor] = None, text=None) -> CLIPOutput:
        return CLIPOutput(
            image_embeds=None if images is None else self.encode_image(images),
            text_embeds=None if text is None else self.encode_text(text),
            scale=self.temperature.scale,
            bias=self.temperature.bias,
            curvature=self.curvature_value,
        )

    def similarity(self, u: torch.Tensor, v: torch.Tensor, chunk_size: Optional[int] = None,
                   curvature: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(Bu, m, n), (Bv, m, n) -> (Bu, Bv) fp32 similarities s = −d(u, v) of the model's topology. curvature: the c
        to score with (the training step's, detached where it must count once), else the model's own."""
        return geometry.similarity(self.config.topology, u, v, chunk_size,
                                   self.curvature_value if curvature is None else curvature)

    def entailment(self, text: torch.Tensor, images: torch.Tensor, curvature: Optional[torch.Tensor] = None) -> torch.Tensor:
        """MERU's entailment loss of paired embeddings (B, m, n): each caption's cone should hold its image. 0-d fp32;
        a ValueError for the spaces without cones. curvature: as for `similarity`."""
        return geometry.entailment(self.config.topology, text, images,
                                   self.curvature_value if curvature is None else curvature)

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each transformer block in backward (saves activation memory)."""
        self.visual.transformer.gradient_checkpointing = enabled
        self.text.transformer.gradient_checkpointing = enabled


def build_model(spec: Union[str, Config, ModelConfig], overrides: Optional[list[str]] = None) -> CLIP:
    """A CLIP from a preset name, a Config or a ModelConfig (`overrides` like "model.class_tokens=16")."""
    if isinstance(spec, str):
        spec = load_config(spec, overrides)
    elif overrides:
        raise ValueError("overrides apply to preset names; edit the config object directly")
    return CLIP(spec.model if isinstance(spec, Config) else spec)


def describe_model(model: ModelConfig) -> str:
    """"Sphere(128)", "Euclidean R^128", "PS(16,8)", "PS(16,8) geodesic", "Multi(16,8)"."""
    topology = geometry.get_topology(model.topology)
    several = model.class_tokens > 1
    label = topology.label.format(d=model.class_tokens * model.embed_dim, n=model.sphere_dim, m=model.sphere_count,
                                  kind="Multi" if several else "PS")
    return label + (f", {model.class_tokens} tokens" if several and not topology.product else "")
