#!/usr/bin/env bash
# Put the project and a Python venv with grpo_jax[tpu] on every worker of a TPU VM / pod slice.
set -euo pipefail
HERE=${BASH_SOURCE[0]%/*}; [[ $HERE != "${BASH_SOURCE[0]}" ]] || HERE=.
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<EOF2
Usage: $PROG [options]

On every worker (--worker=all): put the project in REMOTE_DIR, create REMOTE_DIR/.venv with a
Python >= 3.11 (tpu_scripts/worker_venv.sh, which prints the one it used) and pip install -e '.[tpu]'
there. The code comes from a local checkout (default: the one holding
this script; tracked and untracked-but-not-ignored files, so uncommitted edits travel too),
packed with git + tar, copied with 'gcloud compute tpus tpu-vm scp' and unpacked; or, with
--repo, from 'git clone' on each worker. Safe to run again (updates code and packages).

Options:
  --repo URL         clone this git URL on the workers instead of copying a checkout [REPO_URL]
  --ref REF          branch, tag or commit to check out with --repo (default HEAD, the remote's
                     default branch) [REPO_REF]
  --source DIR       local checkout to copy (default: $SOURCE_DEFAULT) [SOURCE_DIR]
  --remote-dir DIR   project directory on the workers (default ~/grpo_jax) [REMOTE_DIR]
  --python PY        Python (3.11+) on the workers that makes the venv [PYTHON] (default: the first
                     of python3.12, python3.11, python3 that is 3.11+, else Python 3.12 from uv,
                     installed with pip --user; the v5e image's python3 is 3.10)

$COMMON_HELP
In --dry-run the local temporary directory's name is a placeholder.

Example:
  $PROG --name grpo-v5e-32 --zone us-west4-a --project my-project
  $PROG --name grpo-v5e-32 --zone us-west4-a --project my-project \\
      --repo https://github.com/you/grpo_jax.git --ref main
EOF2
}

SOURCE_DEFAULT=$(cd "$HERE/.." && pwd)
REPO_URL=${REPO_URL:-}
REPO_REF=${REPO_REF:-HEAD}
SOURCE_DIR=${SOURCE_DIR:-$SOURCE_DEFAULT}
PYTHON=${PYTHON:-}
while [[ $# -gt 0 ]]; do
  case $1 in
    --repo) need_value "$@"; REPO_URL=$2; shift 2 ;;
    --ref) need_value "$@"; REPO_REF=$2; shift 2 ;;
    --source) need_value "$@"; SOURCE_DIR=$2; shift 2 ;;
    --remote-dir) need_value "$@"; REMOTE_DIR=$2; shift 2 ;;
    --python) need_value "$@"; PYTHON=$2; shift 2 ;;
    *) parse_common "$@"; shift "$SHIFT" ;;
  esac
done
require_location
require_gcloud

dir=$(quote_remote_path "$REMOTE_DIR")
# The interpreters the workers will try, in order, are part of the printed command (and so of --dry-run).
pythons="--uv 3.12 python3.12 python3.11 python3"
if [[ -n $PYTHON ]]; then pythons=$(quote "$PYTHON"); fi
venv="cd $dir && bash tpu_scripts/worker_venv.sh $pythons"
venv+=" && .venv/bin/pip install -q -U pip && .venv/bin/pip install -q -e '.[tpu]'"

if [[ -n $REPO_URL ]]; then
  fetch="{ test -d $dir/.git || git clone -q $(quote "$REPO_URL") $dir; }"
  fetch+=" && git -C $dir fetch -q origin $(quote "$REPO_REF") && git -C $dir checkout -q --detach FETCH_HEAD"
  tpu_ssh all "$fetch && $venv"
else
  if [[ $DRY_RUN == 1 ]]; then
    tmp=${TMPDIR:-/tmp}/grpo_jax.XXXXXX
  else
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
  fi
  archive=$tmp/grpo_jax-src.tar.gz
  # Tracked and untracked-but-not-ignored files; a tracked file deleted in the work tree is skipped.
  # shellcheck disable=SC2016  # $f belongs to the inner bash
  list='git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d "" f; do [ ! -e "$f" ] || printf "%s\0" "$f"; done'
  run bash -o pipefail -c "cd $(quote "$SOURCE_DIR") && $list | COPYFILE_DISABLE=1 tar -czf $(quote "$archive") --null -T -"
  run gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME:grpo_jax-src.tar.gz" --zone "$ZONE" --project "$PROJECT" --worker=all
  tpu_ssh all "mkdir -p $dir && tar -xzf ~/grpo_jax-src.tar.gz -C $dir && rm ~/grpo_jax-src.tar.gz && $venv"
fi
