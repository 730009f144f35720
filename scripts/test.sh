#!/usr/bin/env bash
# Set everything up (./.venv, test servers' packages) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/ruff check mpckpt tests examples scripts harness
.venv/bin/python -m mypy mpckpt
.venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"  # the manual: a broken link or a page left out fails
if [ $# -gt 0 ]; then  # a selection of one's own: as given, in this process
  exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
# The whole suite on two workers (pytest-xdist; a module's tests stay on one worker), then the few
# tests marked `alone` by themselves: they check what a reaper of dead processes' shared memory did,
# and any open in a parallel worker reaps the whole machine's.
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not alone" --durations=25  # (the slowest: CI's time)
exec .venv/bin/python -m pytest -q -p no:cacheprovider -m alone
