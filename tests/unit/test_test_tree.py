"""The test tree's own rules: it mirrors the code, helpers live in one package, and
pytest can import every test module.

* Helpers are in ``tests/support`` (an importable package on pytest's ``pythonpath``),
  never bare modules beside tests: a bare module is importable only from its own
  folder, so another tree copied it instead.
* ``tests/unit`` and ``tests/integration`` are split by area like the code: each
  folder is named after a package of the product (or ``project`` for the checkout's
  own files), so a newcomer finds a part's tests by its folder name.
* Test modules have unique names: pytest imports them by file name (``prepend``
  mode, no ``__init__.py``), and two ``test_x.py`` in two folders fail collection.
* Whether a unit test starts a process is checked as it runs (``tests/unit/conftest.py``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from support import ROOT, TESTS

SUPPORT = TESTS / "support"
DATA = {TESTS / "plugins"}
"""Folders of data, not tests: a third party's installed backend (its dist-info)."""
AREAS = {
    # lmtier's subpackages
    "chunks",
    "config",
    "storage",
    "wire",
    "events",
    "remote",
    "sidecar",
    "v1",
    "ops",
    # the packages beside it, by folder
    "backends",
    "connector",
    "apps",
    # below those: their own subpackages
    "disk",
    "fleet",
    "route",
    "redis",
    "s3",
    "peer",
    "vllm",
    "sglang",
    "warm",
    # the checkout's own files: .ci/run, docs, extras, benchmarks
    "project",
    "benchmarks",
}
"""Folder names a test tree may use: the code's areas."""
CODE = {
    "backends": ROOT / "backends" / "lmtier_backends",
    "connector": ROOT / "connector" / "lmtier_connector",
    "apps": ROOT / "apps" / "lmtier_apps",
}


def python_files() -> list[Path]:
    return [
        path
        for path in TESTS.rglob("*.py")
        if not any(folder in path.parents for folder in DATA) and "__pycache__" not in path.parts
    ]


def test_helpers_live_in_the_support_package() -> None:
    stray = [
        str(path.relative_to(TESTS))
        for path in python_files()
        if SUPPORT not in path.parents
        and not path.name.startswith("test_")
        and path.name != "conftest.py"
    ]
    assert stray == [], f"move helpers into tests/support: {stray}"
    assert (SUPPORT / "__init__.py").is_file()


def test_test_modules_have_unique_names() -> None:
    names = Counter(path.name for path in python_files() if path.name.startswith("test_"))
    assert [name for name, count in names.items() if count > 1] == []


def test_the_trees_are_split_by_the_codes_areas() -> None:
    for tree in ("unit", "integration"):
        for folder in (TESTS / tree).rglob("*"):
            if folder.is_dir() and folder.name != "__pycache__":
                assert folder.name in AREAS, f"tests/{tree}/{folder.relative_to(TESTS / tree)}"


def test_every_area_folder_names_code_that_exists() -> None:
    """A folder of tests for a subpackage that no longer exists is a leftover."""
    for tree in ("unit", "integration"):
        for folder in (TESTS / tree).iterdir():
            if not folder.is_dir() or folder.name in {"project", "benchmarks", "__pycache__"}:
                continue
            code = CODE.get(folder.name, ROOT / "lmtier" / folder.name)
            assert code.is_dir(), f"tests/{tree}/{folder.name} has no package {code}"
