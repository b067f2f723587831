"""topoclip: CLIP-style image-text models whose embedding topology is a setting.

The library (model, geometry, losses, tokenizer, data, evaluation) imports without the trainer;
`topoclip.train`, `topoclip.evaluate` and `topoclip.load` (a trained or converted model with its
tokenizer and image transform) load their modules on first use; `topoclip.io.convert` imports
foreign checkpoints.
"""
from topoclip.config import Config, ConfigError, ModelConfig, load_config, presets
from topoclip.core.geometry import TOPOLOGIES, similarity, to_space
from topoclip.core.losses import LOSSES, infonce_loss, sigmoid_loss
from topoclip.model.clip import CLIP, CLIPOutput, build_model
from topoclip.core.temperature import Temperature
from topoclip.preprocess.tokenizer import TextBatch, Tokenizer

__version__ = "0.1.0"

__all__ = [
    "CLIP", "CLIPOutput", "Config", "ConfigError", "LOSSES", "ModelConfig", "Pretrained", "TOPOLOGIES", "Temperature",
    "TextBatch", "Tokenizer", "build_model", "evaluate", "infonce_loss", "load", "load_config", "presets",
    "sigmoid_loss", "similarity", "to_space", "train",
]


def __getattr__(name):
    # The trainer and the evaluation runner are imported on first use: `import topoclip` stays light.
    if name == "train":
        from topoclip.run.training.trainer import train

        return train
    if name == "evaluate":
        from topoclip.run.evaluation.run import evaluate

        return evaluate
    if name in ("load", "Pretrained"):
        from topoclip.run import inference

        return getattr(inference, name)
    raise AttributeError(f"module 'topoclip' has no attribute {name!r}")
