#!/usr/bin/env bash
# Create a TPU VM or pod slice, on demand or through a (spot) queued resource.
set -euo pipefail
HERE=${BASH_SOURCE[0]%/*}; [[ $HERE != "${BASH_SOURCE[0]}" ]] || HERE=.
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<EOF
Usage: $PROG [options] [-- extra gcloud flags]

Create a TPU VM (single host, e.g. v5litepod-8) or pod slice (several hosts, e.g. v5litepod-32).
By default 'gcloud compute tpus tpu-vm create' (on demand). With --spot or --queued it files a
queued resource named NAME whose node is also called NAME; it waits in the queue until capacity
is free (see 'gcloud compute tpus queued-resources describe NAME --zone ZONE').

Options:
  --accelerator-type TYPE   e.g. v5litepod-8, v5litepod-32 [ACCELERATOR_TYPE]
  --runtime-version VER     TPU VM image, e.g. v2-alpha-tpuv5-lite [RUNTIME_VERSION]
  --spot                    spot capacity via 'queued-resources create ... --spot' (preemptible, cheaper;
                            a preempted slice cannot be restarted: delete.sh --queued, then create.sh,
                            setup.sh and launch.sh again, with the run directory on gs://)
  --queued                  on-demand capacity via a queued resource (waits instead of failing)
  -- FLAGS...               passed on to gcloud (e.g. -- --network my-net --internal-ips)

$COMMON_HELP

Example:
  $PROG --name grpo-v5e-32 --zone us-west4-a --project my-project \\
      --accelerator-type v5litepod-32 --runtime-version v2-alpha-tpuv5-lite --spot
EOF
}

ACCELERATOR_TYPE=${ACCELERATOR_TYPE:-}
RUNTIME_VERSION=${RUNTIME_VERSION:-}
MODE=on-demand
EXTRA=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --accelerator-type) need_value "$@"; ACCELERATOR_TYPE=$2; shift 2 ;;
    --runtime-version) need_value "$@"; RUNTIME_VERSION=$2; shift 2 ;;
    --spot) MODE=spot; shift ;;
    --queued) MODE=queued; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) parse_common "$@"; shift "$SHIFT" ;;
  esac
done
require_location
require ACCELERATOR_TYPE --accelerator-type
require RUNTIME_VERSION --runtime-version
require_gcloud

if [[ $MODE == on-demand ]]; then
  run gcloud compute tpus tpu-vm create "$TPU_NAME" --zone "$ZONE" --project "$PROJECT" \
    --accelerator-type "$ACCELERATOR_TYPE" --version "$RUNTIME_VERSION" ${EXTRA[@]+"${EXTRA[@]}"}
else
  spot=()
  if [[ $MODE == spot ]]; then spot=(--spot); fi
  run gcloud compute tpus queued-resources create "$TPU_NAME" --node-id "$TPU_NAME" \
    --zone "$ZONE" --project "$PROJECT" --accelerator-type "$ACCELERATOR_TYPE" \
    --runtime-version "$RUNTIME_VERSION" ${spot[@]+"${spot[@]}"} ${EXTRA[@]+"${EXTRA[@]}"}
fi
