#!/usr/bin/env bash
# Create .venv in the repository and install elastic_ddp with its test tools. Idempotent.
#
#   bash launch/setup.sh
#
# TORCH_PACKAGE picks the torch build, installed before anything else so that pip never pulls a
# different one in as a dependency (default: torch==2.13.0; on this project's CPU machines that is
# a local CPU wheel). For CUDA, e.g.:
#   TORCH_PACKAGE="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126" bash launch/setup.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$repo/.venv}"
torch_package="${TORCH_PACKAGE:-torch==2.13.0}"

python_bin="${PYTHON:-}"
if [[ -z "$python_bin" ]]; then
  for candidate in python3.11 python3.12 python3.10 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then python_bin="$candidate"; break; fi
  done
fi
if [[ -z "$python_bin" ]] || ! "$python_bin" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "launch/setup.sh: need Python 3.10 or newer (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi

stamp="$venv/.elastic_ddp-installed"
wanted="$(cat "$repo/pyproject.toml" <(echo "$torch_package") | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$wanted" ]]; then
  exit 0
fi

[[ -x "$venv/bin/python" ]] || "$python_bin" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
# shellcheck disable=SC2086  # TORCH_PACKAGE may carry pip options such as --index-url
"${pip[@]}" install $torch_package
"${pip[@]}" install -e "$repo[test]"
echo "$wanted" > "$stamp"
echo "launch/setup.sh: ready in $venv" >&2
