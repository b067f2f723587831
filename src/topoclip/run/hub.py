"""`topoclip push RUN org/name`: a model on the Hugging Face Hub, with a generated model card.

The repository holds the exported layout that `topoclip.load("org/name")` reads (model.safetensors,
topoclip_config.json, tokenizer.json), README.md (the card: topology, config, training data, the
evaluation table of the run's eval.json, the model it was fine-tuned from and how (LoRA), license, how to load),
and, for a model OpenCLIP can express, OpenCLIP's open_clip_config.json + open_clip_model.safetensors, so that
`open_clip.create_model_and_transforms("hf-hub:org/name")` loads it too. Uploading goes through
huggingface_hub (`pip install "topoclip[hub]"`; log in with `hf auth login` or pass a token).
"""
from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from topoclip.core.errors import UserError
from topoclip.io.pretrained import check_repo_id, pretrained_of

CARD = "README.md"


def markdown_table(rows: list[list], columns: list[str]) -> str:
    def cell(value) -> str:
        return f"{value:.1f}" if isinstance(value, float) else ("" if value is None else str(value))

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows])


# The Hub's license identifiers (mit, apache-2.0, cc-by-nc-4.0, other): a letter first, so that YAML reads none of
# them as a number (1.0, 0x10), and none of YAML 1.1's booleans and null, which it would read as those.
LICENSE = re.compile(r"^(?!(?:y|n|yes|no|true|false|on|off|null)$)[A-Za-z][A-Za-z0-9.+-]{0,63}$", re.ASCII | re.IGNORECASE)


# How many fine-tunes back the card looks for the pretrained model a chain of train.init_from starts from.
BASE_MODEL_HOPS = 8


def base_model(config) -> Optional[tuple[Optional[str], Optional[str]]]:
    """The model this one was fine-tuned from, as (pretrained name, its Hub repository) where its chain of
    train.init_from (each folder's own config, as far as the folders are on this machine and named by absolute paths)
    starts at `--pretrained NAME`, (None, None) where it starts at another checkpoint; None for a model trained from
    scratch."""
    from topoclip.io.checkpoint import load_config_from, resolve_checkpoint

    folder, seen = config.train.init_from, set()
    while folder and folder not in seen and len(seen) < BASE_MODEL_HOPS:
        entry = pretrained_of(folder)
        if entry:
            return entry.name, entry.repo
        seen.add(folder)
        if not Path(folder).is_absolute():  # as typed where that run started, a folder this cwd may not be
            break
        try:  # a fine-tune of a fine-tune: the folder's own start
            folder = load_config_from(resolve_checkpoint(Path(folder))).train.init_from
        except (OSError, UserError):  # moved, deleted or damaged since: the chain ends here
            break
    return (None, None) if config.train.init_from else None


def model_card(config, repo_id: str, evaluation: Optional[list], license: str, openclip: bool,
               curvature: Optional[float] = None) -> str:
    """The README.md of a pushed model: front matter for the Hub, then what it is and how to load it; curvature: a
    hyperbolic model's learned c."""
    from topoclip.config import to_dict
    from topoclip.run.evaluation.run import table_rows
    from topoclip.model.clip import describe_model

    model, train = config.model, config.train
    label = describe_model(model)
    base = base_model(config)
    # The Hub's own field for the model a fine-tune starts from; LoRA's adapters are merged into these weights.
    front = [f"base_model: {base[1]}", "base_model_relation: finetune"] if base and base[1] else []
    lines = ["---", f"license: {license}", *front, "library_name: topoclip",
             "pipeline_tag: zero-shot-image-classification", "tags:", "- clip", "- topoclip",
             "- zero-shot-image-classification", "---", "",
             f"# {repo_id.split('/')[-1]}", "",
             f"A CLIP-style image–text model trained with topoclip: "
             f"embeddings on **{label}** (topology `{model.topology}`, {model.class_tokens} class token(s) per "
             f"tower, {model.embed_dim}-dimensional each), similarities scaled by a learned τ"
             + (f"; hyperbolic space of curvature −c, c = {curvature:.6g} ({'learned' if model.curvature.learnable else 'fixed'})"
                if curvature is not None else "") + ".", "",
             "## Training", ""]
    if base:
        name, repo = base
        lines.append(f"- fine-tuned from `{name}` ([{repo}](https://huggingface.co/{repo}))" if name
                     else "- fine-tuned from a local checkpoint (`train.init_from`)")
    if train.lora_rank:
        lines.append(f"- LoRA (peft): rank {train.lora_rank}, alpha {train.lora_alpha:g}, on "
                     f"{', '.join(train.lora_targets)} of the {' and '.join(train.lora_towers)} tower(s), the rest "
                     f"frozen; the adapters are merged into these weights")
    lines += [f"- data: `data.source={config.data.source}`" + (f", `{config.data.train_data}`" if config.data.train_data
                                                               else " (topoclip's built-in data)"),
              f"- {train.steps} steps, batch {train.batch_size}, lr {train.lr:g}, "
              f"loss `{train.loss}`, precision `{train.precision}`", ""]
    if evaluation:
        lines += ["## Evaluation", "", "Zero-shot, from the run's `eval.json` (percent; retrieval: mean of both "
                  "directions).", "", markdown_table(*table_rows(evaluation)), ""]
    lines += ["## Use", "", "```python", "import pathlib", "", "import topoclip", "",
              f'clip = topoclip.load("{repo_id}")',
              'probabilities = clip.classify([pathlib.Path("cat.jpg")], ["cat", "dog"])', "```", ""]
    if openclip:
        lines += ["With OpenCLIP:", "", "```python", "import open_clip", "",
                  f'model, _, preprocess = open_clip.create_model_and_transforms("hf-hub:{repo_id}")',
                  f'tokenizer = open_clip.get_tokenizer("hf-hub:{repo_id}")  # this model\'s own, tokenizer.json',
                  "```", ""]
    lines += ["## Config", "", "<details><summary>topoclip_config.json</summary>", "", "```json",
              json.dumps(to_dict(config)["model"], indent=2), "```", "", "</details>", "",
              "## License", "", f"{license}", ""]
    return "\n".join(lines)


