"""The house rules of the source tree, checked on the code itself: imports point one
way (core <- backends, connector, apps), each module imports only its own floor or the
floors below it (:data:`FLOORS`), the server is no one's dependency but the command
that runs it, the core never loads what an extra installs, and no two modules import
each other (directly or around a loop; an import under ``if TYPE_CHECKING:`` or inside
a function counts: a loop of types or lazy imports is still a tangle)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import ROOT

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
FLOORS: tuple[dict[str, tuple[str, ...]], ...] = (
    # Lowest first. Each floor holds rooms (a room: the modules under its prefixes); a
    # module may import its own room and any room on a lower floor, never a room beside
    # it or above it. A module is in the room of its longest matching prefix.
    {"base": ("lmtier.errors", "lmtier.extras", "lmtier.secret")},  # stdlib only
    {"chunks": ("lmtier.chunks",)},  # naming and framing chunks
    {"config": ("lmtier.config",)},  # the typed configuration
    {"storage": ("lmtier.storage",)},  # tiers, the StorageManager, the host pool
    {"rpc": ("lmtier.v1",)},  # the generated gRPC stubs
    {
        "wire": ("lmtier.wire",),  # what both ends of the sidecar and the peer tier share
        "events": ("lmtier.events",),  # KV events on ZMQ, in vLLM's format
    },
    {  # the facade: everything else at lmtier's top (the package's exports included)
        "facade": ("lmtier",),
    },
    {"remote": ("lmtier.remote",)},  # the engine's client of a sidecar
    {
        "sidecar": ("lmtier.sidecar",),  # ``lmtier serve``
        "ops": ("lmtier.ops",),  # the operations commands
        "testing": ("lmtier.testing",),  # a test tier, the conformance suite
    },
    {"backends": ("lmtier_backends",)},
    {"connector": ("lmtier_connector",)},
    {"apps": ("lmtier_apps",)},
)
SERVER = "lmtier.sidecar"
"""The ``lmtier serve`` server: only what runs it (apps, the CLI) may import it."""
NEVER_THE_SERVER = ("lmtier_backends", "lmtier.remote", "lmtier.wire")
"""Code that runs outside the server (a backend in any process, an engine's client,
the format both ends share) must not load it."""


def modules() -> Iterator[tuple[str, Path]]:
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            yield name, path


def imports(path: Path) -> set[str]:
    """Modules ``path`` imports, anywhere: at module level, under ``if TYPE_CHECKING:``
    and inside functions (``from a import b`` yields ``a`` and ``a.b``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def inside(module: str, prefix: str) -> bool:
    """Whether ``module`` is ``prefix`` or below it."""
    return module == prefix or module.startswith(prefix + ".")


def room_of(module: str) -> tuple[int, str]:
    """The floor (0: lowest) and room :data:`FLOORS` put ``module`` in."""
    matches = [
        (len(prefix), floor, room)
        for floor, rooms in enumerate(FLOORS)
        for room, prefixes in rooms.items()
        for prefix in prefixes
        if inside(module, prefix)
    ]
    assert matches, f"{module} is on no floor: add it to FLOORS"
    _, floor, room = max(matches)
    return floor, room


def edges() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (anywhere in it), but a package's
    ``__init__`` importing its own modules: that is how packages export, not a cycle."""
    known = dict(modules())
    return {
        name: {m for m in imports(path) if m in known and m != name and not inside(m, name)}
        for name, path in known.items()
    }


@pytest.mark.parametrize(("name", "path"), list(modules()), ids=str)
def test_imports_point_one_way(name: str, path: Path) -> None:
    banned = FORBIDDEN.get(name.split(".", maxsplit=1)[0], set())
    found = imports(path)
    used = {module.split(".")[0] for module in found}
    assert not used & banned, f"{name} imports {sorted(used & banned)}"
    if name.startswith("lmtier_connector"):  # engines use the facade: the one door
        inside = sorted(m for m in found if m.startswith("lmtier.storage"))
        assert inside == [], f"{name} reaches into {inside}; import it from lmtier"


GRAPH = edges()


def test_every_subpackage_has_a_floor() -> None:
    """A new folder under lmtier/ is placed in :data:`FLOORS` on purpose, not by default
    in the facade's room."""
    named = {prefix for rooms in FLOORS for prefixes in rooms.values() for prefix in prefixes}
    folders = {f"lmtier.{p.parent.name}" for p in (ROOT / "lmtier").glob("*/__init__.py")}
    assert folders - named == set()


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_keep_to_their_floors(name: str) -> None:
    floor, room = room_of(name)
    wrong = []
    for target in sorted(GRAPH[name]):
        their_floor, their_room = room_of(target)
        if their_floor > floor or (their_floor == floor and their_room != room):
            wrong.append(f"{target} ({their_room})")
    assert wrong == [], f"{name} ({room}) imports {wrong}: a floor above it or a room beside it"


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_clients_and_backends_never_import_the_server(name: str) -> None:
    if any(inside(name, outside) for outside in NEVER_THE_SERVER):
        server = sorted(t for t in GRAPH[name] if inside(t, SERVER))
        assert server == [], f"{name} imports the server: {server}"


def test_no_import_cycles() -> None:
    graph = GRAPH
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
