#!/usr/bin/env bash
# Run by setup.sh on each worker, in the project directory: make .venv with a Python >= 3.11.
# jax 0.10, flax 0.12.8 and orbax 0.12.8 need 3.11+; the v5e image (Ubuntu 22.04) ships 3.10.
set -euo pipefail
HERE=${BASH_SOURCE[0]%/*}; [[ $HERE != "${BASH_SOURCE[0]}" ]] || HERE=.
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$HERE/common.sh"

MIN=3.11  # keep in step with pyproject.toml's requires-python (tests/test_tpu_scripts.py checks)

usage() {
  cat <<EOF2
Usage: $PROG [--uv VERSION] PYTHON...

Make ./.venv (reusing one whose Python is already >= $MIN) with the first PYTHON on PATH that is
>= $MIN; with none, and --uv given, with a Python VERSION that uv provides (uv itself installed
with 'python3 -m pip install --user uv' when missing). Prints the interpreter used; fails with
one line when it cannot get one. Run by setup.sh on every worker, not by hand.
EOF2
}

UV_VERSION=
CANDIDATES=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --uv) need_value "$@"; UV_VERSION=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    -*) die "unknown option '$1' (see $PROG --help)" ;;
    *) CANDIDATES+=("$1"); shift ;;
  esac
done
[[ ${#CANDIDATES[@]} -gt 0 || -n $UV_VERSION ]] || die "no Python to try (see $PROG --help)"

new_enough() {
  "$1" -c "import sys; sys.exit(sys.version_info < tuple(map(int, '$MIN'.split('.'))))" >/dev/null 2>&1
}

report() {
  printf '%s: %s: .venv uses %s (%s)\n' "$PROG" "$(hostname)" "$1" "$(.venv/bin/python -V 2>&1)"
}

if [[ -x .venv/bin/python ]] && new_enough .venv/bin/python; then
  report "the existing .venv"
  exit 0
fi
rm -rf .venv  # one from an older setup (Python 3.10) cannot take this project

for py in ${CANDIDATES[@]+"${CANDIDATES[@]}"}; do
  if command -v "$py" >/dev/null 2>&1 && new_enough "$py"; then
    # python3.X-venv (ensurepip) may be missing on a TPU image; uv makes the venv without it.
    if "$py" -m venv .venv >/dev/null 2>&1; then
      report "$(command -v "$py")"
      exit 0
    fi
    rm -rf .venv
    [[ -n $UV_VERSION ]] || UV_VERSION=$(command -v "$py")
    break
  fi
done

tried="${CANDIDATES[*]:-}"
[[ -n $UV_VERSION ]] || die "no Python >= $MIN on $(hostname) (tried: $tried); install one or pass setup.sh --python PATH"
uv=$(command -v uv || true)
if [[ -z $uv ]]; then
  uv=$HOME/.local/bin/uv
  if [[ ! -x $uv ]] && ! out=$(python3 -m pip install -q --user uv 2>&1); then
    die "no Python >= $MIN on $(hostname) (tried: ${tried:-none}) and 'python3 -m pip install --user uv' failed: ${out##*$'\n'}"
  fi
fi
if ! out=$("$uv" venv -q --seed --python "$UV_VERSION" .venv 2>&1); then
  die "uv could not make a Python $UV_VERSION venv on $(hostname): ${out##*$'\n'}"
fi
report "uv's Python $UV_VERSION"
