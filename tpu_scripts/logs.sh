#!/usr/bin/env bash
# Stream the training log of one worker (default 0) or of all workers.
set -euo pipefail
HERE=${BASH_SOURCE[0]%/*}; [[ $HERE != "${BASH_SOURCE[0]}" ]] || HERE=.
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<EOF2
Usage: $PROG [options]

Follow (tail -F) the log that launch.sh started on a worker. With --worker all every worker's
lines arrive interleaved, each prefixed with that worker's hostname. Ctrl-C stops following;
training goes on.

Options:
  --worker N|all     which worker (default 0) [WORKER]
  --lines N          lines of history to show first (default 100)
  --no-follow        print the last lines and exit
  --log FILE         log file on the workers, relative to REMOTE_DIR (default train.log) [LOG_FILE]
  --remote-dir DIR   project directory on the workers (default ~/grpo_jax) [REMOTE_DIR]

$COMMON_HELP

Example:
  $PROG --name grpo-v5e-32 --zone us-west4-a --project my-project --worker all
EOF2
}

WORKER=${WORKER:-0}
LINES=100
FOLLOW=' -F'
LOG_FILE=${LOG_FILE:-train.log}
while [[ $# -gt 0 ]]; do
  case $1 in
    --worker) need_value "$@"; WORKER=$2; shift 2 ;;
    --lines) need_value "$@"; LINES=$2; shift 2 ;;
    --no-follow) FOLLOW=''; shift ;;
    --log) need_value "$@"; LOG_FILE=$2; shift 2 ;;
    --remote-dir) need_value "$@"; REMOTE_DIR=$2; shift 2 ;;
    *) parse_common "$@"; shift "$SHIFT" ;;
  esac
done
[[ $WORKER == all || $WORKER =~ ^[0-9]+$ ]] || die "--worker must be a worker number or 'all', got '$WORKER'"
[[ $LINES =~ ^[0-9]+$ ]] || die "--lines must be a number, got '$LINES'"
require_location
require_gcloud

cmd="cd $(quote_remote_path "$REMOTE_DIR") && tail -n $LINES$FOLLOW $(quote "$LOG_FILE")"
# shellcheck disable=SC2016  # $(hostname) is for the workers' shell
if [[ $WORKER == all ]]; then cmd+=' | sed -u "s/^/[$(hostname)] /"'; fi
tpu_ssh "$WORKER" "$cmd"
