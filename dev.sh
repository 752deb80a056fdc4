#!/usr/bin/env bash
# ninfer's two entry points. Each sets up .venv on first use (and again when
# pyproject.toml changes), so a fresh clone needs nothing else:
#   ./dev.sh serve [FLAGS]   fetch the default model if needed and serve it
#   ./dev.sh test [ARGS]     ruff, mypy (strict) and the whole pytest suite
set -euo pipefail
cd "$(dirname "$0")"

# An exact torch pin: an open range would pull a multi-GB CUDA build on a CPU machine.
# Override for another machine, e.g. NINFER_TORCH='torch==2.13.0+cu128'.
TORCH_SPEC="${NINFER_TORCH:-torch==2.13.0}"
PY="${PYTHON:-python3}"

quiet_pip() {
  # pip warns about every index location this machine does not have; keep real errors.
  .venv/bin/python -m pip install -q --disable-pip-version-check "$@" \
    2> >(grep -v -e 'is ignored: it is neither a file nor a directory' >&2)
}

setup() {
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
  fi
  local stamp=.venv/.ninfer-setup
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$TORCH_SPEC" ]; then
    echo "setting up .venv: installing $TORCH_SPEC (a minute or two the first time)" >&2
    quiet_pip "$TORCH_SPEC"
    echo "setting up .venv: installing ninfer and its dependencies" >&2
    quiet_pip -e '.[dev]'
    echo "$TORCH_SPEC" > "$stamp"
    echo "setting up .venv: done (.venv/bin/ninfer)" >&2
  fi
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  serve)
    setup
    exec .venv/bin/ninfer serve "$@"
    ;;
  test)
    setup
    echo "ruff, ruff format --check, mypy, then pytest" >&2
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    .venv/bin/mypy
    exec .venv/bin/pytest "$@"
    ;;
  *)
    echo "usage: ./dev.sh serve [ninfer serve flags] | ./dev.sh test [pytest args]" >&2
    exit 2
    ;;
esac
