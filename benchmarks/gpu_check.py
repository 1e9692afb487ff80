"""Every GPU check and figure in one call: the script a GPU session runs.

Runs each registered check in turn (each in a subprocess with its own timeout, so
one hang or crash cannot hide the others), prints one line per check as it finishes,
and ends with one JSON object: ``{"ok": ..., "device": ..., "<check>": {...}, ...}``.
Exits 0 when every check passed, 1 when one failed, 2 (with a one-line message)
when there is no CUDA device.

Adding a check: write a function that returns a dict with at least ``"ok"`` and
decorate it with ``@check("name", timeout_s=...)``; :func:`run_script` runs a
benchmark script and returns its last JSON line. Keep the total a few minutes.

Usage: python benchmarks/gpu_check.py [--only NAME ...] [--list]

On a lent GPU machine (the ``run`` tool), whose image lacks some of lmtier's packages:
``bash benchmarks/gpu_wheels.sh`` here first, then one call that carries ``.whl``
(the command is in that script).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
Result = dict[str, Any]
CHECKS: list[tuple[str, float, Callable[[float], Result]]] = []


def check(
    name: str, timeout_s: float
) -> Callable[[Callable[[float], Result]], Callable[[float], Result]]:
    """Register a check; it is called with its timeout and returns a dict with "ok"."""

    def register(fn: Callable[[float], Result]) -> Callable[[float], Result]:
        CHECKS.append((name, timeout_s, fn))
        return fn

    return register


def _env() -> dict[str, str]:
    # The checkout may not be pip-installed on the GPU machine: put its packages first.
    paths = [str(ROOT), str(ROOT / "connector"), str(ROOT / "backends")]
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, *([old] if old else [])])}


def run(args: list[str], timeout_s: float) -> tuple[int, str]:
    """Run a command in the repo root: (exit code, stdout + stderr); 124 on timeout."""
    try:
        done = subprocess.run(
            args,
            check=False,
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or b""
        text = out.decode(errors="replace") if isinstance(out, bytes) else out
        return 124, text + f"\n(timed out after {timeout_s:.0f} s)"
    return done.returncode, done.stdout + done.stderr


def last_json(code: int, output: str) -> Result:
    """A command's last JSON line, with "ok"; the output's tail when it failed."""
    lines = [line for line in output.strip().splitlines() if line.startswith("{")]
    if code != 0 or not lines:
        return {"ok": False, "exit_code": code, "tail": output[-3000:]}
    return {"ok": True, **json.loads(lines[-1])}


def run_script(script: str, args: list[str], timeout_s: float) -> Result:
    """Run ``benchmarks/<script>`` and return its last JSON line, with "ok"."""
    return last_json(*run([sys.executable, str(ROOT / "benchmarks" / script), *args], timeout_s))


@check("pytest_gpu", timeout_s=300)
def pytest_gpu(timeout_s: float) -> Result:
    """The GPU test suite (tests/gpu)."""
    args = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider"]
    code, output = run(args, timeout_s)
    lines = output.strip().splitlines()
    summary = lines[-1] if lines else ""
    # On a CUDA machine the suite must run: a summary without "passed" means all skipped.
    result: Result = {"ok": code == 0 and "passed" in summary, "summary": summary}
    if not result["ok"]:
        result["tail"] = output[-4000:]
    return result


@check("transfer", timeout_s=240)
def transfer(timeout_s: float) -> Result:
    """H2D/D2H of the transfer engine vs a pinned copy; layer-wise load overlap."""
    return run_script("bench_transfer.py", ["--quick", "--device", "cuda"], timeout_s)


@check("copy_kernels", timeout_s=240)
def copy_kernels(timeout_s: float) -> Result:
    """The fused copy kernels vs the torch path (save, load, overlap) on an 8B-class
    model's request, against a pinned copy; both paths bit-exact."""
    result = run_script("bench_copy_kernels.py", ["--quick"], timeout_s)
    figures = result.get("cuda")
    if result["ok"] and not (isinstance(figures, dict) and figures.get("bit_exact")):
        result["ok"] = False  # nothing measured (no cupy?), or the paths differ
    return result


@check("vllm_connector", timeout_s=240)
def vllm_connector(timeout_s: float) -> Result:
    """Worker-side save/load of the vLLM connector on CUDA pages (needs vLLM importable)."""
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks');"
        "from bench_vllm_connector import gpu_check_vllm_connector;"
        "print(json.dumps(gpu_check_vllm_connector()))"
    )
    return last_json(*run([sys.executable, "-c", code], timeout_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    args = parser.parse_args()
    if args.list:
        for name, timeout_s, fn in CHECKS:
            print(f"{name} ({timeout_s:.0f} s): {(fn.__doc__ or '').strip()}")
        return
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing run")
        sys.exit(2)
    results: Result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for name, timeout_s, fn in CHECKS:
        if args.only is not None and name not in args.only:
            continue
        start = time.perf_counter()
        try:
            result = fn(timeout_s)
        except Exception as exc:  # one broken check must not hide the others
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.perf_counter() - start, 1)
        results[name] = result
        print(f"== {name}: {'ok' if result['ok'] else 'FAILED'} {json.dumps(result)}", flush=True)
    results["ok"] = all(value["ok"] for value in results.values() if isinstance(value, dict))
    print(json.dumps(results))
    sys.exit(0 if results["ok"] else 1)


if __name__ == "__main__":
    main()
