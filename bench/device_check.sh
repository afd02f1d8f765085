#!/usr/bin/env bash
# One-shot GPU run for a machine with torch and triton but no vLLM and no
# network (the lent H200): the test suite on CUDA, then the GPU check.
#   device run:  bash bench/device_check.sh        (results under $OUT)
# kvfill is put on the path through a namespace shim, so nothing is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results}
mkdir -p "$out"
site=$(mktemp -d)
mkdir -p "$site/kvfill"
ln -s "$PWD/kernels" "$site/kvfill/kernels"
ln -s "$PWD/connector" "$site/kvfill/connector"
ln -s "$PWD/bench" "$site/kvfill/bench"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi -L || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
KVFILL_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -x tests 2>&1 | tee "$out/gpu-tests.log" | tail -15
"$PY" bench/gpu_check.py --out "$out" 2>&1 | tee "$out/gpu-check.log"
