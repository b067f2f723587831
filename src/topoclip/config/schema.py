"""The configuration's schema: one dataclass per section (model, train, data, evaluate) and the whole Config.

The towers and the model read only these. Range checks are in `topoclip.config.checks`, loading presets
and overrides in `topoclip.config.loading`; `topoclip.config` gathers all three.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from topoclip.data.scenes.config import SceneConfig
from topoclip.core.errors import ConfigError  # noqa: F401  (topoclip.config exports it)
from topoclip.core.geometry import TOPOLOGIES


# --------------------------------------------------------------------------- model


# The template modes of zero-shot classification (topoclip.run.evaluation.zeroshot): whose averaging each is;
# "flat" needs a topology with a flat form.
TEMPLATE_MODES = {"distance": "the paper's", "embedding": "CLIP's", "flat": "CLIP_benchmark's"}


@dataclass(frozen=True)
class VisionConfig:
    """ViT image tower (pre-norm by default, as the reference release)."""

    image_size: int = 224
    patch_size: int = 16
    width: int = 768
    layers: int = 12
    heads: int = 12
    mlp_ratio: float = 4.0
    activation: Literal["gelu", "quick_gelu", "gelu_tanh"] = "gelu"
    norm_first: bool = True
    # ε of every LayerNorm of the tower: torch's and OpenAI's 1e-5; SigLIP's (big_vision's) 1e-6.
    layer_norm_eps: float = 1e-5
    # How the m output tokens are made (topoclip.model.vision): "class_tokens" prepends m learned tokens (ViT, CLIP);
    # "attention" has no class token and pools the patches with m learned queries (SigLIP's attention-pooling head,
    # one query a token).
    pooling: Literal["class_tokens", "attention"] = "class_tokens"
    patch_bias: bool = False  # a bias in the patch embedding (SigLIP's; CLIP's has none)
    pre_norm: bool = True  # the LayerNorm before the blocks (CLIP's ln_pre; SigLIP has none)
    # Normalisation of input pixels (OpenAI CLIP's statistics).
    mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    # Evaluation geometry (topoclip.preprocess.transforms.eval_transform): "crop-box" resizes the centred crop box in
    # one step; "shortest" is OpenCLIP's Resize(shorter side) then CenterCrop, PIL's own two steps, which
    # imported OpenAI / OpenCLIP models use so their published zero-shot numbers reproduce; "squash" resizes the
    # whole image to image_size × image_size, no crop (SigLIP's).
    eval_resize: Literal["crop-box", "shortest", "squash"] = "crop-box"


@dataclass(frozen=True)
class TextConfig:
    """BERT-style bidirectional text tower (post-norm with an embedding LayerNorm by default)."""

    vocab_size: int = 30522
    context_length: int = 77
    width: int = 512
    layers: int = 12
    heads: int = 8
    mlp_ratio: float = 4.0
    activation: Literal["gelu", "quick_gelu", "gelu_tanh"] = "gelu"
    norm_first: bool = False
    embedding_norm: bool = True
    layer_norm_eps: float = 1e-5  # as model.vision.layer_norm_eps
    projection_bias: bool = False  # a bias after the text projection (SigLIP's text head)
    # The m class tokens are this id repeated m times; the tokenizer's [CLS] ([CLS] = 101 in BERT
    # vocabularies, 2 in vocabularies topoclip trains).
    cls_token_id: int = 101
    # OpenAI CLIP's text tower is "causal" (each token attends to itself and earlier ones) and
    # pooled at its end-of-text token; SigLIP's reads the last position of the padded text ("last"); see
    # topoclip.model.pooling for the layouts of the m tokens.
    attention: Literal["bidirectional", "causal"] = "bidirectional"
    pooling: Literal["class_tokens", "end_of_text", "last"] = "class_tokens"
    # pooling=end_of_text reads the first token of this id (the tokenizer's end token: [SEP] in a WordPiece
    # vocabulary); None reads the largest id of the text, OpenAI's end-of-text (its vocabulary numbers it last).
    end_token_id: Optional[int] = None


@dataclass(frozen=True)
class TemperatureConfig:
    """τ = exp(t): init is t; max_scale clamps τ after each step; SigLIP's bias is optional."""

    init: float = 2.659
    max_scale: float = 100.0
    learnable: bool = True
    bias_init: Optional[float] = None


