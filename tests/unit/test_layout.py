"""The house rules of the source tree, checked on the code itself: imports point one
way (core <- backends, connector), the core never loads what an extra installs, and
no two modules import each other (directly or around a loop)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "lmtier": ROOT / "lmtier",
    "lmtier_backends": ROOT / "backends" / "lmtier_backends",
    "lmtier_connector": ROOT / "connector" / "lmtier_connector",
    "lmtier_apps": ROOT / "apps" / "lmtier_apps",
}
FORBIDDEN = {
    "lmtier": {"lmtier_backends", "lmtier_connector", "lmtier_apps", "redis", "boto3"}
    | {"botocore", "vllm", "transformers"},
    "lmtier_backends": {"lmtier_connector", "lmtier_apps", "torch", "vllm", "transformers"},
    "lmtier_connector": {"lmtier_apps"},
}


def modules() -> Iterator[tuple[str, Path]]:
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            yield name, path


def imports(path: Path, *, top_level_only: bool) -> set[str]:
    """Modules ``path`` imports (at module level only, or anywhere)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.If) and top_level_only:  # `if TYPE_CHECKING:` is no import
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize(("name", "path"), list(modules()), ids=str)
def test_imports_point_one_way(name: str, path: Path) -> None:
    banned = FORBIDDEN.get(name.split(".", maxsplit=1)[0], set())
    found = imports(path, top_level_only=False)
    used = {module.split(".")[0] for module in found}
    assert not used & banned, f"{name} imports {sorted(used & banned)}"
    if name.startswith("lmtier_connector"):  # engines use the facade: the one door
        inside = sorted(m for m in found if m.startswith("lmtier.storage"))
        assert inside == [], f"{name} reaches into {inside}; import it from lmtier"


def test_no_import_cycles() -> None:
    known = dict(modules())
    graph = {
        name: {m for m in imports(path, top_level_only=True) if m in known and m != name}
        for name, path in known.items()
    }
    # A package's __init__ importing its own modules is how packages export: not a cycle.
    graph = {
        name: {m for m in targets if not m.startswith(name + ".")}
        for name, targets in graph.items()
    }
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for neighbour in sorted(graph[node]):
            if state.get(neighbour) == 1:
                cycle = [*path[path.index(neighbour) :], neighbour]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if neighbour not in state:
                visit(neighbour)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_modules_stay_small() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules()}
    # lmtier.v1 is generated from proto/ (proto/generate.py), not written by hand.
    written = {n: lines for n, lines in sizes.items() if not n.startswith("lmtier.v1.")}
    assert {name: n for name, n in written.items() if n > 500} == {}