def upload_folder(source, destination: Path, repo_id: str, license: Optional[str] = None) -> Path:
    """Write what `push` uploads into `destination` (new or empty): the exported model, the card, OpenCLIP's files.
    `license` defaults to mit for a model trained from scratch; one fine-tuned from another's weights carries that
    model's license, which topoclip cannot know, so it must be given."""
    from topoclip.io.checkpoint import resolve_checkpoint, save_checkpoint
    from topoclip.io.convert.openclip_export import export_openclip, openclip_refusal, tokenizer_refusal
    from topoclip.run.evaluation.run import read_evaluation
    from topoclip.run.inference import load_folder
    from topoclip.io.run_folder import RunFolder

    check_repo_id(repo_id)
    if license is not None and not LICENSE.match(license):  # it goes into the card's YAML front matter as it is
        raise UserError(f"--license {license!r:.60} is not a license identifier; give one such as mit, apache-2.0, "
                        f"cc-by-4.0 or other")
    loaded = load_folder(Path(source), torch.device("cpu"))
    base = base_model(loaded.config)
    if license is None and base:
        name, repo = base
        raise UserError(f"{source} was fine-tuned from {f'{name} ({repo})' if name else 'another checkpoint (train.init_from)'}"
                        f", whose license governs it: pass --license with that model's (its model card says which, "
                        f"e.g. mit, apache-2.0, cc-by-nc-4.0)")
    license = license or "mit"
    destination = Path(destination)
    save_checkpoint(destination, loaded.model, loaded.config, loaded.tokenizer)
    openclip = not (openclip_refusal(loaded.config) or tokenizer_refusal(loaded.config, loaded.tokenizer))
    if openclip:
        with tempfile.TemporaryDirectory() as temporary:
            exported = export_openclip(loaded.model, loaded.config, Path(temporary) / "openclip", loaded.tokenizer,
                                       tokenizer_name=repo_id)
            for file in exported.iterdir():
                file.replace(destination / file.name)
    evaluation = None
    run = RunFolder(loaded.run_dir or resolve_checkpoint(Path(source)))  # a run's eval.json, or one beside the weights
    if run.evaluation.is_file():
        try:
            evaluation = read_evaluation(run.evaluation)
        except UserError as error:  # the model is still worth its card: said, and the table left out
            print(f"topoclip: note: the model card has no evaluation table: {error}", file=sys.stderr)
    curvature = loaded.model.curvature_value.item() if loaded.model.curvature is not None else None
    (destination / CARD).write_text(model_card(loaded.config, repo_id, evaluation, license, openclip, curvature),
                                    encoding="utf-8")
    return destination


def push(source, repo_id: str, private: bool = False, license: Optional[str] = None, token: Optional[str] = None,
         message: str = "Upload with topoclip push") -> str:
    """Create (or reuse) the Hub repository `repo_id` and upload `source`'s folder with its card; returns its URL."""
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise UserError("pushing to the Hugging Face Hub needs huggingface_hub: pip install 'topoclip[hub]'") from None
    check_repo_id(repo_id)
    with tempfile.TemporaryDirectory() as temporary:
        folder = upload_folder(source, Path(temporary) / "upload", repo_id, license)
        api = HfApi(token=token)
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message=message)
    return str(url)