@dataclass(frozen=True)
class CurvatureConfig:
    """The hyperbolic topologies' curvature −c (MERU): c starts at init and, when learnable, is clamped after each step
    to [init/10, 10·init]. The spheres and Euclidean space ignore it."""

    init: float = 1.0
    learnable: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """A CLIP with `class_tokens` class tokens per tower, each projected to `embed_dim`.

    The (class_tokens · embed_dim) outputs are read as `spheres` rows of
    n = class_tokens · embed_dim / spheres: Multi(32, 16) is class_tokens=16, embed_dim=32,
    spheres=16; the single-token Ob(64, 8) is class_tokens=1, embed_dim=512, spheres=8.
    `spheres` 0 means one per class token (and 1 for sphere, euclidean and lorentz, whose space is not a
    product); for lorentz-product it counts hyperboloids.
    """

    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    temperature: TemperatureConfig = field(default_factory=TemperatureConfig)
    curvature: CurvatureConfig = field(default_factory=CurvatureConfig)
    topology: str = "ps-inner"
    class_tokens: int = 1
    embed_dim: int = 512
    spheres: int = 0

    @property
    def sphere_count(self) -> int:
        """m: the number of rows of an embedding."""
        if self.spheres:
            return self.spheres
        return self.class_tokens if TOPOLOGIES[self.topology].product else 1

    @property
    def sphere_dim(self) -> int:
        """n: the dimension of each row."""
        return self.class_tokens * self.embed_dim // self.sphere_count


# --------------------------------------------------------------------------- training


