#!/usr/bin/env bash
# The GPU checks of issues 6 and 7 that need only torch and transformers, as one prepared run
# for a lent GPU machine without network (one H200; see README "GPU checks").
#
#   - training speed and MFU of the paper-shaped DFlash drafter (issue 7, target >= 40%),
#     flex_attention and SDPA backends;
#   - hook capture against a plain forward on a Qwen3-8B-shaped target (issue 6, >= 0.7x).
#
# The machine has torch, transformers, safetensors, fsspec, pyarrow, yaml and jinja2 but not
# pydantic; carry its wheels in .whl/ (python 3.12, manylinux):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl pydantic pydantic-core annotated-types typing-inspection
# and run, from the repo root:  bash benchmarks/device_checks.sh
# Results go to $OUT (or ./device-results). vLLM checks (issues 5, 6) are not here: the vllm
# wheel is far larger than what such a machine can be sent, so they need a GPU box with pip.
set -uo pipefail
OUT="${OUT:-device-results}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"
status=0
for backend in flex sdpa; do
  timeout 240 python3 -m benchmarks.train --qwen3-8b --steps 10 --backend "$backend" 2>&1 \
    | tee "$OUT/train-$backend.txt" || status=1
done
timeout 240 python3 -m benchmarks.feature_store --extract --random-qwen3-8b --batch 8 --seq 2048 2>&1 \
  | tee "$OUT/extract.txt" || status=1
exit $status
