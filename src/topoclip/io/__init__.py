"""Models and runs on disk: checkpoints, run folders, conversions from and to other formats (convert/), pretrained
models by name, ONNX export. Imports core, preprocess, config and model; never run, analysis, experiments or cli."""
