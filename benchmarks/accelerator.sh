#!/usr/bin/env bash
# The device check for a lent GPU machine (run from the repo root; results land in $OUT).
# Uses the machine's own jax/flax/torch/transformers: nothing is installed there.
#   1. the model parity and KV-cache tests on the GPU backend (fp32, highest matmul precision);
#   2. forward (prefill) throughput, bf16, grpo_jax vs transformers on the same weights.
set -uo pipefail
OUT=${OUT:-/tmp/grpo_jax_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import jax, flax, torch, transformers; print('jax', jax.__version__, 'flax', flax.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, jax.devices())" 2>&1 | tee "$OUT/versions.txt"
JAX_PLATFORMS=${PARITY_PLATFORM:-cuda} timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_models_parity.py \
  -k "fp32 or kv_cache or bf16" 2>&1 | tail -15 | tee "$OUT/parity.txt"
# preset,batch,seq entries separated by spaces
for spec in ${BENCH_SPECS:-qwen3-0.6b,16,1024 llama3.2-1b,16,1024}; do
  IFS=, read -r preset batch seq <<<"$spec"
  timeout 150 $PY benchmarks/forward.py --preset "$preset" --batch "$batch" --seq "$seq" \
    --dtype "${BENCH_DTYPE:-bfloat16}" --iters 10 --output "$OUT/forward_$preset.json" 2>&1 | grep -v "Writing model shards" | tail -3
done
