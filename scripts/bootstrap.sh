#!/usr/bin/env bash
# Create or reuse the project venv at .venv/ from the pinned requirements. Idempotent:
# it reinstalls only when requirements.txt or pyproject.toml changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 10) else 1)'; then
  echo "labkit needs Python >= 3.10 (3.11 recommended); found $("$PY" --version 2>&1)" >&2; exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.labkit-installed
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[bootstrap] installing pinned requirements into .venv (first time: ~2 min, ~7.5 GB)" >&2
  start=$(date +%s)
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r requirements.txt
  .venv/bin/python -m pip install --quiet --no-deps -e . > .venv/labkit-editable.log 2>&1 || { cat .venv/labkit-editable.log >&2; exit 1; }
  .venv/bin/python -c "import labkit, data_tools" || { echo "[bootstrap] editable install of labkit failed" >&2; exit 1; }
  echo "$want" > "$stamp"
  echo "[bootstrap] done in $(( $(date +%s) - start )) s" >&2
fi
