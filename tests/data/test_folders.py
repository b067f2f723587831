"""Evaluation sets from folders: class folders and Karpathy caption files, paths kept inside the root."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from topoclip.data.folders import load_class_folders, load_karpathy_captions

from _user_data import encode


def test_load_class_folders(tmp_path):
    root = tmp_path / "classes"
    colours = {"cat": (255, 0, 0), "dog": (0, 255, 0), "sea_otter": (0, 0, 255)}
    for index, (folder, colour) in enumerate(colours.items()):
        (root / folder / "nested").mkdir(parents=True)
        for i in range(index + 1):
            (root / folder / "nested" / f"{i}.png").write_bytes(encode(Image.new("RGB", (9, 7), colour), "PNG"))
    (root / "dog" / "broken.jpg").write_bytes(b"not an image")
    (root / "dog" / "notes.txt").write_text("not an image file name either")
    with pytest.warns(UserWarning, match="corrupt_image 1"):
        dataset = load_class_folders(root)
    assert dataset.classnames == ["cat", "dog", "sea otter"]
    assert dataset.labels.tolist() == [0, 1, 1, 2, 2, 2]
    assert dataset.templates == ["a photo of a {}."]
    assert len(dataset.images) == 6 and dataset.images.skipped.bad == {"corrupt_image": 1}
    assert np.asarray(dataset.images[3])[0, 0].tolist() == [0, 0, 255]
    assert len(dataset.images[1:3]) == 2

    names_txt = tmp_path / "names.txt"
    names_txt.write_text("house cat\n\ndog\nsea otter\n")
    templates = tmp_path / "templates.txt"
    templates.write_text("a photo of a {}.\n\na drawing of the {}\n")
    with pytest.warns(UserWarning):
        dataset = load_class_folders(root, names_txt, templates, name="pets")
    assert dataset.name == "pets" and dataset.classnames[0] == "house cat"
    assert dataset.templates == ["a photo of a {}.", "a drawing of the {}"]
    names_json = tmp_path / "names.json"
    names_json.write_text(json.dumps({"cat": "kitty", "dog": "puppy", "sea_otter": "otter"}))
    assert load_class_folders(root, names_json, verify=False).classnames == ["kitty", "puppy", "otter"]

    names_txt.write_text("cat\ndog\n")
    with pytest.raises(ValueError, match="2 class names but there are 3 class folders"):
        load_class_folders(root, names_txt)
    names_json.write_text(json.dumps({"cat": "kitty"}))
    with pytest.raises(ValueError, match="dog"):
        load_class_folders(root, names_json)
    templates.write_text("no placeholder here\n")
    with pytest.raises(ValueError, match="line 1"):
        load_class_folders(root, templates_file=templates)

def test_load_karpathy_captions(tmp_path):
    (tmp_path / "images" / "val2014").mkdir(parents=True)
    for name, colour in (("a.jpg", (255, 0, 0)), ("b.jpg", (0, 255, 0)), ("c.jpg", (0, 0, 255))):
        Image.new("RGB", (12, 8), colour).save(tmp_path / "images" / "val2014" / name)
    entries = [
        {"filename": "a.jpg", "filepath": "val2014", "split": "test",
         "sentences": [{"raw": "A red  square."}, {"raw": "  "}, {"tokens": ["red", "thing"]}]},
        {"filename": "b.jpg", "filepath": "val2014", "split": "train", "sentences": [{"raw": "green"}]},
        {"filename": "missing.jpg", "filepath": "val2014", "split": "test", "sentences": [{"raw": "gone"}]},
        {"filename": "c.jpg", "filepath": "val2014", "split": "test", "sentences": [{"raw": "blue one"}]},
    ]
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps({"images": entries, "dataset": "coco"}))
    with pytest.warns(UserWarning, match="missing_file 1"):
        retrieval = load_karpathy_captions(path, tmp_path / "images")
    assert retrieval.captions == ["A red square.", "red thing", "blue one"]
    assert retrieval.caption_image.tolist() == [0, 0, 1]
    assert len(retrieval.images) == 2 and retrieval.images.skipped.bad == {"empty_caption": 1, "missing_file": 1}
    assert np.asarray(retrieval.images[1])[0, 0].tolist()[2] > 240  # c.jpg is blue
    paired = retrieval.paired(torch.arange(2), torch.arange(3))
    assert paired.tolist() == [[True, True, False], [False, False, True]]
    assert load_karpathy_captions(path, tmp_path / "images", split="train").captions == ["green"]
    with pytest.raises(ValueError, match="splits found: \\['test', 'train'\\]"):
        load_karpathy_captions(path, tmp_path / "images", split="val")

@pytest.mark.parametrize("verify", [True, False])
def test_karpathy_paths_outside_the_root_are_refused_and_counted(tmp_path, verify):
    """Failed on main: "../outside/secret.png", "../../../../etc/passwd" and absolute paths were opened and scored."""
    root = tmp_path / "images"
    root.mkdir()
    Image.new("RGB", (12, 8), (255, 0, 0)).save(root / "a.jpg")
    (tmp_path / "outside").mkdir()
    Image.new("RGB", (12, 8), (0, 0, 255)).save(tmp_path / "outside" / "secret.png")
    escaping = [{"filename": "../outside/secret.png"}, {"filename": "../../../../etc/passwd"},
                {"filename": str(tmp_path / "outside" / "secret.png")},
                {"filepath": str(tmp_path / "outside"), "filename": "secret.png"},
                {"filepath": "..", "filename": "outside/secret.png"}]
    entries = [{"filename": "a.jpg", "split": "test", "sentences": [{"raw": "red"}]}]
    entries += [{**entry, "split": "test", "sentences": [{"raw": f"secret {i}"}]} for i, entry in enumerate(escaping)]
    path = tmp_path / "captions.json"
    path.write_text(json.dumps({"images": entries}))
    with pytest.warns(UserWarning, match="path_outside_root 5"):
        retrieval = load_karpathy_captions(path, root, verify=verify)
    assert retrieval.captions == ["red"] and [p.name for p in retrieval.images.paths] == ["a.jpg"]
    assert retrieval.images.skipped.bad == {"path_outside_root": 5}


def test_an_absolute_path_inside_a_relative_root_is_the_same_file_as_its_relative_form(tmp_path, monkeypatch):
    """From the second review of #62: an absolute image path inside the table's folder was refused as outside it when
    the folder was given relatively (its check compared a relative root with an absolute path), and accepted when the
    same folder was given absolutely; and one image written two ways counted as two images of a retrieval set."""
    from topoclip.data.folders import load_caption_table
    from topoclip.data.images import resolve_image_path

    (tmp_path / "val" / "img").mkdir(parents=True)
    for i, colour in enumerate([(255, 0, 0), (0, 0, 255)]):
        Image.new("RGB", (12, 8), colour).save(tmp_path / "val" / "img" / f"{i}.png")
    absolute = tmp_path / "val" / "img" / "0.png"
    monkeypatch.chdir(tmp_path)
    for root in ("val", tmp_path / "val"):
        assert resolve_image_path(str(absolute), root) == resolve_image_path("img/./0.png", root) == Path(root) / "img/0.png"
    (tmp_path / "val" / "pairs.csv").write_text(f"filepath,title\nimg/0.png,red\n{absolute},a red one\nimg/1.png,blue\n")
    for table in ("val/pairs.csv", tmp_path / "val" / "pairs.csv"):
        pairs = load_caption_table(table)
        assert pairs.caption_image.tolist() == [0, 0, 1] and len(pairs.images) == 2, table
