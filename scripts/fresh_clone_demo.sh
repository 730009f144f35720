#!/usr/bin/env bash
# Run the README's first command as a new user would: in a fresh clone of the committed HEAD,
# with a venv of its own (never the test venv), nothing preinstalled. CI runs this beside the
# tests: a runtime dependency that only the test extras install cannot hide from it.
set -euo pipefail
top=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
cmd=$(grep -E '^bash ' "$top/README.md" | head -n 1 | sed 's/#.*//')
[ -n "$cmd" ] || { echo "fresh_clone_demo: the README has no first command" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone -q "$top" "$work/clone"
cd "$work/clone"
echo "fresh clone of $(git rev-parse --short HEAD) in $work/clone; running: $cmd"
if ! env -u VIRTUAL_ENV -u PYTHONPATH bash -c "$cmd" > "$work/out.log" 2>&1; then
  echo "FAILED: the README's first command on a fresh clone; last lines:" >&2
  grep -v '^WARNING: Location' "$work/out.log" | tail -n 30 >&2
  exit 1
fi
tail -n 3 "$work/out.log"
echo "OK: the README's first command passed on a fresh clone with a fresh venv"