# What LoRA can adapt in each block (topoclip.model.lora): the packed q/k/v projection, a parameter, and three layers.
LORA_TARGETS = ("attn.in_proj_weight", "attn.out_proj", "mlp.c_fc", "mlp.c_proj")
LORA_TOWERS = ("image", "text")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation recipe (paper Table 5) and run mechanics."""

    batch_size: int = 256
    steps: int = 1000
    lr: float = 5e-4
    weight_decay: float = 0.2
    warmup_steps: int = 100
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clip; 0 turns it off
    # topoclip.core.losses: InfoNCE and SigLIP's sigmoid (with τ), and the metric-learning losses without τ.
    loss: Literal["infonce", "sigmoid", "contrastive", "triplet", "max-hinge", "n-pair"] = "infonce"
    # The margin ε of contrastive / triplet / max-hinge, in similarity units; with margin_relative, in units of
    # the half-width of the topology's similarity range (the same margin relative to each range: ×m on ps-inner).
    margin: float = 0.2
    margin_relative: bool = False
    # max-hinge only: its first N steps use the triplet loss (the sum of hinges; VSE∞'s --vse_mean_warmup_epochs).
    # From random towers the hardest negative alone collapses (the loss settles at 2ε; docs/results, losses).
    max_hinge_warmup_steps: int = 0
    # MERU's entailment loss (a caption's cone holds its image), added with this weight; hyperbolic topologies only.
    # MERU trains with 0.2.
    entailment_weight: float = 0.0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    seed: int = 0
    device: str = "auto"  # "auto" = cuda if available else cpu
    threads: int = 0  # torch intra-op threads on CPU; 0 keeps torch's default
    accumulation_steps: int = 1  # exact contrastive gradient accumulation (micro-batches per step)
    gradient_checkpointing: bool = False
    compile: bool = False
    # How the processes torchrun starts share the model: "ddp" keeps a whole copy on each; "fsdp" shards weights,
    # gradients and AdamW moments over them (PyTorch's FSDP2, per transformer block; topoclip.run.training.sharding).
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    # fp32 matrix products on CUDA in TF32 (OpenCLIP's trainer does the same); false: bit-level fp32.
    allow_tf32: bool = True
    # torch's fused AdamW kernel where it exists (CUDA): one kernel for all weights, and a step skipped
    # for a non-finite loss without the host waiting for the GPU. Ignored on CPU.
    fused_optimizer: bool = True
    # DataLoader worker processes per training process (OpenCLIP's --workers); "auto": this process's share of the CPUs
    # it may run on, one core left for itself (topoclip.run.training.data.loader_workers).
    num_workers: Union[int, Literal["auto"]] = 2
    log_every: int = 10
    eval_every: int = 0  # steps between evaluations; 0 = only at the end
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    # A checkpoint whose weights and tokenizer start the run (`topoclip train --init-from`); its model
    # must match this one (topoclip.run.training.init_from). "" = random initialisation.
    init_from: str = ""
    # Locked towers (LiT), as OpenCLIP's --lock-image, --lock-image-unlocked-groups, --lock-text and
    # --lock-text-unlocked-layers: a locked tower's parameters are not trained, except its last N groups
    # (topoclip.run.training.lock: embeddings, one group per block, the projection).
    lock_image: bool = False
    lock_image_unlocked_groups: int = 0
    lock_text: bool = False
    lock_text_unlocked_layers: int = 0
    # LoRA through peft (`pip install "topoclip[lora]"`): lora_rank > 0 trains low-rank adapters on lora_targets
    # of every block of the lora_towers instead of those towers (their own weights frozen; τ trains as ever).
    # A checkpoint's model.safetensors is the merged model, which every reader loads as any other; peft's adapters
    # are beside it in lora/ (topoclip.model.lora).
    lora_rank: int = 0
    lora_alpha: float = 16.0  # the adapters' product is scaled by lora_alpha / lora_rank (peft's lora_alpha)
    lora_dropout: float = 0.0  # dropout on an adapter's input (peft's lora_dropout)
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    lora_towers: list[str] = field(default_factory=lambda: list(LORA_TOWERS))
    # Where the scalars, the config and the final evaluation table also go: "tensorboard" (when installed)
    # and/or "wandb" (must be installed); metrics.jsonl and the plots are always written.
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class DataConfig:
    """Where training pairs come from: the built-in scenes, a CSV/TSV, WebDataset shards or a Hugging Face dataset."""

    source: str = "scenes"  # a name in topoclip.data.sources.SOURCES
    scenes: SceneConfig = field(default_factory=SceneConfig)
    # csv: the CSV/TSV path; shards: brace patterns, several sources joined by "::"
    # (e.g. "web/{00000..00099}.tar::cc/{000..009}.tar").
    train_data: str = ""
    weights: list[float] = field(default_factory=list)  # one per "::" source; needs resampled
    csv_image_key: str = "filepath"
    csv_caption_key: str = "title"
    csv_separator: str = ""  # "" = tab for .tsv, comma otherwise
    # CSV image paths must lie inside the CSV's folder; true also reads absolute paths and "../" ones
    # (refused by default and counted as path_outside_root: a table should not reach other files).
    csv_allow_outside_paths: bool = False
    # hf (a Hugging Face datasets folder, or Parquet / Arrow files): the image column (an Image feature, bytes or
    # paths), the caption column (text, or lists of texts: the first), and a DatasetDict's split.
    hf_image_column: str = "image"
    hf_caption_column: str = "text"
    hf_split: str = "train"
    resampled: bool = False  # shards drawn with replacement (endless stream; needs samples_per_epoch)
    samples_per_epoch: int = 0  # shards: fixed epoch length (0 = one pass over the shards)
    shuffle_buffer: int = 1000
    max_bad_fraction: float = 0.01  # stop when skipped samples exceed this share of those seen
    # "" = train a WordPiece vocabulary of model.text.vocab_size on the training captions;
    # else a BERT vocab.txt or a tokenizer.json.
    tokenizer: str = ""
    # RandomResizedCrop's area fraction. OpenCLIP's training transform uses (0.9, 1.0) (its
    # AugmentationCfg scale); data.augment_scale=[0.9,1.0] matches it.
    augment_scale: tuple[float, float] = (0.8, 1.0)


@dataclass(frozen=True)
class EvaluateConfig:
    """What is evaluated during and after training (and by `topoclip eval`)."""

    template_modes: list[str] = field(default_factory=lambda: ["distance", "embedding"])
    size: int = 1000  # images per built-in evaluation set (scenes), final evaluation
    validation_size: int = 200  # the same for the periodic evaluations during training (train.eval_every)
    captions_per_image: int = 5
    # The user's own sets: class folders, "imagenet1k=PATH" (or cifar10 / cifar100: the benchmark's names and
    # templates), or CLIP_benchmark WebDataset folders; see topoclip.run.evaluation.benchmarks.
    classification: list[str] = field(default_factory=list)
    # Karpathy-layout caption JSON files, caption tables (.csv/.tsv: data.csv_* columns), CLIP_benchmark folders
    retrieval: list[str] = field(default_factory=list)
    batch_size: int = 256
    # DataLoader workers decoding the images of a set read from disk (in-memory sets, as the scenes, take none).
    num_workers: int = 2


# --------------------------------------------------------------------------- top level


@dataclass(frozen=True)
class Config:
    """Everything a run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    name: str = ""
