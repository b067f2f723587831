"""transformers' CLIPModel both ways, against the real library: a tiny CLIPModel and its CLIPTokenizer written by
transformers are imported (`convert --from hf`, `topoclip.load(folder)`), give transformers' own embeddings for the
same strings and pixels, train a step, and export back (`export --hf`) into a folder transformers loads with
the same embeddings."""
import json

import pytest
import torch

from topoclip.cli import main
from topoclip.io.convert.openai import bytes_to_unicode

from _hub import hub_snapshot, offline_env, with_image_size
from _tolerance import fp32_pair, network_roundings

transformers = pytest.importorskip("transformers")

MERGES = ["t h", "th e</w>", "a t</w>", "c a", "r e", "re d</w>", "c at</w>", "b l", "bl u", "blu e</w>", "s t",
          "st a", "sta r", "star s</w>"]
TEXTS = ["a red cat", "the blue stars", "a photo of the cat", "two red stars and a cat"]
# Two fp32 computations of the same embeddings (two towers of 2 layers, width ≤ 64, ≤ 16 tokens) in other kernels:
# within the summed rounding bound of their longest reduction chain (tests/_tolerance.py), on any CPU.
BOUND = fp32_pair(network_roundings(layers=2, width=64, context=17, batch=len(TEXTS)))


