#!/usr/bin/env bash
# The mixture-of-experts CPU demo, with and without routing replay (configs/demo_cpu_moe.yaml):
# each run's config, metrics and command go to benchmarks/results/moe/<arm>/, and
# benchmarks/figures.py writes RESULTS.md's MoE table from them. About 5 minutes an arm on 2 cores.
#   bash benchmarks/moe_demo.sh            # every arm
#   bash benchmarks/moe_demo.sh replay     # one arm: replay (routing_replay: sampler) or free (none), in
#                                          # float32; replay_bf16 / free_bf16 compute in bfloat16, where the
#                                          # sampler's decode steps and the learner's full pass round apart
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
arms=("${@:-replay free replay_bf16 free_bf16}")
for arm in ${arms[@]}; do
  case $arm in
    replay) mode=sampler; extra="" ;;
    free) mode=none; extra="" ;;
    replay_bf16) mode=sampler; extra="--set model.dtype=bfloat16" ;;
    free_bf16) mode=none; extra="--set model.dtype=bfloat16" ;;
    *) echo "unknown arm $arm (replay, free, replay_bf16, free_bf16)" >&2; exit 2 ;;
  esac
  out=$(mktemp -d)/run
  dest=benchmarks/results/moe/$arm
  mkdir -p "$dest"
  cmd="grpo-jax train --config configs/demo_cpu_moe.yaml --output runs/demo_moe_$arm --set moe.routing_replay=$mode $extra"
  commit=$(git rev-parse --short HEAD)  # the code that runs (HEAD may move while it does)
  start=$(date +%s)
  JAX_PLATFORMS=cpu $PY -m grpo_jax train --config configs/demo_cpu_moe.yaml --output "$out" \
    --set moe.routing_replay=$mode $extra > "$dest/summary.json"
  end=$(date +%s)
  cp "$out/metrics.jsonl" "$out/config.yaml" "$dest/" 2>/dev/null || cp "$out/metrics.jsonl" "$dest/"
  $PY - "$dest" "$cmd" "$((end - start))" "$commit" <<'PY'
import json, sys, datetime
dest, cmd, seconds, commit = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
summary = json.loads(open(f"{dest}/summary.json").read().strip().splitlines()[-1])
json.dump({"date": datetime.date.today().isoformat(), "machine": "this project's 2-core CPU machine",
           "commit": commit, "command": cmd, "wall_s": seconds, "summary": summary},
          open(f"{dest}/run.json", "w"), indent=1)
PY
  rm -f "$dest/summary.json"
done
