"""The one door (issue #58): every file a stranger can hand over is opened, read, listed and copied through
topoclip.core.door. The first test fails when a module outside it reads a path itself; the rest pin what the door
promises: regular files only (a FIFO or a device refused at once), no link out of its folder, size, depth and count
bounds, copies that never follow links and land whole."""
import ast
import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from topoclip.core import door
from topoclip.core.errors import DiskFullError

SOURCE = Path(door.__file__).parent.parent  # src/topoclip

# Calls that open, read, list or copy a path (the name as written in the source: the callee's last part, and for a
# method its receiver), and the reading modes of open().
READERS = {"read_text", "read_bytes", "iterdir", "glob", "rglob", "listdir", "scandir", "walk", "copytree",
           "shutil.copy", "shutil.copy2", "shutil.copyfile", "safe_open", "load_file", "fromfile", "loadtxt", "gopen.gopen"}
OPENERS = {"open"}  # builtins.open, Path.open, Image.open, tarfile.open, gzip.open, os.open: read unless written to
LOADERS = {"torch.load", "json.load", "np.load", "pickle.load", "dcp.load"}

# The few reads outside the door, each of what topoclip itself wrote or shipped, or of what the door checked first.
ALLOWED = {
    ("io/checkpoint.py", "check_weights_fit", "safe_open"): "the path comes from door.regular_file just before",
    ("io/checkpoint.py", "read_weights", "load_file"): "the path comes from door.regular_file just before",
    ("io/checkpoint.py", "stored_scalar", "safe_open"): "the path comes from door.regular_file just before",
    ("io/checkpoint.py", "first_non_finite", "safe_open"): "the path comes from door.regular_file just before",
    ("io/checkpoint.py", "load_training_state", "torch.load"): "reads the file object door.open_regular opened",
    ("cli/__init__.py", "main", "os.open"): "opens os.devnull for writing",
    ("cli/files.py", "command_push", "iterdir"): "lists the folder `push --dry-run` has just written",
    ("config/loading.py", "_preset_files", "iterdir"): "lists the presets shipped in the package",
    ("config/loading.py", "preset_dict", "read_text"): "reads a preset shipped in the package",
    ("config/loading.py", "describe_preset", "read_text"): "reads a preset shipped in the package",
    ("io/convert/files.py", "read_state_dict", "load_file"): "the path comes from door.regular_file just before",
    ("model/lora.py", "load_adapters", "load_file"): "the path comes from door.regular_file just before",
    ("model/lora.py", "load_adapters", "safe_open"): "the path comes from door.regular_file just before",
    ("io/convert/files.py", "read_state_dict", "torch.load"): "reads the file object door.open_regular opened",
    ("data/benchmark_sets.py", "_samples", "tarfile.open"): "the shard was opened through door.open_regular first",
    ("data/benchmark_sets.py", "_header_ok", "Image.open"): "decodes bytes already read (BytesIO)",
    ("data/images.py", "decode_image", "Image.open"): "decodes bytes, or a file door.open_regular opened",
    ("data/images.py", "check_image_header", "Image.open"): "reads the file object door.open_regular opened",
    ("data/shard_writer.py", "_check_last_shard", "tarfile.open"): "the path comes from door.regular_file",
    ("data/shards.py", "_members", "gopen.gopen"): "a URL the user typed (a file's is refused earlier)",
    ("data/shards.py", "_members", "tarfile.open"): "reads the stream door.open_regular (or gopen) opened",
    ("run/evaluation/benchmarks.py", "get_benchmark", "read_text"): "reads benchmark data shipped in the package",
    ("experiments/grid.py", "grid_names", "iterdir"): "lists the grids shipped in the package",
    ("experiments/grid.py", "load_grid", "iterdir"): "lists the grids shipped in the package",
    ("experiments/grid.py", "load_grid", "read_text"): "reads a grid shipped in the package",
    ("run/hub.py", "upload_folder", "iterdir"): "lists the folder upload_folder has just written",
    ("core/locks.py", "_lock", "os.open"): "creates and locks RUN/.lock with O_NOFOLLOW (a link refused)",
    ("run/training/sharding.py", "load_optimizer_shards", "dcp.load"): "the folder passed door.check_tree just before",
    ("experiments/results/headline.py", "drawn_from", "Image.open"): "reads the file object door.open_regular opened",
    ("experiments/runner.py", "package_digest", "walk"): "lists the running topoclip package's own files (its code)",
    ("experiments/runner.py", "package_digest", "read_bytes"): "reads the running topoclip package's own files",
}