def write_clip_tokenizer(folder):
    """OpenAI's BPE as transformers' CLIPTokenizer files (vocab.json, merges.txt) for MERGES."""
    characters = list(bytes_to_unicode().values())
    tokens = characters + [c + "</w>" for c in characters] + ["".join(m.split()) for m in MERGES]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({token: index for index, token in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    return len(tokens)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "tiny-clip"
    folder.mkdir()
    vocab = write_clip_tokenizer(folder)
    config = transformers.CLIPConfig(
        text_config={"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "max_position_embeddings": 16, "hidden_act": "quick_gelu",
                     "bos_token_id": vocab - 2, "eos_token_id": 2, "pad_token_id": 1},
        vision_config={"hidden_size": 48, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 3,
                       "image_size": 32, "patch_size": 8, "hidden_act": "quick_gelu"},
        projection_dim=24)
    torch.manual_seed(0)
    model = transformers.CLIPModel(config).eval()
    model.save_pretrained(folder)
    tokenizer = transformers.CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    tokenizer.save_pretrained(folder)
    return folder


def transformers_embeddings(folder, texts, pixels):
    model = transformers.CLIPModel.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(texts, padding="max_length", max_length=model.config.text_config.max_position_embeddings,
                    truncation=True, return_tensors="pt")
    with torch.no_grad():
        text = model.get_text_features(**ids)
        image = model.get_image_features(pixel_values=pixels)
    if not isinstance(text, torch.Tensor):  # newer transformers return an output object
        text, image = text.pooler_output, image.pooler_output
    return torch.nn.functional.normalize(text, dim=-1), torch.nn.functional.normalize(image, dim=-1)


# The classes a transformers user reaches for to tokenize a CLIP folder; CLIPTokenizerFast is CLIPTokenizer in 5.x.
TOKENIZER_CLASSES = ["AutoTokenizer", "AutoProcessor", "CLIPProcessor", "PreTrainedTokenizerFast", "CLIPTokenizer",
                     "CLIPTokenizerFast"]


def same_ids_by_class(folder, tokenizer, texts):
    """{class name: whether it gives `tokenizer`'s ids for `texts` up to the end token} for TOKENIZER_CLASSES."""
    ours = tokenizer(texts)
    same = {}
    for name in TOKENIZER_CLASSES:
        theirs = getattr(transformers, name).from_pretrained(folder)
        theirs = getattr(theirs, "tokenizer", theirs)  # a processor holds its tokenizer
        ids = theirs(texts, padding="max_length", max_length=tokenizer.context_length, truncation=True,
                     return_tensors="pt").input_ids
        same[name] = torch.equal(ids[ours.attention_mask], ours.input_ids[ours.attention_mask])
    return same


def pixels(size=32):
    return torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
def test_a_transformers_clip_folder_loads_with_its_own_embeddings(hf_folder):
    import topoclip

    clip = topoclip.load(hf_folder)  # recognised by its config.json, converted in memory
    assert clip.config.model.text.end_token_id is None and clip.config.model.vision.activation == "quick_gelu"
    text, image = transformers_embeddings(hf_folder, TEXTS, pixels())
    torch.testing.assert_close(clip.encode_text(TEXTS)[:, 0], text, **BOUND)
    with torch.no_grad():
        torch.testing.assert_close(clip.model.encode_image(pixels())[:, 0], image, **BOUND)


def test_convert_train_and_export_back_to_transformers(hf_folder, tmp_path):
    import topoclip

    assert main(["convert", "--from", "hf", str(hf_folder), str(tmp_path / "imported")]) == 0
    assert main(["export", str(tmp_path / "imported"), "--hf", str(tmp_path / "back")]) == 0
    text, image = transformers_embeddings(tmp_path / "back", TEXTS, pixels())
    ours, theirs = topoclip.load(tmp_path / "imported"), transformers_embeddings(hf_folder, TEXTS, pixels())
    assert all(same_ids_by_class(tmp_path / "back", ours.tokenizer, TEXTS).values())  # OpenAI's BPE: every class
    torch.testing.assert_close(text, theirs[0], **BOUND)  # the round trip changes nothing
    torch.testing.assert_close(image, theirs[1], **BOUND)
    torch.testing.assert_close(ours.encode_text(TEXTS)[:, 0], text, **BOUND)


@pytest.mark.slow
def test_a_model_trained_here_exports_to_transformers(tmp_path, capsys):
    """A WordPiece vocabulary trained here: exported with eos_token_id = its [SEP], which transformers pools at; the
    classes that read its tokenizer.json give its ids, and the line printed names CLIPTokenizer, which does not."""
    import topoclip
    from topoclip.config import load_config
    from topoclip.run.training.trainer import train

    layout = ["model.topology=sphere", "model.class_tokens=1", "model.text.attention=causal",
              "model.text.pooling=end_of_text", "model.text.norm_first=true", "model.text.embedding_norm=false",
              "model.vision.activation=quick_gelu", "model.text.activation=quick_gelu", "train.steps=2",
              "evaluate.size=16", "train.eval_every=0"]
    run = train(load_config("tiny", layout), out_dir=tmp_path / "run", progress=False)
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    clip = topoclip.load(run)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["text_config"]["eos_token_id"] == clip.tokenizer.sep_id
    same = same_ids_by_class(tmp_path / "hf", clip.tokenizer, TEXTS)
    wrong = sorted(name for name, equal in same.items() if not equal)
    assert wrong == ["CLIPTokenizer", "CLIPTokenizerFast"], same  # transformers 5 rebuilds them as BPE, no merges
    printed = capsys.readouterr().out
    assert "AutoTokenizer" in printed and "not CLIPTokenizer's" in printed
    text, image = transformers_embeddings(tmp_path / "hf", TEXTS, pixels(clip.config.model.vision.image_size))
    bound = fp32_pair(network_roundings(layers=2, width=64, context=32, batch=len(TEXTS)))
    torch.testing.assert_close(clip.encode_text(TEXTS)[:, 0], text, **bound)
    with torch.no_grad():
        torch.testing.assert_close(clip.model.encode_image(pixels(clip.config.model.vision.image_size))[:, 0], image,
                                   **bound)


@pytest.mark.slow
def test_models_transformers_cannot_hold_are_refused_in_one_line(tmp_path, capsys):
    from topoclip.config import load_config
    from topoclip.run.training.trainer import train

    run = train(load_config("tiny", ["train.steps=1", "evaluate.size=16", "train.eval_every=0"]),
                out_dir=tmp_path / "run", progress=False)
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 2
    error = capsys.readouterr().err
    assert "transformers' CLIPModel cannot hold this model" in error and error.count("\n") == 1
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_a_pretrained_name_loads_and_trains_from_an_offline_hub_cache(hf_folder, tmp_path):
    """OpenCLIP's name (ViT-B-32:openai) -> its Hub repository (openai/clip-vit-base-patch32, transformers' layout)
    in the Hugging Face cache, offline -> converted once into TOPOCLIP_CACHE -> loaded, and trained from."""
    import subprocess
    import sys

    pytest.importorskip("huggingface_hub")
    hub_snapshot(tmp_path / "hub", "openai/clip-vit-base-patch32", hf_folder)  # a tiny CLIPModel in its file names
    env = offline_env(tmp_path)
    script = ("import topoclip, torch\n"
              f"clip = topoclip.load('ViT-B-32:openai')\n"
              f"print(clip.encode_text({TEXTS!r})[:, 0].tolist())\n")
    loaded = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    text, _ = transformers_embeddings(hf_folder, TEXTS, pixels())
    torch.testing.assert_close(torch.tensor(json.loads(loaded.stdout)), text, **BOUND)
    assert (tmp_path / "topoclip-cache" / "pretrained" / "ViT-B-32--openai" / "main" / "model.safetensors").is_file()
    settings = ["--set", "train.steps=1", "--set", "evaluate.size=16", "--set", "train.num_workers=0",
                "--set", "data.scenes.train_size=64", "--set", "train.batch_size=8", "--quiet"]
    for name in (["--pretrained", "ViT-B-32:openai"], ["--model", "ViT-B-32", "--pretrained", "openai"]):
        out = tmp_path / f"run{len(name)}"
        trained = subprocess.run([sys.executable, "-m", "topoclip", "train", *name, "--out", str(out), *settings],
                                 env=env, capture_output=True, text=True, timeout=600)
        assert trained.returncode == 0, trained.stderr[-2000:]
        assert (out / "eval.json").is_file()
        assert json.loads((out / "config.json").read_text())["train"]["init_from"].endswith("ViT-B-32--openai/main")


def hub_cache(hf_folder, root, names):
    """A Hugging Face cache holding `names` of the tiny CLIPModel, as openai/clip-vit-base-patch32's snapshot."""
    snapshot = hub_snapshot(root, "openai/clip-vit-base-patch32")
    for name in names:
        (snapshot / name).write_bytes((hf_folder / name).read_bytes())
    return snapshot


@pytest.mark.parametrize("hub", ["offline", "unreachable"])
def test_a_partial_cache_names_the_missing_file_keeps_nothing_and_works_once_completed(hf_folder, tmp_path, hub):
    """Failed on main: with only what CLIPModel.from_pretrained fetches (config and weights, no merges.txt) the error
    blamed a missing tokenizer.json and said to convert again with --vocab; the tokenizer-less conversion was kept in
    topoclip's cache and failed on after the cache was completed; without HF_HUB_OFFLINE and no network, a name cost
    78 s and 33 lines of huggingface_hub's retries before the one line."""
    import os
    import subprocess
    import sys

    pytest.importorskip("huggingface_hub")
    snapshot = hub_cache(hf_folder, tmp_path / "hub", ["config.json", "model.safetensors"])
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "home"),
           "TOPOCLIP_CACHE": str(tmp_path / "topoclip-cache")}
    env.pop("HF_HUB_OFFLINE", None)
    if hub == "offline":
        env["HF_HUB_OFFLINE"] = "1"
    else:  # a Hub that refuses every connection at once: a machine without a network, not told so
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    command = [sys.executable, "-m", "topoclip", "train", "--pretrained", "ViT-B-32:openai", "--print-config"]
    refused = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "merges.txt is not in the local Hugging Face cache" in refused.stderr
    assert not (tmp_path / "topoclip-cache" / "pretrained" / "ViT-B-32--openai" / "main").exists()
    for name in ("merges.txt", "vocab.json"):  # the cache completed
        (snapshot / name).write_bytes((hf_folder / name).read_bytes())
    loaded = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert "Retrying" not in loaded.stderr
    converted = tmp_path / "topoclip-cache" / "pretrained" / "ViT-B-32--openai" / "main"
    assert (converted / "tokenizer.json").is_file()


