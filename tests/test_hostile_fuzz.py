"""Property tests over what a file or a flag may hold (issue #41): config values (from `--set`, a preset file and a
run folder's config.json) and tokenizer files. Whatever the value: exit 0 or 2, one line on stderr, no
traceback, nothing written outside the named folder. Derandomized, so every run draws the same examples."""
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topoclip.cli import main
from topoclip.config import load_config
from topoclip.config.loading import valid_keys
from topoclip.core.errors import UserError
from topoclip.run.training.trainer import train

SMALL = ["train.num_workers=0", "train.threads=1", "train.warmup_steps=1", "evaluate.size=16",
         'evaluate.template_modes=["distance"]', "data.scenes.train_size=256", "data.scenes.val_size=32",
         "data.scenes.test_size=32", "train.steps=1"]
FUZZ = settings(max_examples=60, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# Values a hostile file may hold: integers past int64 and past Python's 4,300-digit conversion, non-finite
# floats, NUL and lone surrogates, deep and wide nesting.
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2**62, max_value=2**80),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
                    st.sampled_from(["\0", "\ud800", "../../x", "{pipe:touch X; cat a.,b.}tar", "pipe:id",
                                     "{https://example.invalid/a,b}.tar", "9" * 5000, "-1", "1e400", "[[[[[[[["]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                            max_size=4), max_leaves=12)
KEYS = st.sampled_from(valid_keys())


def one_line_or_success(status: int, err: str) -> None:
    assert status in (0, 2)
    assert "Traceback" not in err
    if status == 2:
        assert err.count("\n") == 1 and err.startswith("topoclip: error: "), err


def as_text(value) -> str:
    try:
        return json.dumps(value, allow_nan=True)
    except ValueError:  # an integer of 4,300+ digits: typed as its digits
        return str(value) if not isinstance(value, int) else "9" * 5000


@FUZZ
@given(pairs=st.lists(st.tuples(KEYS, values), min_size=1, max_size=3))
def test_set_values_are_a_config_or_one_line(pairs):
    overrides = [f"{key}={as_text(value)}" for key, value in pairs]
    try:
        load_config("tiny", SMALL + overrides)
    except UserError as error:
        assert "\n" not in str(error)


# A preset file: its known top-level keys (a "base" among them) with hostile values, or anything at all.
presets = values | st.dictionaries(st.sampled_from(["base", "name", "description", "model", "train", "data", "evaluate"]),
                                   values | st.sampled_from(["tiny", "cpu-multi", "../../etc/passwd"]), max_size=4)


@FUZZ
@given(preset=presets)
def test_a_preset_file_is_a_config_or_one_line(tmp_path_factory, preset):
    file = tmp_path_factory.mktemp("preset") / "preset.json"
    file.write_text(as_text(preset), encoding="utf-8", errors="surrogatepass")
    try:
        load_config(str(file), SMALL)
    except UserError as error:
        assert "\n" not in str(error)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return train(load_config("tiny", SMALL), out_dir=tmp_path_factory.mktemp("run") / "run", progress=False)


def set_path(values: dict, key: str, value) -> None:
    *sections, last = key.split(".")
    for section in sections:
        values = values.setdefault(section, {}) if isinstance(values.get(section, {}), dict) else {}
    values[last] = value


@pytest.mark.slow
@FUZZ
@given(pairs=st.lists(st.tuples(KEYS.filter(lambda key: key not in ("train.steps", "train.eval_every")), values),
                      min_size=1, max_size=3))
def test_a_run_folders_config_resumes_or_is_one_line(run, tmp_path_factory, capfd, pairs):
    """A finished run whose config.json anyone edited: `train --resume` says it is complete (0) or refuses (2);
    nothing is written but inside the run folder, and no command runs."""
    root = tmp_path_factory.mktemp("fuzz")
    folder = root / "run"
    shutil.copytree(run, folder)
    values = json.loads((folder / "config.json").read_text())
    for key, value in pairs:
        set_path(values, key, value)
    (folder / "config.json").write_text(as_text(values), encoding="utf-8", errors="surrogatepass")
    status = main(["train", "--resume", str(folder), "--quiet"])
    one_line_or_success(status, capfd.readouterr().err)
    assert sorted(path.name for path in root.iterdir()) == ["run"] and not Path("X").exists()


