#!/usr/bin/env bash
# Set everything up (./.venv) and run the demo training loop with asynchronous checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
