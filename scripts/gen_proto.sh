#!/usr/bin/env bash
# Regenerate libs/gyre/v1/*_pb2*.py from proto/gyre/v1/*.proto (run by `make proto`).
# The generated code is committed; tests/unit/test_proto.py fails when it is stale.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-libs}
"$PY" -m grpc_tools.protoc -Iproto --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" proto/gyre/v1/*.proto
touch "$OUT/gyre/v1/__init__.py"
