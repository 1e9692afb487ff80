#!/usr/bin/env bash
# The Python packages lmtier needs that the lent GPU machines' image lacks (it has
# torch, cupy, numpy, xxhash, msgpack, pyyaml, grpcio, pytest, hypothesis), as wheels
# for its Python 3.12 in .whl/ (git-ignored, ~4 MB), to carry there. Run here, then:
#
#   run(carry=[".whl"], command="python3 -m pip install -q --no-index --no-deps
#       --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#       && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
#       && python3 benchmarks/gpu_check.py")
#
# (one line; `--only copy_kernels pytest_gpu` for the copy kernels alone).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl \
    pydantic pydantic-core pydantic-settings typing-inspection annotated-types \
    python-dotenv cbor2 grpcio-health-checking "protobuf>=7.35.1,<8"
ls .whl
