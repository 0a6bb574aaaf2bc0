#!/usr/bin/env bash
# The device check for a lent GPU machine (run from the repo root; results land in $OUT).
# Uses the machine's own jax/flax/torch/transformers: nothing is installed there.
#   1. the model parity, KV-cache and sampler tests on the GPU backend (fp32, highest matmul precision);
#   2. sampler and forward throughput, bf16, grpo_jax vs transformers on the same weights;
#   3. whole GRPO steps at Qwen3-0.6B's shape, bf16 (bench grpo-step; needs tensorflow-datasets there).
set -uo pipefail
. benchmarks/accelerator_common.sh
$PY -c "import jax, flax, torch, transformers; print('jax', jax.__version__, 'flax', flax.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, jax.devices())" 2>&1 | tee "$OUT/versions.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  JAX_PLATFORMS=${PARITY_PLATFORM:-cuda} timeout 240 $PY -m pytest -q -p no:cacheprovider \
    tests/models/test_models_parity.py tests/engine/test_sampling.py -k "fp32 or kv_cache or prefill or greedy or logprobs" \
    2>&1 | tail -15 | tee "$OUT/tests.txt"
fi
# bench entries: which,preset,args... separated by spaces
for spec in ${BENCH_SPECS:-sampler,qwen3-0.6b,--prompts=4,--group-size=16,--new-tokens=128 forward,llama3.2-1b,--batch=16,--seq=1024}; do
  IFS=, read -r which preset rest <<<"$spec"
  timeout 200 $PY -m grpo_jax bench "$which" --preset "$preset" ${rest//,/ } --dtype "${BENCH_DTYPE:-bfloat16}" \
    --iters 5 --output "$OUT/${which}_$preset.json" 2>&1 | grep -v "Writing model shards\|original_max" | tail -3
done
if [ -z "${SKIP_GRPO_STEP:-}" ]; then
  timeout 300 "$PY" -m grpo_jax bench grpo-step --config benchmarks/configs/qwen3_0.6b_gpu.yaml \
    --set data.data_dir="$OUT/tfds" --output "$OUT/grpo_step_qwen3-0.6b.json" 2>&1 | tail -3
fi
