#!/usr/bin/env bash
# The same GRPO workload (benchmarks/configs/peers.yaml) through grpo_jax, TRL's GRPOTrainer and
# Tunix's GRPOLearner, one after another, from the same saved random weights; prints a markdown
# table with each peer's step time over grpo_jax's. See benchmarks/peers/README.md.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"

# Pins that were measured to work together on CPU (2026-12).
TRL_SPEC="trl==1.16.0 torch==2.13.0"
TUNIX_SPEC="google-tunix==0.1.7 jax==0.10.2 jaxlib==0.10.2 flax==0.12.8"

usage() {
  cat <<EOF
Usage: benchmarks/peers/run.sh [--out DIR] [--systems LIST] [--warmup N] [--steps N]
                               [--micro-batch-rows N] [--rebuild]

Runs grpo_jax, TRL and Tunix on the peers workload (Llama-style 4 x 256, vocab 2048, random
weights; 8 prompts x 8 completions, 64 prompt + exactly 128 completion tokens; beta 0.04,
epsilon 0.2, mu 1, AdamW lr 1e-6, clip 1.0, float32), one after another (never in parallel),
and writes DIR/<system>.json, DIR/<system>.log and DIR/table.md.

  --out DIR        results directory (default: benchmarks/results/peers)
  --systems LIST   comma-separated subset of grpo_jax,trl,tunix (default: all three)
  --warmup N       warm-up steps (default 2; passed to the peer scripts only, grpo_jax reads
                   its step count from the config)
  --steps N        timed steps (default 5; likewise)
  --micro-batch-rows N
                   completions per forward/backward micro-batch of every system's update
                   (default 16: the fastest for grpo_jax here, benchmarks/RESULTS.md; 64 = one
                   pass over the whole batch); one generation and one AdamW step per step
  --rebuild        rebuild the peer virtualenvs and the shared weights
  -h, --help       this text

Built once and reused (delete them, or --rebuild, to start over):
  benchmarks/peers/.venv-trl     trl + torch (CPU wheel)          ($TRL_SPEC)
  benchmarks/peers/.venv-tunix   google-tunix on jax (CPU)         ($TUNIX_SPEC)
  benchmarks/peers/.weights      HF Llama checkpoint (torch seed 0, safetensors) and grpo_jax's
                                 character tokenizer, written by make_weights.py
Environment: GRPO_JAX_VENV (default: $ROOT/.venv), PYTHON (for the peer venvs, default python3).
EOF
}

OUT="$ROOT/benchmarks/results/peers"
SYSTEMS="grpo_jax,trl,tunix"
WARMUP=2
STEPS=5
MICRO_ROWS=16
REBUILD=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --out) OUT="$2"; shift 2 ;;
    --systems) SYSTEMS="$2"; shift 2 ;;
    --warmup) WARMUP="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --micro-batch-rows) MICRO_ROWS="$2"; shift 2 ;;
    --rebuild) REBUILD=1; shift ;;
    *) echo "run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

ROWS=64  # 8 prompts x G = 8
if ! [[ "$MICRO_ROWS" =~ ^[0-9]+$ ]] || (( MICRO_ROWS < 8 || ROWS % MICRO_ROWS || MICRO_ROWS % 8 )); then
  echo "run.sh: --micro-batch-rows must be a multiple of 8 (the group size) dividing $ROWS, got '$MICRO_ROWS'" >&2
  exit 2
fi
GRPO_JAX_VENV="${GRPO_JAX_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
WEIGHTS="$HERE/.weights"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
IFS=',' read -r -a SYSTEM_LIST <<< "$SYSTEMS"
for s in "${SYSTEM_LIST[@]}"; do
  case "$s" in grpo_jax|trl|tunix) ;; *) echo "run.sh: unknown system '$s' (grpo_jax, trl, tunix)" >&2; exit 2 ;; esac
done
wants() { [[ ",$SYSTEMS," == *",$1,"* ]]; }

# A virtualenv counts as built once its install finished with these exact pins (a marker file), so
# an interrupted install is redone rather than reused.
build_venv() {
  local venv="$1" spec="$2" marker="$1/.peers-installed"
  if [[ $REBUILD == 0 && -f "$marker" && "$(cat "$marker")" == "$spec" ]]; then
    echo "== reusing $venv ($spec)"
    return
  fi
  echo "== building $venv ($spec); this takes a few minutes"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  # shellcheck disable=SC2086  # the spec is a list of requirements
  "$venv/bin/pip" install --quiet $spec
  echo "$spec" > "$marker"
}

wants trl && build_venv "$HERE/.venv-trl" "$TRL_SPEC"
wants tunix && build_venv "$HERE/.venv-tunix" "$TUNIX_SPEC"

if [[ $REBUILD == 1 || ! -f "$WEIGHTS/model.safetensors" || ! -f "$WEIGHTS/tokenizer.json" ]]; then
  echo "== writing the shared random weights to $WEIGHTS"
  rm -rf "$WEIGHTS"
  "$GRPO_JAX_VENV/bin/python" "$HERE/make_weights.py" "$WEIGHTS"
else
  echo "== reusing the shared weights in $WEIGHTS"
fi

FAILED=()
# run SYSTEM CMD...: one system, its output in OUT/SYSTEM.log, its result in OUT/SYSTEM.json.
run() {
  local system="$1"; shift
  echo "== $system (log: $OUT/$system.log)"
  rm -f "$OUT/$system.json"
  if ! (cd "$ROOT" && HF_HUB_OFFLINE=1 "$@") 2>&1 | tee "$OUT/$system.log"; then
    echo "== $system FAILED (see $OUT/$system.log)" >&2
    FAILED+=("$system")
  elif [[ ! -f "$OUT/$system.json" ]]; then
    echo "== $system wrote no $OUT/$system.json" >&2
    FAILED+=("$system")
  fi
}

if wants grpo_jax; then
  run grpo_jax "$GRPO_JAX_VENV/bin/grpo-jax" bench grpo-step --config benchmarks/configs/peers.yaml \
    --set model.architecture=null --set "model.path=$WEIGHTS" --set "train.micro_batches=$((ROWS / MICRO_ROWS))" \
    --output "$OUT/grpo_jax.json"
fi
if wants trl; then
  run trl "$HERE/.venv-trl/bin/python" "$HERE/trl_step.py" --weights "$WEIGHTS" \
    --output "$OUT/trl.json" --warmup "$WARMUP" --steps "$STEPS" --micro-batch-rows "$MICRO_ROWS"
fi
if wants tunix; then
  run tunix "$HERE/.venv-tunix/bin/python" "$HERE/tunix_step.py" --weights "$WEIGHTS" \
    --output "$OUT/tunix.json" --warmup "$WARMUP" --steps "$STEPS" --micro-batch-rows "$MICRO_ROWS"
fi

echo
"$PYTHON" "$HERE/table.py" "$OUT" "${SYSTEM_LIST[@]}"
echo "(also in $OUT/table.md)"
if [[ ${#FAILED[@]} -gt 0 ]]; then
  echo "run.sh: failed: ${FAILED[*]}" >&2
  exit 1
fi
