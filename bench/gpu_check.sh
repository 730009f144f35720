#!/usr/bin/env bash
# The GPU checks of one lent machine, in one call: the CUDA tests, then bench/gpu_save.py.
#
# Runs on a machine whose python3 already has a CUDA torch (and numpy, psutil, fsspec, safetensors,
# xxhash, tqdm); mpckpt's other runtime needs come as wheels in .whl/ (multiprocess, dill,
# setproctitle; `pip download --only-binary=:all: --python-version 3.12 ...`). Logs and the bench's
# JSON go to $OUT (or bench/results/ without it). Each step has its own time limit, so a hung step
# leaves the others' figures:
#
#   bash bench/gpu_check.sh [TEST_LIMIT_S] [BENCH_LIMIT_S] [gpu_save.py arguments...]
#
# TEST_LIMIT_S 0 skips the tests. What the last lease left unmeasured, in one call (~5 min):
#   bash bench/gpu_check.sh 0 400 --tensors 2000,20000 --saves 5 --modes floor,floor_one,eager,overlap,first,pin_parts,restore
set -u
out=${OUT:-bench/results}
mkdir -p "$out"
test_limit=${1:-150}
bench_limit=${2:-270}
shift 2 2>/dev/null || shift $#
export PYTHONUNBUFFERED=1 MPCKPT_PROGRESS=0
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing .whl/ failed"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, mpckpt; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 1
echo "cpus $(nproc); $(free -g | awk '/Mem:/ {print $2" GiB memory"}'); /dev/shm $(df -h --output=size /dev/shm | tail -1)"
# a small /dev/shm would stop a 1 GiB state at its budget check: give it room where it has little
if [ "$(df --output=size -k /dev/shm | tail -1)" -lt 16000000 ]; then
    mount -o remount,size=32G /dev/shm && echo "/dev/shm now $(df -h --output=size /dev/shm | tail -1)"
fi
set -o pipefail
if [ "$test_limit" != 0 ]; then
    timeout "$test_limit" python3 -m pytest -q -p no:cacheprovider tests/integration/test_cuda.py 2>&1 | tee "$out/test_cuda.log"
    echo "test_cuda rc=$?"
fi
timeout "$bench_limit" python3 bench/gpu_save.py --out "$out/gpu_save.json" "$@" 2>&1 | tee "$out/gpu_save.log"
echo "gpu_save rc=$?"
