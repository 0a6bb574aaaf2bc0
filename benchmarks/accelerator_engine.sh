#!/usr/bin/env bash
# Issue 42 on a lent GPU: `grpo-jax bench engine` on the long-tailed workload (static in batches, static
# all, continuous, paged at the continuous engine's KV bytes), where a decode step's cost hardly grows
# with its rows, the regime the paged engine is for. The machine has JAX but not tensorflow-datasets:
# wheels carried in .device_wheels (pip download --only-binary ... on the host) are installed without
# resolution first. Results land in $OUT.
set -uo pipefail
. benchmarks/accelerator_common.sh
if [ -d .device_wheels ]; then
  "$PY" -m pip install -q --no-index --no-deps .device_wheels/*.whl 2>&1 | tail -3
fi
"$PY" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" 2>&1 | tee "$OUT/versions.txt"
timeout "${ENGINE_TIMEOUT:-420}" "$PY" -m grpo_jax bench engine --config benchmarks/configs/engine_long_tail.yaml \
  --set sampling.page_size=32 --paged-slots 96 --set data.data_dir=/tmp/grpo_jax_tfds \
  --output "$OUT/long_tail_gpu.json" 2>&1 | grep -v "Writing model shards" | tail -30
