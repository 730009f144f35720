#!/usr/bin/env bash
# Run the README's first command as a new user would: in a fresh clone of the committed HEAD,
# with a venv of its own (never the test venv), nothing preinstalled; then the try-out that opens
# docs/guide/command-line.md (the demo keeping its checkpoints, `mpckpt export`), in the same
# clone. CI runs this beside the tests: a runtime dependency that only the test extras install
# cannot hide from it.
set -euo pipefail
top=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
cmd=$(grep -E '^bash ' "$top/README.md" | head -n 1 | sed 's/#.*//')
[ -n "$cmd" ] || { echo "fresh_clone_demo: the README has no first command" >&2; exit 2; }
# the command-line guide's try-out: the demo with a root, then the export of its last step
guide=docs/guide/command-line.md
tryout=$(sed -n '/^## Try it/,/^## /p' "$top/$guide" \
         | grep -E '^(bash scripts/demo.sh --root |\.venv/bin/mpckpt export )' | sed 's/ *#.*//')
[ "$(printf '%s\n' "$tryout" | grep -c .)" -ge 2 ] || {
  echo "fresh_clone_demo: the 'Try it' section of $guide has no demo-then-export try-out" >&2; exit 2; }
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
while IFS= read -r line; do
  echo "running $guide's try-out: $line"
  if ! env -u VIRTUAL_ENV -u PYTHONPATH bash -c "$line" > "$work/tryout.log" 2>&1; then
    echo "FAILED: $guide's '$line' on a fresh clone; last lines:" >&2
    tail -n 30 "$work/tryout.log" >&2
    exit 1
  fi
  if grep -q -E 'UserWarning|Failed to initialize NumPy' "$work/tryout.log"; then
    echo "FAILED: $guide's '$line' printed a warning on a fresh clone:" >&2
    grep -E -B2 -A2 'UserWarning|Failed to initialize' "$work/tryout.log" | tail -n 20 >&2
    exit 1
  fi
done <<< "$tryout"
.venv/bin/python -c "from safetensors.torch import load_file; n = len(load_file('model.safetensors')); assert n, n; print(f'model.safetensors: {n} tensors')"
echo "OK: $guide's demo-then-export try-out passed on the fresh clone"
