"""The CLIP model and its towers (clip, vision, text, transformer, pooling). Imports core and config (the model's
settings), nothing above."""
