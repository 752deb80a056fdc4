#!/usr/bin/env bash
# ninfer's two entry points. Each sets up .venv on first use (and again when
# pyproject.toml changes), so a fresh clone needs nothing else:
#   ./dev.sh serve [FLAGS]   fetch the default model if needed and serve it
#   ./dev.sh test [ARGS]     ruff, mypy (strict) and the whole pytest suite
#   ./dev.sh test --busy [ARGS]  the same beside a busy process a core (a loaded machine:
#                            no verdict may depend on the machine's speed)
#   ./dev.sh pool-stress     the kernels' thread pool under stress, optimized and under
#                            ThreadSanitizer, beside busy processes (tests/poolstress.py)
set -euo pipefail
cd "$(dirname "$0")"

# An exact torch pin. On Linux, PyPI's torch==2.13.0 is the multi-GB CUDA build, so the
# CPU build is taken from PyTorch's CPU wheel index (2.13.0+cpu satisfies the pin and
# sorts above 2.13.0) when that index can be reached; where it cannot (a machine with
# its own mirror of the CPU build), the configured indexes decide. NINFER_TORCH
# overrides all of it, e.g. NINFER_TORCH='torch==2.13.0+cu128' on a CUDA machine.
TORCH_SPEC="${NINFER_TORCH:-torch==2.13.0}"
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
PY="${PYTHON:-python3}"

quiet_pip() {
  # pip warns about every index location this machine does not have; keep real errors.
  # --no-compile: pip would byte-compile every file of every package (torch's thousands:
  # 44 s of a fresh set-up on 2 cores); Python compiles what is imported, once, instead.
  .venv/bin/python -m pip install -q --no-compile --disable-pip-version-check "$@" \
    2> >(grep -v -e 'is ignored: it is neither a file nor a directory' >&2)
}

setup() {
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
  fi
  local stamp=.venv/.ninfer-setup
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$TORCH_SPEC" ]; then
    local index=()
    if [ -z "${NINFER_TORCH:-}" ] && .venv/bin/python -c "
import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" "$TORCH_CPU_INDEX" 2>/dev/null; then
      index=(--extra-index-url "$TORCH_CPU_INDEX")
    fi
    echo "setting up .venv: installing $TORCH_SPEC${index:+ (CPU build, $TORCH_CPU_INDEX)}" \
      "(a minute or two the first time)" >&2
    quiet_pip "${index[@]}" "$TORCH_SPEC"
    echo "setting up .venv: installing ninfer and its dependencies" >&2
    quiet_pip -e '.[dev]'
    echo "$TORCH_SPEC" > "$stamp"
    echo "setting up .venv: done (.venv/bin/ninfer)" >&2
  fi
  # ninfer's native CPU kernels, built from its C++ sources by the system's compiler
  # (again only when the sources, torch or the compiler changed; a second or two to
  # find out). Where none can be built it says why, and the server runs torch's kernels.
  .venv/bin/ninfer build-kernels >/dev/null
}

js_clients() {
  # The JavaScript clients some tests drive (tests/js: the Anthropic TypeScript SDK's
  # tool runner, the node openai SDK and the AI SDK's embeddings), installed with npm from tests/js/package-lock.json (again only when
  # it changes). Where npm is missing or cannot install, those tests are skipped.
  local stamp=tests/js/node_modules/.ninfer-setup
  if command -v npm >/dev/null 2>&1 && { [ ! -f "$stamp" ] || [ tests/js/package-lock.json -nt "$stamp" ]; }; then
    echo "setting up tests/js: installing its packages with npm" >&2
    if npm ci --prefix tests/js --silent --no-audit --no-fund >/dev/null; then
      touch "$stamp"
    else
      echo "could not install tests/js's packages: their tests will be skipped" >&2
    fi
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
    busy=0
    if [ "${1:-}" = "--busy" ]; then
      busy=$(.venv/bin/python -c "import os; print(len(os.sched_getaffinity(0)))" 2>/dev/null \
             || nproc)
      shift
    fi
    setup
    js_clients
    echo "ruff, ruff format --check, then mypy beside pytest" >&2
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    # mypy (strict) runs beside pytest, not before it: it is one process (35-50 s on a
    # fresh clone, where it has no cache) and would leave the other cores idle for that
    # long. Its report comes after pytest's, and either failing fails the command.
    mypy_out=$(mktemp)
    .venv/bin/mypy >"$mypy_out" 2>&1 &
    mypy_pid=$!
    hogs=()
    trap 'kill "${hogs[@]}" "$mypy_pid" 2>/dev/null || true; rm -f "$mypy_out"' EXIT
    if [ "$busy" -gt 0 ]; then
      echo "beside $busy busy processes (one a core), for the whole run" >&2
      for _ in $(seq "$busy"); do
        # a busy loop that ends with this script, however it ends
        .venv/bin/python -c "import os
parent = os.getppid()
while os.getppid() == parent: pass" & hogs+=($!)
      done
    fi
    # A worker a core, up to four (each holds torch and its servers' engines); with
    # worksteal an idle worker takes tests queued for a busy one, so the cores stay busy
    # to the end. Arguments given after `test` come later and win (`-n 0`: one process).
    status=0
    .venv/bin/pytest -n auto --maxprocesses 4 --dist worksteal "$@" || status=$?
    mypy_status=0
    wait "$mypy_pid" || mypy_status=$?
    echo "mypy (strict):" >&2
    cat "$mypy_out"
    if [ "$mypy_status" -ne 0 ] && [ "$status" -eq 0 ]; then
      status=$mypy_status
    fi
    exit "$status"
    ;;
  pool-stress)
    # 50 million calls of the pool (and 200,000 of a kernel on it) with more threads than
    # cores beside a busy process a core, then a million under ThreadSanitizer: minutes.
    setup
    exec .venv/bin/python tests/poolstress.py "$@"
    ;;
  *)
    echo "usage: ./dev.sh serve [ninfer serve flags] | ./dev.sh test [--busy] [pytest args]" \
      "| ./dev.sh pool-stress [--calls N]" >&2
    exit 2
    ;;
esac
