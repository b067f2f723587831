"""The import graph of src/topoclip: circles and arrows back up, counting imports inside functions too.

    python scripts/import_graph.py          # prints each circle and each arrow back up; exit 1 when there is one

A module imports another when any `import`/`from … import` in it names that module (or a name of a package that is
itself a module), at any depth of the file. Loading a package's __init__ on the way to a submodule is not an arrow.
An arrow back up is a module of the library proper (anything but the command line, `topoclip.training` and
`topoclip.experiments`) importing from one of those three; they may import the library.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "src"
UPPER = ("topoclip.training", "topoclip.experiments", "topoclip.cli", "topoclip.__main__")  # above the library


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


def arrows_back_up(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(library module, upper module) for each import from the library proper into the trainer, the experiments or
    the command line."""
    def upper(name: str) -> bool:
        return name.startswith(UPPER)

    return sorted((a, b) for a, targets in edges.items() if not upper(a) for b in targets if upper(b))


def main() -> int:
    edges = graph()
    found, back = circles(edges), arrows_back_up(edges)
    for component in found:
        print("circle: " + ", ".join(component))
    for a, b in back:
        print(f"arrow back up: {a} -> {b}")
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports: {len(found)} circles, {len(back)} arrows back up")
    return 1 if found or back else 0


if __name__ == "__main__":
    sys.exit(main())
