"""Export the image and text encoders to ONNX, to serve a model without PyTorch.

    DST/
      image_encoder.onnx   images (B, 3, H, W) float32, normalised -> embeddings (B, m, n)
      text_encoder.onnx    input_ids (B, L) int64, attention_mask (B, L) int64 -> embeddings (B, m, n)
      topoclip_config.json the model's config (image size, pixel mean/std, topology, m, n)
      tokenizer.json       the tokenizer (HF `tokenizers` can run it: it pads/truncates to L itself)

The batch size B is dynamic; L is the model's context length (the tokenizer always pads to it).
Embeddings are already on the model's space, so a similarity is one line of NumPy: for sphere and
ps-inner, ``s = u.reshape(B, -1) @ v.reshape(B2, -1).T``. A hyperbolic model's encoders give the space
components of its points and carry its learned curvature in their metadata ("topoclip.curvature", with
"topoclip.topology"; onnxruntime's ``get_modelmeta().custom_metadata_map``). With ``check`` (onnxruntime installed)
the export is run on a batch of random inputs of another size and compared with PyTorch; the
report gives the max abs difference. Export uses torch's TorchScript-based exporter (seconds on a
CPU; the torch.export-based one takes ~10× longer here), or the torch.export one where torch no
longer has it.
"""
from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from topoclip.io.checkpoint import MODEL_CONFIG, TOKENIZER
from topoclip.config import Config, to_dict
from topoclip.io.convert import check_destination
from topoclip.io.convert.files import new_folder
from topoclip.core.errors import UserError
from topoclip.core.geometry import require_flat
from topoclip.model.clip import CLIP

IMAGE_FILE, TEXT_FILE = "image_encoder.onnx", "text_encoder.onnx"
OPSET = 17


class ImageEncoder(nn.Module):
    """images (B, 3, H, W) -> (B, m, n) on the space, or (B, m·n) flat."""

    def __init__(self, model: CLIP, flat: bool = False):
        super().__init__()
        self.model, self.flat = model, flat

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(images, flat=self.flat)


class TextEncoder(nn.Module):
    """input_ids (B, L), attention_mask (B, L) integers -> (B, m, n) on the space, or (B, m·n) flat; no padding
    trimmed."""

    def __init__(self, model: CLIP, flat: bool = False):
        super().__init__()
        self.model, self.flat = model, flat

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # Padding reads as id 0. It changes nothing (padding is masked, or follows the pooled token in a
        # causal tower), but keeps attention_mask an input of every export: a causal tower needs no key mask.
        # A tower that attends its padding (SigLIP's, pooled at the last position) reads every id as it is (the
        # mask, ≥ 0 throughout, multiplies by 1: it stays the graph's input).
        kept = attention_mask.ge(0) if self.model.text.pooling.attends_padding else attention_mask
        input_ids = input_ids * kept.to(input_ids.dtype)
        raw = self.model.text.encode_tokens(input_ids, attention_mask.bool())  # (B, class tokens, embed_dim)
        points = self.model.project(raw, "text")
        return self.model.flatten(points) if self.flat else points


def geometry_metadata(model: CLIP) -> dict[str, str]:
    """What a server needs beside a hyperbolic model's points to score them: its topology and learned curvature c (the
    distance is arcosh(−c⟨u, v⟩_L)/√c, the time component t = sqrt(1/c + ‖x‖²); topoclip.core.geometry)."""
    return {"topoclip.topology": model.config.topology, "topoclip.curvature": repr(model.curvature_value.item())}


def _stamp(path: Path, metadata: dict[str, str]) -> None:
    """Add `metadata` to the ONNX file's metadata_props (onnxruntime: session.get_modelmeta().custom_metadata_map)."""
    import onnx

    proto = onnx.load(str(path))
    for key, value in metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, str(path))


def _sinh(g, x):
    """aten::sinh as ONNX's Sinh (opset 9 on), which torch's TorchScript exporter does not map itself."""
    return g.op("Sinh", x)


def _export(module: nn.Module, inputs: tuple, names: list[str], path: Path) -> None:
    dynamic = {name: {0: "batch"} for name in names + ["embeddings"]}
    try:
        if hasattr(torch.onnx, "register_custom_op_symbolic"):  # the hyperbolic exponential map's sinh
            torch.onnx.register_custom_op_symbolic("aten::sinh", _sinh, OPSET)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
            torch.onnx.export(module, inputs, str(path), input_names=names, output_names=["embeddings"],
                              dynamic_axes=dynamic, opset_version=OPSET, dynamo=False)
    except (TypeError, RuntimeError) as error:
        if "dynamo" not in str(error) and "TorchScript" not in str(error):
            raise
        from torch.export import Dim

        batch = Dim("batch")
        torch.onnx.export(module, inputs, str(path), input_names=names, output_names=["embeddings"],
                          dynamic_shapes=[{0: batch} for _ in inputs], opset_version=OPSET)


