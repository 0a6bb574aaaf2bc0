#!/usr/bin/env bash
# Delete a TPU VM / pod slice, or the queued resource that created it.
set -euo pipefail
HERE=${BASH_SOURCE[0]%/*}; [[ $HERE != "${BASH_SOURCE[0]}" ]] || HERE=.
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<EOF2
Usage: $PROG [options]

Delete the TPU VM or pod slice NAME ('gcloud compute tpus tpu-vm delete'). For one made with
create.sh --spot or --queued pass --queued: it deletes the queued resource NAME together with its
node ('queued-resources delete --force'); deleting only the node would leave the request behind.

Options:
  --queued     delete the queued resource NAME and its node
  --yes        do not ask for confirmation (gcloud --quiet)

$COMMON_HELP

Example:
  $PROG --name grpo-v5e-32 --zone us-west4-a --project my-project --queued --yes
EOF2
}

QUEUED=0
YES=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --queued) QUEUED=1; shift ;;
    --yes) YES=(--quiet); shift ;;
    *) parse_common "$@"; shift "$SHIFT" ;;
  esac
done
require_location
require_gcloud

if [[ $QUEUED == 1 ]]; then
  run gcloud compute tpus queued-resources delete "$TPU_NAME" --zone "$ZONE" --project "$PROJECT" \
    --force ${YES[@]+"${YES[@]}"}
else
  run gcloud compute tpus tpu-vm delete "$TPU_NAME" --zone "$ZONE" --project "$PROJECT" ${YES[@]+"${YES[@]}"}
fi
