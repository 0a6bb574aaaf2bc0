#!/usr/bin/env bash
# Start `grpo-jax train` on every worker of a TPU VM / pod slice, in the background, one log per worker.
set -euo pipefail
HERE=${BASH_SOURCE[0]%/*}; [[ $HERE != "${BASH_SOURCE[0]}" ]] || HERE=.
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<EOF2
Usage: $PROG [options]

On every worker (--worker=all), in REMOTE_DIR (made by setup.sh), start
  .venv/bin/grpo-jax train --config CONFIG --output RUN_DIR --set distributed.enabled=true [--set ...]
under nohup, detached from the ssh session; each worker writes its own LOG, and the process id
to REMOTE_DIR/train.pid. All workers must run the same command: on a pod slice the hosts form one
JAX job. Follow the run with logs.sh, stop it with
  gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all --command 'kill \$(cat ~/grpo_jax/train.pid)'

Options:
  --config FILE      run config, relative to REMOTE_DIR, e.g. configs/your_run.yaml [CONFIG]
  --output RUN_DIR   run directory: gs://BUCKET/PATH, or relative to REMOTE_DIR or absolute [RUN_DIR]
  --allow-local-output
                     accept a RUN_DIR on the workers' disks on a multi-host or Spot slice (refused
                     otherwise: see below)
  --set KEY=VALUE    config override, repeatable (e.g. --set mesh.fsdp=8 --set train.steps=500)
  --log FILE         log file on each worker, relative to REMOTE_DIR (default train.log) [LOG_FILE]
  --remote-dir DIR   project directory on the workers (default ~/grpo_jax) [REMOTE_DIR]

A RUN_DIR that is not on gs:// lives on the workers' own disks. Unless --allow-local-output is
given, $PROG first reads the slice ('gcloud compute tpus tpu-vm describe': its network endpoints,
one per worker VM, and its scheduling) and refuses such a RUN_DIR on several hosts (each would
keep only its own shards of every checkpoint) or on a Spot/preemptible slice (a preempted one
cannot be restarted, only created again, so what its disks held is gone).

$COMMON_HELP

Example:
  $PROG --name grpo-v5e-32 --zone us-west4-a --project my-project \\
      --config configs/your_run.yaml --output gs://my-bucket/runs/v5e-32 --set mesh.fsdp=32
EOF2
}

CONFIG=${CONFIG:-}
RUN_DIR=${RUN_DIR:-}
LOG_FILE=${LOG_FILE:-train.log}
SETS=(--set distributed.enabled=true)
ALLOW_LOCAL=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --config) need_value "$@"; CONFIG=$2; shift 2 ;;
    --output) need_value "$@"; RUN_DIR=$2; shift 2 ;;
    --set)
      need_value "$@"
      [[ $2 == ?*=* ]] || die "--set needs KEY=VALUE, got '$2'"
      SETS+=(--set "$2"); shift 2 ;;
    --log) need_value "$@"; LOG_FILE=$2; shift 2 ;;
    --allow-local-output) ALLOW_LOCAL=1; shift ;;
    --remote-dir) need_value "$@"; REMOTE_DIR=$2; shift 2 ;;
    *) parse_common "$@"; shift "$SHIFT" ;;
  esac
done
require_location
require CONFIG --config
require RUN_DIR --output
require_gcloud

# Refuse a run directory that a preemption or the other hosts' shards would make incomplete; the
# slice itself says how many hosts it has and whether it is Spot, so nothing here assumes a topology.
check_local_output() {
  local describe=(gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone "$ZONE" --project "$PROJECT"
    --format 'value(networkEndpoints[].ipAddress,schedulingConfig.spot,schedulingConfig.preemptible)')
  if [[ $DRY_RUN == 1 ]]; then
    run "${describe[@]}"
    return
  fi
  local out ips semicolons hosts=0
  out=$(run "${describe[@]}") ||
    die "could not describe $TPU_NAME to check --output $RUN_DIR; fix that, or pass --allow-local-output"
  ips=${out%%$'\t'*}  # value() joins a list with ';' and separates the fields with tabs
  semicolons=${ips//[^;]/}
  [[ -z $ips ]] || hosts=$((${#semicolons} + 1))
  local use="use --output gs://BUCKET/PATH (or --allow-local-output)"
  if ((hosts > 1)); then
    die "--output $RUN_DIR is on the workers' own disks, but $TPU_NAME has $hosts hosts and each would keep only its own shards of every checkpoint: $use"
  fi
  if [[ ${out#"$ips"} == *True* ]]; then
    die "--output $RUN_DIR is on the worker's own disk, but $TPU_NAME is a Spot/preemptible slice, which is recreated, not restarted, after a preemption: $use"
  fi
}
if [[ $RUN_DIR != gs://* && $ALLOW_LOCAL == 0 ]]; then check_local_output; fi

train=".venv/bin/grpo-jax train --config $(quote "$CONFIG") --output $(quote "$RUN_DIR")"
for word in "${SETS[@]}"; do train+=" $(quote "$word")"; done
log=$(quote "$LOG_FILE")
mkdir_log=""
if [[ $LOG_FILE == */* ]]; then mkdir_log="mkdir -p $(quote "${LOG_FILE%/*}") && "; fi
# nohup + redirecting all three streams lets the ssh session end while training goes on.
tpu_ssh all "cd $(quote_remote_path "$REMOTE_DIR") && ${mkdir_log}{ nohup $train > $log 2>&1 < /dev/null & echo \$! > train.pid; }"
