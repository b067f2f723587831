"""The library's import graph (scripts/import_graph.py): no circles, and nothing of the library proper imports the
trainer, the experiments or the command line (issue #46)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(import_graph)


def test_the_library_has_no_import_circle_and_no_arrow_back_up():
    edges = import_graph.graph()
    assert len(edges) > 50 and "topoclip.run_folder" in edges["topoclip.training.trainer"]
    assert import_graph.circles(edges) == []
    assert import_graph.arrows_back_up(edges) == []


def test_an_import_inside_a_function_counts(tmp_path, monkeypatch):
    """Failed before: checkpoint.py ↔ training/run_folder.py, hidden by imports inside functions."""
    package = tmp_path / "topoclip"
    (package / "training").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "training" / "__init__.py").write_text("")
    (package / "checkpoint.py").write_text("from topoclip.training.run_folder import CONFIG\n")
    (package / "training" / "run_folder.py").write_text("def f():\n    from topoclip.checkpoint import STEP\n")
    monkeypatch.setattr(import_graph, "SOURCE", tmp_path)
    edges = import_graph.graph()
    assert import_graph.circles(edges) == [["topoclip.checkpoint", "topoclip.training.run_folder"]]
    assert import_graph.arrows_back_up(edges) == [("topoclip.checkpoint", "topoclip.training.run_folder")]


def test_the_readmes_layout_names_every_module():
    """Failed before: the Layout table left out eleven modules (and evaluation/run.py passed unnamed, its name being
    in the command line's row): a module in a folder is named in a row of its folder."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = [line for line in readme[readme.index("## Layout"):readme.index("## Benchmarks")].splitlines()
            if line.startswith("| ")]
    source = ROOT / "src" / "topoclip"
    missing = []
    for path in sorted(source.rglob("*.py")):
        relative = path.relative_to(source)
        if path.name == "__init__.py" or f"`{relative.as_posix()}`" in "".join(rows):
            continue
        folder = "" if relative.parent == Path(".") else f"{relative.parent.as_posix()}/"
        if not any(f"`{path.name}`" in row and (not folder or f"`{folder}" in row) for row in rows):
            missing.append(relative.as_posix())
    assert missing == []