def example_inputs(config: Config, batch: int, generator: Optional[torch.Generator] = None) -> dict:
    """Random inputs of batch size `batch`: images (B, 3, H, W), ids (B, L), mask (B, L) with padding."""
    model, text = config.model, config.model.text
    size, length = model.vision.image_size, text.context_length
    images = torch.randn(batch, 3, size, size, generator=generator)
    lengths = torch.randint(2, length + 1, (batch, 1), generator=generator)
    mask = torch.arange(length)[None] < lengths  # (B, L) real tokens first
    ids = torch.randint(1, text.vocab_size - 1, (batch, length), generator=generator)
    ids[:, 0] = text.cls_token_id
    ids = ids.masked_fill(~mask, 0)
    # The end-of-text token (the largest id, OpenAI's layout) closes every text.
    ids[torch.arange(batch), lengths[:, 0] - 1] = text.vocab_size - 1
    return {"images": images, "input_ids": ids, "attention_mask": mask.long()}


def export_onnx(model: CLIP, config: Config, tokenizer, destination: Union[str, Path], check: bool = True,
                flat: bool = False) -> str:
    """Write the ONNX encoders, topoclip_config.json and tokenizer.json into `destination` (new or empty).

    flat: the encoders output (B, m·n) vectors whose inner product is the model's similarity (sphere and
    ps-inner; UserError for the other topologies), for an inner-product index.

    Returns a report; with `check`, onnxruntime runs both encoders on a batch of another size than
    the one exported with and the report gives the max abs difference from PyTorch.
    """
    check_destination(destination)
    if importlib.util.find_spec("onnx") is None:  # torch.onnx.export writes through it
        raise UserError("ONNX export needs the onnx package: pip install 'topoclip[onnx]'")
    model = model.float().cpu().eval()
    if flat:
        try:
            require_flat(config.model.topology)
        except ValueError as error:
            raise UserError(f"--flat: {error}") from None
    inputs = example_inputs(config, 2, torch.Generator().manual_seed(0))
    report = f"wrote {destination}: {IMAGE_FILE}, {TEXT_FILE}, {MODEL_CONFIG}" + (", tokenizer.json" if tokenizer else "")
    with new_folder(destination, "the ONNX encoders") as folder, torch.no_grad():
        _export(ImageEncoder(model, flat), (inputs["images"],), ["images"], folder / IMAGE_FILE)
        _export(TextEncoder(model, flat), (inputs["input_ids"], inputs["attention_mask"]),
                ["input_ids", "attention_mask"], folder / TEXT_FILE)
        if model.curvature is not None:  # a hyperbolic model's points need its learned c to be scored
            for file in (IMAGE_FILE, TEXT_FILE):
                _stamp(folder / file, geometry_metadata(model))
        (folder / MODEL_CONFIG).write_text(json.dumps(to_dict(config), indent=2))
        if tokenizer is not None:
            tokenizer.save(folder / TOKENIZER)
        if check:  # before the files take their place: a failed check leaves nothing behind
            differences = compare_with_pytorch(model, config, folder)
            report += "\nonnxruntime vs PyTorch, max abs difference (batch of 3): " + ", ".join(
                f"{name} {value:.2e}" for name, value in differences.items())
    return report


def compare_with_pytorch(model: CLIP, config: Config, folder: Union[str, Path], batch: int = 3) -> dict[str, float]:
    """{"image": max |ONNX − PyTorch|, "text": ...} on random inputs, with onnxruntime on the CPU."""
    try:
        import onnxruntime
    except ImportError:
        raise UserError("checking the export needs onnxruntime: pip install 'topoclip[onnx]' (or pass --no-check)") from None
    folder = Path(folder)
    inputs = example_inputs(config, batch, torch.Generator().manual_seed(1))
    model = model.float().cpu().eval()
    with torch.no_grad():
        expected = {"image": model.encode_image(inputs["images"]),
                    "text": model.encode_text(inputs["input_ids"], inputs["attention_mask"].bool())}
    feeds = {"image": {"images": inputs["images"].numpy()},
             "text": {"input_ids": inputs["input_ids"].numpy(), "attention_mask": inputs["attention_mask"].numpy()}}
    differences = {}
    for name, file in (("image", IMAGE_FILE), ("text", TEXT_FILE)):
        session = onnxruntime.InferenceSession(str(folder / file), providers=["CPUExecutionProvider"])
        got = torch.from_numpy(session.run(None, feeds[name])[0]).reshape(expected[name].shape)  # (B, m·n) if flat
        differences[name] = float((got - expected[name]).abs().max())
    return differences