def test_an_end_token_of_id_2_is_refused_for_transformers(tmp_path, capsys):
    """transformers reads eos_token_id 2 as 'pool at the largest id'; a vocabulary whose [SEP] is 2 would export a
    model transformers pools elsewhere."""
    from topoclip.io.checkpoint import save_checkpoint
    from topoclip.config import load_config
    from topoclip.model.clip import CLIP
    from topoclip.preprocess.tokenizer import Tokenizer

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[SEP]", "[CLS]", "[MASK]", "a", "red", "cat"]) + "\n")
    tokenizer = Tokenizer.from_vocab(vocab, context_length=32)
    layout = ["model.topology=sphere", "model.class_tokens=1", "model.text.attention=causal",
              "model.text.pooling=end_of_text", "model.text.norm_first=true", "model.text.embedding_norm=false",
              "model.vision.activation=quick_gelu", "model.text.activation=quick_gelu", "model.text.end_token_id=2",
              "model.text.cls_token_id=3"]
    config = load_config("tiny", layout)
    checkpoint = save_checkpoint(tmp_path / "ckpt", CLIP(config.model), config, tokenizer)
    assert main(["export", str(checkpoint), "--hf", str(tmp_path / "hf")]) == 2
    assert "eos_token_id 2" in capsys.readouterr().err and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("status, reachable", [(503, False), (502, False), (404, True), (200, True)])
