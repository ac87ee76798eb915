#!/usr/bin/env bash
# The oldest dependency versions pyproject.toml allows, checked (a tool, not part of CI: torch 2.4's wheel pulls
# ~4 GB of CUDA libraries from PyPI). Builds a virtual environment with each dependency at its minimum, sharpi
# installed editable from this checkout, and runs the CLI's paths that touch typer / click, then the test command
# (or the pytest arguments given).
#
#   bash scripts/check_min_deps.sh [VENV_DIR] [PYTEST_ARGS...]      (VENV_DIR default: /tmp/sharpi-min-deps)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-/tmp/sharpi-min-deps}
shift || true
# keep in step with pyproject.toml's [project] dependencies; typer 0.15.4 caps click below 8.2 (older typers take
# click 8.2+, which they break on), later ones carry their own click or accept 8.2+
mins=("torch==2.4.0" "numpy==2.0.0" "gguf==0.18.0" "typer==0.15.4" "rich==13.0.0" "jinja2==3.1.0" "tokenizers==0.19.0")
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q "${mins[@]}" pytest pexpect
"$venv/bin/pip" install -q --no-deps -e .
"$venv/bin/pip" list 2>/dev/null | grep -iE '^(torch|numpy|gguf|typer|click|rich|jinja2|tokenizers) '
export PATH="$venv/bin:$PATH"  # the tests run the `sharpi` on PATH
fail=0
check() {  # expected exit code, then the arguments: no traceback, that exit code
    local want=$1 out rc
    shift
    out=$(sharpi "$@" 2>&1 </dev/null) && rc=0 || rc=$?
    if [ "$rc" != "$want" ] || grep -q Traceback <<<"$out"; then
        echo "FAILED (exit $rc, want $want): sharpi $*"
        tail -3 <<<"$out"
        fail=1
    fi
}
check 0 -p "The capital of France is" -n 4 --temp 0
check 2 --no-such-flag
check 2 -n abc -p hi
check 2 -m /nonexistent.gguf -p hi
check 2 models
check 0 models list
check 0 --help
check 0 --list-devices
[ "$fail" = 0 ] || exit 1
echo "CLI paths: ok"
exec "$venv/bin/python" -m pytest -q -ra -p no:cacheprovider "$@"
