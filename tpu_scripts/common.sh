# shellcheck shell=bash
# Shared helpers for the tpu_scripts/*.sh scripts (sourced, not run).
# Written to run on macOS's bash 3.2 too (tested with bash 5 only): no namerefs, no mapfile,
# empty arrays expanded as ${a[@]+"${a[@]}"}.

DRY_RUN=0
REMOTE_DIR=${REMOTE_DIR:-"~/grpo_jax"}   # expanded by the workers' shell, not here
PROG=${0##*/}

die() {
  printf '%s: error: %s\n' "$PROG" "$*" >&2
  exit 2
}

# Shell-quote one word so that a printed command can be pasted back into a shell.
quote() {
  local safe='^[A-Za-z0-9_./:=,@%+-]+$'
  if [[ $1 =~ $safe ]]; then
    printf '%s' "$1"
  elif [[ $1 != *[\"\$\`\\!]* ]]; then
    printf '"%s"' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# Quote a path for the workers' shell, keeping a leading ~/ unquoted so that it expands there.
# shellcheck disable=SC2088  # the ~/ here is meant literally, for the remote shell
quote_remote_path() {
  case $1 in
    "~/"*) printf '~/%s' "$(quote "${1#??}")" ;;
    *) quote "$1" ;;
  esac
}

# Print a command as "+ cmd args"; in --dry-run mode stop there, otherwise run it.
run() {
  local line="+" word
  for word in "$@"; do line+=" $(quote "$word")"; done
  if [[ $DRY_RUN == 1 ]]; then
    printf '%s\n' "$line"
  else
    printf '%s\n' "$line" >&2
    "$@"
  fi
}

# Fail unless the variable named $1 is set (from the environment or the flag named $2).
require() {
  [[ -n ${!1:-} ]] || die "missing $1: pass $2 or set the environment variable $1"
}

# Every real run needs gcloud; a dry run must not.
require_gcloud() {
  [[ $DRY_RUN == 1 ]] || command -v gcloud >/dev/null 2>&1 ||
    die "gcloud not found on PATH: install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install) or use --dry-run"
}

# Options every script accepts. Sets SHIFT (read by the caller's loop) to the number of words consumed; unknown options fail.
# shellcheck disable=SC2034  # SHIFT, TPU_NAME, ZONE, PROJECT are read by the sourcing script
parse_common() {
  case $1 in
    --name) need_value "$@"; TPU_NAME=$2; SHIFT=2 ;;
    --zone) need_value "$@"; ZONE=$2; SHIFT=2 ;;
    --project) need_value "$@"; PROJECT=$2; SHIFT=2 ;;
    --dry-run) DRY_RUN=1; SHIFT=1 ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown option '$1' (see $PROG --help)" ;;
  esac
}

need_value() {
  [[ $# -ge 2 && $2 != --* ]] || die "option $1 needs a value (see $PROG --help)"
}

# shellcheck disable=SC2034  # printed by each script's usage
COMMON_HELP='Common options (each can also come from the environment variable in brackets):
  --name NAME        TPU VM / pod slice name [TPU_NAME]
  --zone ZONE        zone, e.g. us-west4-a [ZONE]
  --project PROJECT  Google Cloud project id [PROJECT]
  --dry-run          print the commands ("+ gcloud ...", one per line) and exit; needs no gcloud
  -h, --help         this help'

require_location() {
  require TPU_NAME --name
  require ZONE --zone
  require PROJECT --project
}

# gcloud compute tpus tpu-vm ssh on the given worker(s) (a number or "all"), running one command line.
tpu_ssh() {
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --project "$PROJECT" "--worker=$1" --command "$2"
}