@pytest.mark.slow
@FUZZ
@given(edits=st.lists(st.tuples(st.sampled_from(["truncation", "padding", "normalizer", "pre_tokenizer", "model",
                                                 "post_processor", "decoder", "added_tokens"]),
                                st.sampled_from([None, "max_length", "type", "vocab", "pattern", "Regex", "id"]),
                                values), min_size=1, max_size=3))
def test_a_checkpoints_tokenizer_file_loads_or_is_one_line(run, tmp_path_factory, capfd, edits):
    from topoclip.io.checkpoint import step_checkpoints

    folder = tmp_path_factory.mktemp("checkpoint") / "checkpoint"
    shutil.copytree(step_checkpoints(run / "checkpoints")[-1], folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    for section, key, value in edits:
        if key is None or not isinstance(tokenizer.get(section), dict):
            tokenizer[section] = value
        else:
            tokenizer[section][key] = value
    (folder / "tokenizer.json").write_text(as_text(tokenizer), encoding="utf-8", errors="surrogatepass")
    image = folder.parent / "x.png"
    from PIL import Image

    Image.new("RGB", (9, 9), (200, 10, 10)).save(image)
    status = main(["predict", str(folder), "--labels", "a red circle,a blue square", "--image", str(image)])
    one_line_or_success(status, capfd.readouterr().err)


# ------------------------------------------------------------------ issue #58: grid and pool files, transformers
# configs, Hub ids and ablation folders

GRID_KEYS = ["description", "preset", "settings", "zero_shot_set", "axes", "paper"]
LEVEL_KEYS = ["label", "preset", "set", "logit_range_like"]
levels = st.lists(st.dictionaries(st.sampled_from(LEVEL_KEYS), values | st.sampled_from(["a", "tiny", "train.steps=1"]),
                                  max_size=4) | values, max_size=4)
axes = st.lists(st.fixed_dictionaries({"name": values | st.just("a"), "levels": levels}) | values, max_size=3)
grid_files = values | st.dictionaries(st.sampled_from(GRID_KEYS), values | axes | st.just("tiny"), max_size=6)


@FUZZ
@given(grid=grid_files, seeds=st.integers(min_value=1, max_value=10**12))
def test_a_grid_file_plans_or_is_one_line(tmp_path_factory, grid, seeds):
    """Whatever a grid file holds: its runs are planned, or one line says why, before anything is written."""
    from topoclip.experiments import grid as grids

    folder = tmp_path_factory.mktemp("grid")
    (folder / "grid.json").write_text(as_text(grid), encoding="utf-8", errors="surrogatepass")
    try:
        grids.plan(grids.load_grid(str(folder / "grid.json")), folder / "out", seeds, SMALL)
    except UserError as error:
        assert "\n" not in str(error)
    assert not (folder / "out").exists()


def readme_results():
    from topoclip.experiments import results

    return results


@FUZZ
@given(pool=st.dictionaries(st.sampled_from(["about", "parts", "seeds"]), values | st.lists(st.sampled_from(
    ["part", "../part", "", "x" * 300]), max_size=3), max_size=3), part=values)
def test_a_pool_file_is_read_or_refused_in_one_line(tmp_path_factory, pool, part):
    module = readme_results()
    results, before = tmp_path_factory.mktemp("results"), module.files.RESULTS
    (results / "pool.json").write_text(as_text({**pool, "parts": pool.get("parts", [])}), encoding="utf-8",
                                       errors="surrogatepass")
    (results / "part").mkdir()
    (results / "part" / "ablation.json").write_text(as_text(part), encoding="utf-8", errors="surrogatepass")
    module.files.RESULTS = results  # (hypothesis runs the examples in one test: no monkeypatch per example)
    try:
        module.load_results("pool")
    except (ValueError, OSError) as error:
        assert "\n" not in str(error)
    finally:
        module.files.RESULTS = before


@FUZZ
@given(model_type=st.sampled_from(["clip", "siglip"]),
       config=st.dictionaries(st.sampled_from(["text_config", "vision_config", "architectures", "model_type",
                                               "projection_dim"]), values, max_size=4),
       towers=st.dictionaries(st.sampled_from(["hidden_act", "layer_norm_eps", "num_attention_heads", "eos_token_id",
                                               "hidden_size", "intermediate_size", "vision_use_head", "num_channels",
                                               "projection_size", "max_position_embeddings"]), values, max_size=4))
def test_a_transformers_config_imports_or_is_one_line(tmp_path_factory, model_type, config, towers):
    """Any config.json of a transformers CLIPModel or SiglipModel folder: refused in one line before any weight is
    read (there are none here), never a traceback."""
    from topoclip.io.convert.hf import import_hf

    folder = tmp_path_factory.mktemp("hf")
    values = {"model_type": model_type, "text_config": dict(towers), "vision_config": dict(towers), **config}
    (folder / "config.json").write_text(as_text(values), encoding="utf-8", errors="surrogatepass")
    try:
        import_hf(folder)
    except (UserError, OSError) as error:
        assert "\n" not in str(error) or isinstance(error, OSError)


def protobuf_field(number: int, payload) -> bytes:
    """One protobuf field: a varint (int) or a length-delimited one (bytes)."""
    def varint(value: int) -> bytes:
        out = b""
        while True:
            out += bytes([(value & 0x7F) | (0x80 if value > 0x7F else 0)])
            value >>= 7
            if not value:
                return out
    if isinstance(payload, int):
        return varint(number << 3) + varint(payload)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


PIECE = st.builds(lambda text, score, kind: protobuf_field(1, protobuf_field(1, text.encode("utf-8", "surrogatepass"))
                                                           + b"\x15" + score + protobuf_field(3, kind)),
                  st.text(max_size=6), st.binary(min_size=4, max_size=4), st.integers(0, 7))


@FUZZ
@given(pieces=st.lists(PIECE, max_size=8), extra=st.binary(max_size=40), unk=st.integers(0, 9) | st.integers(0, 2**40),
       charsmap=st.binary(max_size=64))
def test_a_sentencepiece_file_reads_or_is_one_line(tmp_path_factory, pieces, extra, unk, charsmap):
    """Any spiece.model (pieces of any text, score and type; any unknown id; any character map; trailing bytes):
    a tokenizer that tokenizes, or one line, never a traceback or a Rust panic."""
    from topoclip.preprocess.tokenizer import Tokenizer

    file = tmp_path_factory.mktemp("spm") / "spiece.model"
    end = protobuf_field(1, protobuf_field(1, b"</s>") + b"\x15\x00\x00\x00\x00" + protobuf_field(3, 3))
    file.write_bytes(b"".join(pieces) + end + protobuf_field(2, protobuf_field(40, unk))
                     + protobuf_field(3, protobuf_field(2, charsmap)) + extra)
    try:
        tokenizer = Tokenizer.from_sentencepiece(file, context_length=8)
    except (ValueError, UserError) as error:
        assert "\n" not in str(error)
        return
    try:
        assert tokenizer(["a photo of a cat", "", "ünï\x00"]).input_ids.shape == (3, 8)
    except UserError as error:
        assert "\n" not in str(error)


@FUZZ
@given(name=st.text(max_size=120) | st.sampled_from(["../../etc", "org/name@..", "a/b@main", "a" * 200 + "/b",
                                                     "org/name@refs/pr/1", "org//name", "-org/name"]))
def test_a_hub_id_is_taken_or_refused_in_one_line(name):
    from topoclip.io.pretrained import split_revision

    try:
        repo, revision = split_revision(name, None)
    except UserError as error:
        assert "\n" not in str(error)
        return
    assert ".." not in repo and (revision is None or ".." not in revision) and repo.count("/") == 1


# An ablation folder anyone handed over: entries at the places ablate reads, each a file, a folder, a FIFO, or a link
# inside or out of it.
PLACES = ["runs", "runs/sphere", "runs/sphere/seed-0", "runs/sphere/seed-0/config.json",
          "runs/sphere/seed-0/eval.json", "runs/sphere/seed-0/checkpoints", "logs"]
KINDS = ["file", "folder", "fifo", "link out", "link in", "json"]


@FUZZ
@given(tree=st.dictionaries(st.sampled_from(PLACES), st.sampled_from(KINDS), max_size=5), reuse=st.booleans())
def test_an_ablation_folder_plans_or_is_one_line_and_nothing_outside_changes(tmp_path_factory, tree, reuse):
    import os

    from topoclip.experiments import grid as grids
    from topoclip.experiments.runner import reuse_runs

    root = tmp_path_factory.mktemp("ablation")
    outside = root / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    out = root / "out"
    for place in sorted(tree, key=len):
        path = out / place
        if any(parent.is_symlink() or (parent.exists() and not parent.is_dir()) for parent in path.parents):
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        kind = tree[place]
        if kind == "file":
            path.write_text("x")
        elif kind == "json":
            path.write_text("[" * 1000)
        elif kind == "folder":
            path.mkdir(exist_ok=True)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "link out":
            path.symlink_to(outside)
        else:
            path.symlink_to(out)
    grid = grids.Grid("g", "", "tiny", SMALL, [grids.Axis("topology", [grids.Level("topology", "sphere")])])
    try:
        specs = grids.plan(grid, root / "mine" if reuse else out, 1, ["train.steps=1"])
        if reuse:
            reuse_runs(specs, [out], log=lambda line: None)
    except UserError as error:
        assert "\n" not in str(error)
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]


