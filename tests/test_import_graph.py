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
    """Failed before: the Layout table left out eleven modules."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme[readme.index("## Layout"):readme.index("## Benchmarks")]
    source = ROOT / "src" / "topoclip"
    missing = [str(path.relative_to(source)) for path in sorted(source.rglob("*.py")) if path.name != "__init__.py"
               and f"`{path.name}`" not in layout and f"`{path.relative_to(source)}`" not in layout]
    assert missing == []
