"""The import graph of src/topoclip, by module and by folder (layer): circles, and arrows back up, counting imports
inside functions too.

    python scripts/import_graph.py          # prints each circle and each arrow back up; exit 1 when there is one

A module imports another when any `import`/`from … import` in it names that module (or a name of a package that is
itself a module), at any depth of the file. Loading a package's __init__ on the way to a submodule is not an arrow.

The folders of topoclip are layers, each importing only from those below it (LAYERS, lowest first): an arrow back
up is an import from a module of one layer into a module of a layer above it. A folder-level circle (a knot) is a
set of folders that import each other, however their modules do.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "src"
# The layers, lowest first: the mathematics and the door (core); text and pixels into model inputs (preprocess); the
# data sources and readers (data); the settings and their checks, which ask the data registry (config); the model
# (model); models and runs on disk (io); what runs a model: training, evaluation, inference (run); the analyses
# (analysis); the experiments and the report (experiments); the command line (cli, __main__).
LAYERS = ("core", "preprocess", "data", "config", "model", "io", "run", "analysis", "experiments", "cli", "__main__")


def module_name(file: Path) -> str:
    return ".".join(file.relative_to(SOURCE).with_suffix("").parts).removesuffix(".__init__")


def imports(file: Path, known: set[str]) -> set[str]:
    """The topoclip modules `file` names in any import statement."""
    package = module_name(file) if file.name == "__init__.py" else module_name(file).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            found |= {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known}
            found.add(base)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name in known and name != "topoclip"}


def graph() -> dict[str, set[str]]:
    files = {module_name(file): file for file in SOURCE.joinpath("topoclip").rglob("*.py")}
    known = set(files)
    return {name: imports(file, known) - {name} for name, file in files.items() if name != "topoclip"}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def folder(name: str) -> str:
    """The folder (layer) of a module: topoclip.io.checkpoint -> io."""
    return name.split(".")[1] if name.count(".") else name


def folder_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Folder -> the folders its modules import."""
    found: dict[str, set[str]] = {}
    for a, targets in edges.items():
        found.setdefault(folder(a), set()).update(folder(b) for b in targets if folder(b) != folder(a))
    return found


def arrows_back_up(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, module) for each import from a layer into a layer above it (see LAYERS); a folder not in LAYERS sits
    above them all."""
    def rank(name: str) -> int:
        return LAYERS.index(folder(name)) if folder(name) in LAYERS else len(LAYERS)

    return sorted((a, b) for a, targets in edges.items() for b in targets if rank(b) > rank(a))


def main() -> int:
    edges = graph()
    found, back = circles(edges) + circles(folder_graph(edges)), arrows_back_up(edges)
    for component in found:
        print("circle: " + ", ".join(component))
    for a, b in back:
        print(f"arrow back up: {a} -> {b}")
    print(f"{len(edges)} modules in {len(folder_graph(edges))} folders, {sum(map(len, edges.values()))} imports: "
          f"{len(found)} circles, {len(back)} arrows back up")
    return 1 if found or back else 0


if __name__ == "__main__":
    sys.exit(main())
