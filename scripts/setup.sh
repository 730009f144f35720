#!/usr/bin/env bash
# Sets up everything mpckpt needs in ./.venv (idempotent): Python packages, the CPU build of
# torch when torch is missing, and (with --test) the test servers: Azurite from npm, moto.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
pip_install() { "$VPY" -m pip install --disable-pip-version-check -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
if ! "$VPY" -c "import torch" 2>/dev/null; then
  pip_install "torch==2.13.0"
fi
# The package itself, editable, with the extras the demo and tests use.
if [ "${1:-}" = "--test" ]; then
  # torch pinned along: a framework's install must never replace the CPU build
  pip_install -e ".[test,azure,s3]" "torch==2.13.0"
  if [ ! -x .tools/node_modules/.bin/azurite-blob ]; then
    mkdir -p .tools
    (cd .tools && npm install --silent --no-audit --no-fund --prefix . azurite@3 >/dev/null)
  fi
else
  pip_install -e .
fi
"$VPY" -c "import torch, mpckpt" || { echo "setup failed: torch or mpckpt does not import" >&2; exit 1; }