# Captions as a stranger's table holds them: quotes anywhere, separators, line breaks, blanks.
captions = st.text(alphabet=st.sampled_from(list('ab "\',\t\r\n')), max_size=12)


@FUZZ
@given(rows=st.lists(captions, min_size=1, max_size=20), written=st.sampled_from(["csv", "joined"]),
       separator=st.sampled_from([",", "\t"]))
def test_a_caption_table_loses_no_row_without_a_word(tmp_path_factory, rows, written, separator):
    """Issue class: a stray quote made csv read the rows after it as one caption, silently. Whatever the captions:
    a table written by csv.writer reads back exactly; one joined by hand (no quoting) gives every row, or says in a
    warning or a one-line error where rows went."""
    import csv
    import io
    import warnings

    from topoclip.core.errors import ConfigError
    from topoclip.data.csv import read_caption_table

    table = tmp_path_factory.mktemp("table") / ("t.tsv" if separator == "\t" else "t.csv")
    if written == "csv":
        text = io.StringIO()
        csv.writer(text, delimiter=separator).writerows([["filepath", "title"], *([f"{i}.png", c] for i, c in enumerate(rows))])
        table.write_text(text.getvalue(), newline="")
    else:
        table.write_text("".join(f"{i}.png{separator}{c}\n" for i, c in enumerate(["title", *rows])).replace(
            "0.png", "filepath", 1), newline="")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            read = read_caption_table(table)
        except ConfigError as error:
            assert "\n" not in str(error) and written == "joined"
            return
    said = [str(warning.message) for warning in said]
    if written == "csv":
        assert read == [(f"{i}.png", c) for i, c in enumerate(rows)]
        assert bool(said) == any(c in "\r\n" for c in "".join(rows))  # a line break in a caption is said, nothing else
    elif len(read) < len(rows):
        assert said, (rows, read)


@FUZZ
@given(text=st.text(alphabet=st.sampled_from(list('a "\',\t')), max_size=16), separator=st.sampled_from([",", "\t"]),
       quoted=st.booleans())
def test_the_quote_state_is_csvs_own(text, separator, quoted):
    """topoclip.data.csv.quoted_after (what stands in for a line too long to read) against csv itself: a line leaves a
    quoted field open exactly when csv reads the next line into the same row."""
    import csv

    from topoclip.data.csv import quoted_after

    opening = ['"\n'] if quoted else []  # a field opened on a line before
    rows = list(csv.reader([*opening, text + "\n", "next\n"], delimiter=separator))
    assert quoted_after(text + "\n", separator, quoted) == (rows[-1] != ["next"])
