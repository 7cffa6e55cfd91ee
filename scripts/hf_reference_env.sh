#!/usr/bin/env bash
# Creates .venv-hf: a separate Python with PyTorch (CPU) and Hugging Face transformers, which the
# tests use as the reference for jmoe's model families and checkpoint conversion. jmoe itself never
# imports torch. Python 3.11 is preferred where a CPU wheel of torch 2.13 is at hand; elsewhere pip
# fetches torch from the package index. Run from the project root; a second run does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv-hf/bin/python ] && .venv-hf/bin/python -c "import torch, transformers" 2>/dev/null; then
  exit 0
fi
py=$(command -v python3.11 || command -v python3.12 || command -v python3)
rm -rf .venv-hf
"$py" -m venv .venv-hf
.venv-hf/bin/pip install -q torch==2.13.0 transformers==5.17.0 safetensors numpy
