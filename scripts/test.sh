#!/usr/bin/env bash
# Set everything up (./.venv, test servers' packages) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/ruff check mpckpt tests examples scripts harness
.venv/bin/python -m mypy mpckpt
.venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"  # the manual: a broken link or a page left out fails
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
