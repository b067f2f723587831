"""Pretrained models by name, as OpenCLIP names them (`MODEL:TAG`, its `--model MODEL --pretrained TAG`).

Each name is a Hugging Face Hub repository in transformers' CLIPModel or SiglipModel layout (its weights, config,
tokenizer — BPE merges, SigLIP's spiece.model or SigLIP 2's Gemma tokenizer.json — and pixel statistics side by side; topoclip.io.convert.hf and
.siglip read it) or in OpenCLIP's own (open_clip_config.json and
open_clip_model.safetensors, or its .bin: DFN, DataComp, MetaCLIP; topoclip.io.convert.openai reads it, with OpenAI's
BPE, which OpenCLIP ships in its package, from OPENAI_BPE's merges.txt). `topoclip.load(NAME)`, `topoclip train --pretrained
NAME` and `topoclip pretrained` use this table. The files are fetched on first use into the Hugging Face cache
(HF_HUB_CACHE), where later uses and offline machines (HF_HUB_OFFLINE=1) find them; the model is converted from
them in memory when loaded, and into a topoclip folder under `cache_dir()` when a run starts from it.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from topoclip.core.atomic import scratch_name
from topoclip.io.checkpoint import CONFIG, MODEL_CONFIG, TOKENIZER, WEIGHTS
from topoclip.core.door import escapes, is_regular
from topoclip.core.errors import CheckpointError, UserError

# A Hub repository id as the Hub takes it (huggingface_hub.utils.validate_repo_id): org/name, each part letters,
# digits, "-", "_" and ".", not starting or ending with "-" or ".", no "--" or "..", each part at most 96 characters.
REPO_ID = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9_])?/[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9_])?$",
                     re.ASCII)
# A revision as the Hub names one: a branch or tag ("main", "v1.0", "refs/pr/1") or a commit hash; never "..", which
# would lead out of the cache's refs/ folder.
REVISION = re.compile(r"^(?!.*\.\.)[A-Za-z0-9][\w./-]{0,127}$", re.ASCII)


def check_repo_id(repo_id: str) -> str:
    """`repo_id` when the Hub would take it (see REPO_ID), else UserError saying the form."""
    if not isinstance(repo_id, str) or not REPO_ID.match(repo_id):
        raise UserError(f"{repo_id!r:.100} is not a Hub repository id; give the repository as org/name (or "
                        f"user/name), of letters, digits, '-', '_' and '.' only, e.g. my-org/topoclip-vit-b16")
    return repo_id


def split_revision(repo_id: str, revision: Optional[str]) -> tuple[str, Optional[str]]:
    """("org/name", revision) from "org/name" or "org/name@REV" (the Hub's own spelling), both checked (see REPO_ID,
    REVISION); UserError naming the form otherwise, before anything is asked of the Hub or its cache."""
    if isinstance(repo_id, str) and "@" in repo_id:
        repo_id, _, written = repo_id.partition("@")
        if revision is not None and written != revision:
            raise UserError(f"{repo_id}@{written:.60} names a revision and --revision gives {revision!r:.60}; give one")
        revision = written
    check_repo_id(repo_id)
    if revision is not None and not (isinstance(revision, str) and REVISION.match(revision)):
        raise UserError(f"revision {revision!r:.80} is not a Hub revision; give a branch, tag or commit hash, e.g. main")
    return repo_id, revision


HF_BIN_WEIGHTS = "pytorch_model.bin"  # transformers' older weights file (read with weights_only=True)


@dataclass(frozen=True)
class PretrainedModel:
    name: str  # OpenCLIP's MODEL:TAG
    repo: str  # the Hub repository
    note: str
    # "hf": transformers' CLIPModel or SiglipModel files; "openclip": open_clip_config.json and OpenCLIP's weights
    layout: str = "hf"
    # OpenCLIP's table says QuickGELU (its quick_gelu=True), which open_clip.create_model sets over the repository's
    # open_clip_config.json; so does topoclip.
    quick_gelu: bool = False


OPENAI_BPE = "openai/clip-vit-base-patch32"  # OpenAI's BPE merges, for OpenCLIP's repositories (none carry them)
OPENCLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")  # OpenCLIP's names, preferred first


PRETRAINED = {entry.name: entry for entry in [
    PretrainedModel("ViT-B-32:openai", "openai/clip-vit-base-patch32", "OpenAI's CLIP, WIT-400M"),
    PretrainedModel("ViT-B-16:openai", "openai/clip-vit-base-patch16", "OpenAI's CLIP, WIT-400M"),
    PretrainedModel("ViT-L-14:openai", "openai/clip-vit-large-patch14", "OpenAI's CLIP, WIT-400M"),
    PretrainedModel("ViT-L-14-336:openai", "openai/clip-vit-large-patch14-336", "OpenAI's CLIP at 336 px"),
    PretrainedModel("ViT-B-32:laion2b_s34b_b79k", "laion/CLIP-ViT-B-32-laion2B-s34B-b79K", "OpenCLIP on LAION-2B"),
    PretrainedModel("ViT-B-16:laion2b_s34b_b88k", "laion/CLIP-ViT-B-16-laion2B-s34B-b88K", "OpenCLIP on LAION-2B"),
    PretrainedModel("ViT-L-14:laion2b_s32b_b82k", "laion/CLIP-ViT-L-14-laion2B-s32B-b82K", "OpenCLIP on LAION-2B"),
    PretrainedModel("ViT-H-14:laion2b_s32b_b79k", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "OpenCLIP on LAION-2B"),
    PretrainedModel("ViT-B-32:datacomp_xl_s13b_b90k", "laion/CLIP-ViT-B-32-DataComp.XL-s13B-b90K",
                    "OpenCLIP on DataComp-1B", "openclip"),
    PretrainedModel("ViT-B-16:datacomp_xl_s13b_b90k", "laion/CLIP-ViT-B-16-DataComp.XL-s13B-b90K",
                    "OpenCLIP on DataComp-1B", "openclip"),
    PretrainedModel("ViT-L-14:datacomp_xl_s13b_b90k", "laion/CLIP-ViT-L-14-DataComp.XL-s13B-b90K",
                    "OpenCLIP on DataComp-1B", "openclip"),
    PretrainedModel("ViT-B-16:dfn2b", "apple/DFN2B-CLIP-ViT-B-16", "Apple's DFN-2B", "openclip", quick_gelu=True),
    PretrainedModel("ViT-L-14:dfn2b", "apple/DFN2B-CLIP-ViT-L-14", "Apple's DFN-2B", "openclip", quick_gelu=True),
    PretrainedModel("ViT-B-32:metaclip_fullcc", "timm/vit_base_patch32_clip_224.metaclip_2pt5b",
                    "Meta's MetaCLIP 2.5B", "openclip", quick_gelu=True),
    PretrainedModel("ViT-B-16:metaclip_fullcc", "timm/vit_base_patch16_clip_224.metaclip_2pt5b",
                    "Meta's MetaCLIP 2.5B", "openclip", quick_gelu=True),
    PretrainedModel("ViT-L-14:metaclip_fullcc", "timm/vit_large_patch14_clip_224.metaclip_2pt5b",
                    "Meta's MetaCLIP 2.5B", "openclip", quick_gelu=True),
    # Google's SigLIP in transformers' SiglipModel layout (topoclip.io.convert.siglip), under OpenCLIP's names
    PretrainedModel("ViT-B-16-SigLIP:webli", "google/siglip-base-patch16-224", "Google's SigLIP, WebLI"),
    PretrainedModel("ViT-B-16-SigLIP-256:webli", "google/siglip-base-patch16-256", "Google's SigLIP at 256 px"),
    PretrainedModel("ViT-B-16-SigLIP-384:webli", "google/siglip-base-patch16-384", "Google's SigLIP at 384 px"),
    PretrainedModel("ViT-B-16-SigLIP-512:webli", "google/siglip-base-patch16-512", "Google's SigLIP at 512 px"),
    PretrainedModel("ViT-L-16-SigLIP-256:webli", "google/siglip-large-patch16-256", "Google's SigLIP at 256 px"),
    PretrainedModel("ViT-L-16-SigLIP-384:webli", "google/siglip-large-patch16-384", "Google's SigLIP at 384 px"),
    PretrainedModel("ViT-SO400M-14-SigLIP:webli", "google/siglip-so400m-patch14-224", "Google's SigLIP SO400M"),
    PretrainedModel("ViT-SO400M-14-SigLIP-384:webli", "google/siglip-so400m-patch14-384",
                    "Google's SigLIP SO400M at 384 px"),
    # SigLIP 2's fixed-resolution repositories: SigLIP's layout with Gemma's tokenizer.json. (OpenCLIP's SO400M/14 at
    # 378 px reads the 27 × 27 patches Google's 384 px repository does; topoclip resizes to 384 as transformers does.)
    *[PretrainedModel(f"ViT-{size}-SigLIP2{suffix}:webli", f"google/siglip2-{repo}", f"Google's SigLIP 2{note}")
      for size, suffix, repo, note in [
          ("B-32", "-256", "base-patch32-256", " at 256 px"), ("B-16", "", "base-patch16-224", ""),
          ("B-16", "-256", "base-patch16-256", " at 256 px"), ("B-16", "-384", "base-patch16-384", " at 384 px"),
          ("B-16", "-512", "base-patch16-512", " at 512 px"), ("L-16", "-256", "large-patch16-256", " at 256 px"),
          ("L-16", "-384", "large-patch16-384", " at 384 px"), ("L-16", "-512", "large-patch16-512", " at 512 px"),
          ("SO400M-14", "", "so400m-patch14-224", " SO400M"), ("SO400M-14", "-378", "so400m-patch14-384", " SO400M at 384 px"),
          ("SO400M-16", "-256", "so400m-patch16-256", " SO400M at 256 px"),
          ("SO400M-16", "-384", "so400m-patch16-384", " SO400M at 384 px"),
          ("SO400M-16", "-512", "so400m-patch16-512", " SO400M at 512 px"),
          ("gopt-16", "-256", "giant-opt-patch16-256", " g-opt at 256 px"),
          ("gopt-16", "-384", "giant-opt-patch16-384", " g-opt at 384 px")]],
]}


def get_pretrained(name: str) -> PretrainedModel:
    """The entry of `name`; UserError listing the names otherwise."""
    try:
        return PRETRAINED[name]
    except KeyError:
        raise UserError(f"no pretrained model {name!r}; `topoclip pretrained` lists them ({', '.join(PRETRAINED)})") from None


def pretrained_of(folder) -> Optional[PretrainedModel]:
    """The entry whose conversion `folder` is (pretrained_folder's CACHE/pretrained/NAME--TAG/REVISION), else None."""
    parts = Path(folder).parts
    if len(parts) < 3 or parts[-3] != "pretrained":
        return None
    entry = PRETRAINED.get(parts[-2].replace("--", ":", 1))
    return entry if entry is not None and entry.name.replace(":", "--") == parts[-2] else None


def cache_dir() -> Path:
    """Where converted pretrained models are kept: $TOPOCLIP_CACHE, else ~/.cache/topoclip."""
    return Path(os.environ.get("TOPOCLIP_CACHE") or Path.home() / ".cache" / "topoclip")


def pretrained_folder(name: str, revision: Optional[str] = None) -> Path:
    """A topoclip checkpoint folder of `name`: converted once from the Hub's files and kept under cache_dir()."""
    from topoclip.io.convert import convert

    entry = get_pretrained(name)
    if revision is not None:
        split_revision(entry.repo, revision)
    folder = cache_dir() / "pretrained" / name.replace(":", "--") / (revision or "main")
    why = escapes(folder, cache_dir())
    if why:
        raise UserError(f"topoclip's cache of converted models: {why}; delete that link and run again")
    if folder.exists() and not all(is_regular(folder / file, folder) for file in (WEIGHTS, TOKENIZER)):
        # conversions land whole, their tokenizer with them: this is not one (or one kept before they had to)
        missing = WEIGHTS if not is_regular(folder / WEIGHTS, folder) else TOKENIZER
        raise UserError(f"{folder} is in topoclip's cache of converted models but holds no converted {name} (no "
                        f"{missing}); delete that folder and run again: it is converted anew")
    if not folder.exists():
        snapshot = hub_folder(entry.repo, revision, layout=entry.layout)
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = scratch_name(folder)  # the conversion lands whole or not at all
        from topoclip.io.convert.architecture import FORMAT_HINT

        repositories = entry.repo + (f" (or {OPENAI_BPE}'s merges.txt)" if entry.layout == "openclip" else "")
        try:
            if entry.layout == "openclip":
                from topoclip.io.checkpoint import save_checkpoint
                from topoclip.io.convert.openai import import_openai

                merges = hub_folder(OPENAI_BPE, layout="bpe") / "merges.txt"
                model, tokenizer, config = import_openai(snapshot, "openclip", vocab=merges,
                                                         quick_gelu=entry.quick_gelu, name=name)
                save_checkpoint(staging, model, config, tokenizer)
            else:
                convert("hf", snapshot, staging)
        except CheckpointError as error:  # the format is the table's, not the user's: say where the files are
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(f"{name}: {str(error).removesuffix(FORMAT_HINT)}; the Hugging Face cache's "
                                  f"{repositories} is not what topoclip's table names: delete that repository's "
                                  f"folder in HF_HUB_CACHE to download it again") from None
        if not is_regular(staging / TOKENIZER, staging):  # (hub_folder fetched the tokenizer's files, or said why)
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(f"{entry.repo}: its files gave no tokenizer, so {name} cannot read text; nothing "
                                  f"was kept in topoclip's cache")
        try:
            os.replace(staging, folder)
        except OSError:  # another process converted it meanwhile
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def hub_folder(repo_id: str, revision: Optional[str] = None, cache_dir: Optional[Union[str, Path]] = None,
               layout: str = "topoclip") -> Path:
    """The local snapshot folder of a Hub repo (downloaded, or from the cache offline) with the files of `layout`:
    "topoclip" (an export: weights, its config, its tokenizer; also transformers' CLIPModel, said by its config),
    "hf" (transformers' CLIPModel or SiglipModel), "openclip" (open_clip_config.json and OpenCLIP's weights) or "bpe" (OpenAI's
    merges.txt alone)."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise UserError(f"{repo_id!r} is not a local folder; loading it from the Hugging Face Hub needs "
                        f"huggingface_hub: pip install 'topoclip[hub]'") from None

    repo_id, revision = split_revision(repo_id, revision)
    offline = not hub_reachable()  # then the cache alone, at once (huggingface_hub would retry each file for 23 s)

    def fetch(name: str, required: bool = True) -> Optional[Path]:
        try:
            found = Path(hf_hub_download(repo_id, name, revision=revision, cache_dir=cache_dir,
                                         local_files_only=offline))
        except LocalEntryNotFoundError:
            if not required:
                return None
            raise UserError(f"{repo_id}: {name} is not in the local Hugging Face cache and the Hub cannot be reached "
                            f"(offline, or HF_HUB_OFFLINE=1); download it once online, or point HF_HUB_CACHE at a "
                            f"cache that has it") from None
        except RepositoryNotFoundError:
            raise UserError(f"{repo_id!r}: no such Hugging Face Hub repository (or it is private: log in with "
                            f"`hf auth login`)") from None
        except EntryNotFoundError:
            if not required:
                return None
            raise CheckpointError(f"Hub repository {repo_id} has no {name}; topoclip reads exported folders "
                                  f"({WEIGHTS}, {MODEL_CONFIG}, {TOKENIZER}); convert other formats with "
                                  f"`topoclip convert`") from None
        except OSError as error:  # network failures
            raise UserError(f"{repo_id}: could not download {name} ({error})") from None
        except Exception as error:  # a damaged cache (refs/main naming no snapshot), an answer huggingface_hub refuses
            first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
            raise UserError(f"{repo_id}: the Hugging Face Hub or its cache could not give {name} "
                            f"({type(error).__name__}: {first}); check HF_HUB_CACHE, or delete that repository's "
                            f"folder there to download it again") from None
        repository = found.parents[2]  # …/models--ORG--NAME/snapshots/REVISION/NAME: every link stays in the repository
        why = escapes(found, repository)  # (the snapshot folder included: it is the cache's, not the user's, to place)
        if why or found.parent.parent.name != "snapshots":
            raise UserError(f"{repo_id}: the Hugging Face cache's {name} leads out of its repository folder "
                            f"({why or found}); delete that repository's folder in HF_HUB_CACHE to download it again")
        return found

    if layout == "bpe":
        return fetch("merges.txt").parent
    if layout == "openclip":
        from topoclip.io.convert.openai import OPENCLIP_CONFIG

        weights = fetch(OPENCLIP_WEIGHTS[0], required=False) or fetch(OPENCLIP_WEIGHTS[1], required=False)
        if weights is None:
            where = "in the local Hugging Face cache (offline)" if offline else "in the repository"
            raise CheckpointError(f"{repo_id}: neither {' nor '.join(OPENCLIP_WEIGHTS)} is {where}; OpenCLIP's "
                                  f"weights are one of them")
        fetch(OPENCLIP_CONFIG)
        return weights.parent
    weights = fetch(WEIGHTS, required=False) or fetch(HF_BIN_WEIGHTS, required=False) or fetch(WEIGHTS)
    if fetch(MODEL_CONFIG, required=False) is None:
        fetch(CONFIG)  # a repository pushed with the earlier layout, or transformers' CLIPModel
    from topoclip.io.convert.hf_layout import MERGES, PREPROCESSOR, VOCAB, hf_model_type
    from topoclip.io.convert.siglip import SPIECE, TOKENIZER_CONFIG

    tokenizer = fetch(TOKENIZER, required=False)
    kind = hf_model_type(weights.parent)
    if kind == "clip":  # transformers' layout: its BPE merges, the text's tokenizer (unless a
        fetch(MERGES, required=tokenizer is None)  # tokenizer.json is there), said by name when missing
        for name in (VOCAB, PREPROCESSOR):  # the vocabulary beside the merges, the pixel statistics
            fetch(name, required=False)
    elif kind == "siglip":  # SigLIP's SentencePiece file (its text's tokenizer), its settings, the pixel statistics
        fetch(SPIECE, required=tokenizer is None)  # (SigLIP 2's is its tokenizer.json, Gemma's)
        for name in (TOKENIZER_CONFIG, PREPROCESSOR):
            fetch(name, required=False)
    return weights.parent


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the Hub's endpoint answers one request (any answer but a server error) within `timeout` seconds;
    False at once under HF_HUB_OFFLINE=1. One try, no retries: on a machine without a network the files are then
    read from the cache alone, instead of huggingface_hub retrying each one five times (23 s and ten lines a file)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        answer = get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception:  # requests' and httpx's connection errors, timeouts, a proxy that refuses: not reachable
        return False
    return answer.status_code < 500  # a server error (a proxy's 502, the Hub's 503) is retried like no answer