def reads(tree: ast.AST):
    """(enclosing function, call) of every call in `tree` that reads a path (see READERS, OPENERS, LOADERS), but calls
    of the door's own functions (imported from topoclip.core.door, or as door.NAME)."""
    found, scope = [], []
    doors = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and node.module == "topoclip.core.door" for alias in node.names}

    class Visitor(ast.NodeVisitor):
        def visit_FunctionDef(self, node):
            scope.append(node.name)
            self.generic_visit(node)
            scope.pop()

        visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

        def visit_Call(self, node):
            function = node.func
            name = function.id if isinstance(function, ast.Name) else (
                function.attr if isinstance(function, ast.Attribute) else None)
            receiver = ast.unparse(function.value) if isinstance(function, ast.Attribute) else ""
            dotted = f"{receiver.rsplit('.', 1)[-1]}.{name}" if receiver else name
            if (not receiver and name in doors) or receiver == "door":
                self.generic_visit(node)
                return
            # the mode: open(path, MODE), Path.open(MODE), or mode=MODE
            where = node.args[1:2] if not receiver or receiver in ("os", "Image", "tarfile", "gzip") else node.args[:1]
            mode = next((arg.value for arg in where + [k.value for k in node.keywords if k.arg == "mode"]
                         if isinstance(arg, ast.Constant)), None)
            written = isinstance(mode, str) and any(letter in mode for letter in "wxa")
            if name in OPENERS and not written and not (receiver and isinstance(function.value, ast.Call)
                                                        and ast.unparse(function.value).startswith("open_regular")):
                found.append((".".join(scope), dotted if receiver in ("os", "Image", "tarfile", "gzip", "gopen") or
                              receiver.endswith(("Image", "tarfile", "gzip", "gopen")) else name))
            elif name in READERS or dotted in READERS:
                found.append((".".join(scope), dotted if dotted in READERS else name))
            elif dotted in LOADERS:
                found.append((".".join(scope), dotted))
            self.generic_visit(node)

    Visitor().visit(tree)
    return found


def test_every_reader_of_a_path_is_the_door():
    """Failed before: each new feature read files with its own open / json.load / copytree (preset and grid files,
    ablate --reuse, transformers configs, FSDP's optimiser folder), so each arrived unhardened."""
    outside = []
    for path in sorted(SOURCE.rglob("*.py")):
        module = path.relative_to(SOURCE).as_posix()
        if module == "core/door.py":
            continue
        for function, call in reads(ast.parse(path.read_text(encoding="utf-8"))):
            if (module, function, call) not in ALLOWED:
                outside.append(f"{module}: {function or '<module>'} calls {call}")
    assert outside == [], "read through topoclip.core.door (or add the case to ALLOWED with its reason):\n" + "\n".join(outside)


def test_the_allowed_reads_are_still_there():
    """An entry of ALLOWED whose read has gone is stale: it would let a new read through under an old excuse."""
    present = {(path.relative_to(SOURCE).as_posix(), function, call) for path in SOURCE.rglob("*.py")
               for function, call in reads(ast.parse(path.read_text(encoding="utf-8")))}
    assert sorted(set(ALLOWED) - present) == []


def test_the_scan_finds_a_reader(tmp_path):
    """The scan itself: each kind of read it must catch, and the writes it must not."""
    tree = ast.parse("def f(p):\n    json.loads(p.read_text())\n    open(p)\n    open(p, 'w')\n    torch.load(p)\n"
                     "    Image.open(p)\n    shutil.copytree(p, q)\n    p.iterdir()\n    os.scandir(p)\n")
    assert sorted(call for _, call in reads(tree)) == sorted(["read_text", "open", "torch.load", "Image.open",
                                                              "copytree", "iterdir", "scandir"])


# --------------------------------------------------------------------------- what the door promises