def test_a_hub_that_answers_a_server_error_is_not_asked_again(status, reachable, monkeypatch):
    """From the hostile review: a proxy answering 503 counted as reachable, and huggingface_hub then retried every
    file five times (74 s, 33 lines) before reading the cache it had."""
    import http.server
    import threading

    constants = pytest.importorskip("huggingface_hub.constants")
    from topoclip.io.pretrained import hub_reachable

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(status)
            self.end_headers()

        def log_message(self, *arguments):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        assert hub_reachable() is reachable
    finally:
        server.shutdown()


def test_an_image_size_past_a_multiple_of_the_patch_survives_import_and_export(hf_folder, tmp_path):
    """A 36 px CLIP with patches of 8 (4 pixels unread): the size comes from config.json (the weights hold only the
    grid of 4 × 4), in from transformers, out to transformers and OpenCLIP and back in, each time 36 px; and the
    embeddings are transformers' own."""
    import topoclip

    folder = with_image_size(hf_folder, tmp_path / "odd", 36)
    clip = topoclip.load(folder)
    assert clip.config.model.vision.image_size == 36
    images = torch.randn(3, 3, 36, 36, generator=torch.Generator().manual_seed(1))
    _, image = transformers_embeddings(folder, TEXTS, images)
    with torch.no_grad():
        torch.testing.assert_close(clip.model.encode_image(images)[:, 0], image, **BOUND)
    assert main(["convert", "--from", "hf", str(folder), str(tmp_path / "converted")]) == 0
    assert main(["export", str(tmp_path / "converted"), "--hf", str(tmp_path / "hf"), "--openclip",
                 str(tmp_path / "oc")]) == 0
    for format, exported in (("hf", tmp_path / "hf"), ("openclip", tmp_path / "oc")):
        assert main(["convert", "--from", format, str(exported), str(tmp_path / f"back-{format}")]) == 0
        back = json.loads((tmp_path / f"back-{format}" / "topoclip_config.json").read_text())
        assert back["model"]["vision"]["image_size"] == 36, format


def test_a_name_whose_cached_weights_do_not_fit_names_the_repository_and_keeps_nothing(hf_folder, tmp_path):
    import subprocess
    import sys

    pytest.importorskip("huggingface_hub")
    from safetensors.torch import save_file

    snapshot = hub_cache(hf_folder, tmp_path / "hub", ["config.json", "merges.txt", "vocab.json"])
    save_file({"not.a.clip.weight": torch.zeros(2)}, str(snapshot / "model.safetensors"))
    env = offline_env(tmp_path)
    refused = subprocess.run([sys.executable, "-m", "topoclip", "train", "--pretrained", "ViT-B-32:openai",
                              "--print-config"], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "openai/clip-vit-base-patch32 is not what topoclip's table names" in refused.stderr
    assert not any((tmp_path / "topoclip-cache" / "pretrained").rglob("model.safetensors"))
