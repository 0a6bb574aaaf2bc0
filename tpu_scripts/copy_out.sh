#!/usr/bin/env bash
# Copy a run directory (metrics, TensorBoard events, checkpoints) from worker 0 or a bucket.
set -euo pipefail
HERE=${BASH_SOURCE[0]%/*}; [[ $HERE != "${BASH_SOURCE[0]}" ]] || HERE=.
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<EOF2
Usage: $PROG [options]

Copy RUN_DIR (as given to launch.sh --output) into DEST/: from a worker's disk with
'gcloud compute tpus tpu-vm scp --recurse', or, when RUN_DIR is a gs:// bucket path, with
'gcloud storage cp -r' (then --name, --zone and --project are not needed).

Options:
  --output RUN_DIR   the run directory: relative to REMOTE_DIR, absolute, or gs://... [RUN_DIR]
  --dest DIR         local directory to copy into (default runs) [DEST_DIR]
  --worker N         worker to copy from (default 0)
  --remote-dir DIR   project directory on the workers (default ~/grpo_jax) [REMOTE_DIR]

$COMMON_HELP

Example:
  $PROG --name grpo-v5e-8 --zone us-west4-a --project my-project --output runs/v5e-8
EOF2
}

RUN_DIR=${RUN_DIR:-}
DEST_DIR=${DEST_DIR:-runs}
WORKER=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --output) need_value "$@"; RUN_DIR=$2; shift 2 ;;
    --dest) need_value "$@"; DEST_DIR=$2; shift 2 ;;
    --worker) need_value "$@"; WORKER=$2; shift 2 ;;
    --remote-dir) need_value "$@"; REMOTE_DIR=$2; shift 2 ;;
    *) parse_common "$@"; shift "$SHIFT" ;;
  esac
done
[[ $WORKER =~ ^[0-9]+$ ]] || die "--worker must be a worker number, got '$WORKER'"
require RUN_DIR --output
RUN_DIR=${RUN_DIR%/}

if [[ $RUN_DIR == gs://* ]]; then
  require_gcloud
  run mkdir -p "$DEST_DIR"
  run gcloud storage cp -r "$RUN_DIR" "$DEST_DIR"
else
  require_location
  require_gcloud
  # scp's remote paths are relative to the home directory, where ~/ would not expand.
  src=$RUN_DIR
  if [[ $src != /* ]]; then src=${REMOTE_DIR%/}/$src; fi
  src=${src#"~/"}
  run mkdir -p "$DEST_DIR"
  run gcloud compute tpus tpu-vm scp --recurse "$TPU_NAME:$src" "$DEST_DIR" \
    --zone "$ZONE" --project "$PROJECT" "--worker=$WORKER"
fi