def within(seconds: float, function, *args, **kwargs):
    """function(*args) run in a thread; fails (instead of hanging the suite) when it has not returned in `seconds`."""
    outcome = {}

    def target():
        try:
            outcome["value"] = function(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{function.__name__} blocked"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.mark.parametrize("reader", [door.read_bytes, door.read_text, door.read_json])
def test_a_fifo_is_refused_at_once(tmp_path, reader):
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(door.FileRefused, match="is a FIFO, not a regular file"):
        within(10, reader, tmp_path / "config.json", "the config")


def test_a_device_is_refused(tmp_path):
    with pytest.raises(door.FileRefused, match="character device"):
        within(10, door.read_bytes, "/dev/zero", "weights")


def test_a_file_past_its_bound_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "config.json"
    with open(big, "wb") as file:
        file.truncate(3 << 30)  # 3 GiB, sparse: nothing is read, or the test would take minutes
    with pytest.raises(door.FileRefused, match="over the 4.0 MiB"):
        door.read_json(big, "the config")
    with pytest.raises(door.FileRefused, match="over the 64.0 MiB"):
        door.read_json(big, "a tokenizer", limit=door.JSON_BYTES)


@pytest.mark.parametrize("text, problem", [("[" * 100 + "]" * 100, "more than the 64 levels"), ("[" * 100_000, "not valid JSON"),
                                           ('{"a": 1', "not valid JSON"), ("1" * 5000, "not valid JSON")])
def test_json_is_bounded_in_depth(tmp_path, text, problem):
    (tmp_path / "x.json").write_text(text)
    with pytest.raises(door.FileRefused, match=problem):
        door.read_json(tmp_path / "x.json", "x")


def test_json_of_an_expected_kind(tmp_path):
    (tmp_path / "x.json").write_text("[1]")
    with pytest.raises(door.FileRefused, match="holds a JSON list, not an object"):
        door.read_json(tmp_path / "x.json", "x", expect=dict)
    assert door.read_json(tmp_path / "x.json", "x", expect=list) == [1]


def test_a_link_out_of_the_folder_is_refused_and_one_inside_is_read(tmp_path):
    folder = tmp_path / "run"
    (folder / "sub").mkdir(parents=True)
    (tmp_path / "secret.txt").write_text("secret")
    (folder / "sub" / "own.txt").write_text("own")
    (folder / "out.txt").symlink_to(tmp_path / "secret.txt")
    (folder / "in.txt").symlink_to(folder / "sub" / "own.txt")
    (folder / "away").symlink_to(tmp_path)
    with pytest.raises(door.FileRefused, match="outside"):
        door.read_text(folder / "out.txt", "x", folder)
    with pytest.raises(door.FileRefused, match="outside"):  # a folder on the way that leads out
        door.read_text(folder / "away" / "secret.txt", "x", folder)
    assert door.read_text(folder / "in.txt", "x", folder) == "own"
    assert door.read_text(folder / "out.txt", "x") == "secret"  # no root: the user named the file


def test_a_hub_snapshots_links_into_its_blobs_are_inside(tmp_path):
    repository = tmp_path / "models--org--name"
    (repository / "blobs").mkdir(parents=True)
    (repository / "snapshots" / "abc").mkdir(parents=True)
    (repository / "blobs" / "1234").write_text("{}")
    (repository / "snapshots" / "abc" / "config.json").symlink_to("../../blobs/1234")
    assert door.read_json(repository / "snapshots" / "abc" / "config.json", "x", repository / "snapshots" / "abc") == {}


def test_a_copy_never_follows_a_link_and_lands_whole(tmp_path):
    source = tmp_path / "run"
    (source / "checkpoints").mkdir(parents=True)
    (source / "eval.json").write_text("[]")
    (source / "secret.txt").symlink_to("/etc/hostname")
    with pytest.raises(door.FileRefused, match="symbolic link"):
        door.copy_tree(source, tmp_path / "copy", "run")
    assert not (tmp_path / "copy").exists() and [p.name for p in tmp_path.iterdir()] == ["run"]
    (source / "secret.txt").unlink()
    os.mkfifo(source / "checkpoints" / "pipe")
    with pytest.raises(door.FileRefused, match="FIFO"):
        within(10, door.copy_tree, source, tmp_path / "copy", "run")
    (source / "checkpoints" / "pipe").unlink()
    door.copy_tree(source, tmp_path / "copy", "run", ignore=lambda name: name == "eval.json")
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == ["checkpoints"]


def test_a_copy_larger_than_the_free_disk_is_refused_before_it_starts(tmp_path, monkeypatch):
    source = tmp_path / "run"
    source.mkdir()
    (source / "weights").write_bytes(b"x" * 100)
    monkeypatch.setattr(door.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100, 90, 10))
    with pytest.raises(DiskFullError, match="needs 100 bytes"):
        door.copy_tree(source, tmp_path / "copy", "run")
    assert not (tmp_path / "copy").exists()


def test_a_delete_never_goes_through_a_link(tmp_path):
    mine = tmp_path / "mydata"
    (mine / "seed-0").mkdir(parents=True)
    (mine / "seed-0" / "keep.txt").write_text("mine")
    out = tmp_path / "ablation"
    (out / "runs").mkdir(parents=True)
    (out / "runs" / "cell").symlink_to(mine)
    with pytest.raises(door.FileRefused, match="outside"):
        door.remove_tree(out / "runs" / "cell" / "seed-0", out, "ablation folder")
    (out / "runs" / "other").symlink_to(out / "runs")  # a link that stays inside, as the folder to delete itself
    with pytest.raises(door.FileRefused, match="symbolic link"):
        door.remove_tree(out / "runs" / "other", out, "ablation folder")
    assert (mine / "seed-0" / "keep.txt").read_text() == "mine"


def test_a_listing_is_bounded(tmp_path):
    for index in range(5):
        (tmp_path / str(index)).write_text("")
    with pytest.raises(door.FileRefused, match="more than 3 entries"):
        door.list_folder(tmp_path, "folder", limit=3)
    assert [entry.name for entry in door.list_folder(tmp_path, "folder")] == ["0", "1", "2", "3", "4"]


def test_the_bounds_are_above_the_real_files_they_guard():
    """Each bound against the largest real file of its kind (the figures in door.py's comments)."""
    assert door.JSON_BYTES > 34_000_000  # Gemma's tokenizer.json
    assert door.CONFIG_BYTES > 878_907  # the largest ablation.json of docs/results
    assert door.CAPTIONS_BYTES > 151_000_000  # COCO's Karpathy dataset_coco.json
    assert door.PICKLE_BYTES > 155_000_000  # CIFAR-100's train file
    json.loads("[" * (door.JSON_DEPTH - 1) + "]" * (door.JSON_DEPTH - 1))  # the bound is below Python's own limit
