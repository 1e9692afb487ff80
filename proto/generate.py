"""Regenerate the sidecar's Python stubs from ``proto/lmtier/v1/*.proto``.

    python proto/generate.py          # write lmtier/v1/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python proto/generate.py --check  # exit 1 if the committed stubs differ from a fresh run

The stubs are committed (``lmtier/v1/``) so that installing lmtier needs no protoc; the
check (run by the test suite) keeps them equal to the sources. It needs the pinned
grpcio-tools of the ``grpc`` extra: another protoc version writes other bytes.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PACKAGE = Path("lmtier") / "v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def sources() -> list[Path]:
    """Every .proto of the API, relative to ``proto/``."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PACKAGE).glob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Run protoc (grpc_tools) over every source into ``out``; the stub paths written."""
    from grpc_tools import protoc  # noqa: PLC0415 - the grpc extra; --help works without it

    protos = sources()
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed (see above)")
    return [p.with_suffix("").with_name(p.stem + s) for p in protos for s in SUFFIXES]


def check() -> list[str]:
    """Stubs that a fresh run would change (missing, different or stale), by path."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        problems = [
            str(PACKAGE.parent / rel)
            for rel in fresh
            if not (ROOT / rel).exists() or not filecmp.cmp(Path(tmp) / rel, ROOT / rel, False)
        ]
    expected = {ROOT / rel for rel in fresh}
    stale = [p for s in SUFFIXES for p in (ROOT / PACKAGE).glob(f"*{s}") if p not in expected]
    return problems + [f"{p.relative_to(ROOT)} (no .proto makes it)" for p in stale]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for problem in problems:
            print(f"stale: {problem}", file=sys.stderr)
        if problems:
            print("run: python proto/generate.py", file=sys.stderr)
        return 1 if problems else 0
    for path in generate(ROOT):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
