"""What runs a model: training (training/), evaluation (evaluation/), inference (topoclip.load), embedding a data set,
CLIP_benchmark's wrapper and the Hub push. Imports every layer below it; nothing below imports it."""
