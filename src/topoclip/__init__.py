"""topoclip: CLIP-style image-text models whose embedding topology is a setting.

The library (model, geometry, losses, tokenizer, data, evaluation) imports without the trainer;
`topoclip.train` loads the trainer on first use.
"""
from topoclip.config import Config, ConfigError, ModelConfig, load_config, presets
from topoclip.geometry import TOPOLOGIES, similarity, to_space
from topoclip.losses import LOSSES, infonce_loss, sigmoid_loss
from topoclip.model import CLIP, CLIPOutput, build_model
from topoclip.temperature import Temperature

__version__ = "0.1.0"


def __getattr__(name):
    # Heavy or optional parts are imported on first use, so `import topoclip` stays light.
    if name in ("Tokenizer", "TextBatch"):
        from topoclip import tokenizer

        return getattr(tokenizer, name)
    if name == "train":
        from topoclip.training.trainer import train

        return train
    if name == "evaluate":
        from topoclip.evaluation.run import evaluate

        return evaluate
    raise AttributeError(f"module 'topoclip' has no attribute {name!r}")
