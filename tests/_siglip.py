"""A tiny transformers SiglipModel for the SigLIP and SigLIP 2 import tests: two layers of width 32 in each tower,
32 px images of 8 px patches, every weight random (transformers starts biases and the probe's head at zero)."""
import torch


def save_tiny_siglip(folder, vocab_size: int, context: int) -> None:
    """transformers' SiglipModel of `vocab_size` tokens and `context` positions, saved into `folder`."""
    import transformers

    config = transformers.SiglipConfig(
        text_config={"vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 74, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "max_position_embeddings": context},
        vision_config={"hidden_size": 32, "intermediate_size": 74, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "image_size": 32, "patch_size": 8})
    torch.manual_seed(0)
    model = transformers.SiglipModel(config).eval()
    with torch.no_grad():  # make every weight count
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(folder)
