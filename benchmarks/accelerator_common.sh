# Sourced by the device scripts (benchmarks/accelerator*.sh): the output folder, the Python, and
# what the lent machine is (gpu.txt in $OUT).
OUT=${OUT:-/tmp/grpo_jax_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
