#!/usr/bin/env bash
# Create or reuse the project venv at .venv/ from the pinned requirements. Idempotent:
# it reinstalls only when requirements.txt or pyproject.toml changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 10) else 1)'; then
  echo "labkit needs Python >= 3.10 (3.11 recommended); found $("$PY" --version 2>&1)" >&2; exit 1
fi
# In a folder whose path holds a space (a Drive folder: ".../My Drive/labkit"), the venv lives outside it and .venv
# links to it: torch's Inductor passes the path of torch's libraries to the C++ compiler unquoted, so every
# torch.compile on the CPU fails to link from a venv under such a path ("cannot find -ltorch", torch 2.9).
# The Makefile runs the venv by its resolved path for the same reason.
case "$PWD" in
  *[[:space:]]*)
    away="${XDG_CACHE_HOME:-$HOME/.cache}/labkit/venvs/$(basename "$PWD" | tr -c 'A-Za-z0-9._\n-' '_')-$(printf %s "$PWD" | sha256sum | cut -c1-10)/venv"
    if [ ! -L .venv ]; then
      [ -e .venv ] && { echo "[bootstrap] .venv is a folder under a path with a space ($PWD): remove it, then run again" >&2; exit 1; }
      mkdir -p "$away" && ln -s "$away" .venv
      echo "[bootstrap] the path holds a space: the venv is $away (.venv links to it)" >&2
    fi
    ;;
esac
venv=$(readlink -f .venv 2>/dev/null || echo .venv)
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
stamp=.venv/.labkit-installed
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
# uv installs the pins, from one cache shared with the simulated images' venvs (scripts/image_venv.py) and with
# every other clone on this machine: a file is downloaded and unpacked there once, and a venv hardlinks to it.
# UV_COMPILE_BYTECODE: the .pyc files at install, as pip writes them; without them, where PYTHONDONTWRITEBYTECODE is
# set, every process compiles torch's sources again on import (17 CPU-s against 4 for `import torch, torch_xla`).
export UV_CACHE_DIR="${LABKIT_UV_CACHE:-$HOME/.cache/labkit-uv}" UV_LINK_MODE=hardlink UV_NO_PROGRESS=1 UV_COMPILE_BYTECODE=1
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # The venv takes ~8 GB (torch 2.9's CUDA wheels, which torch_xla on PyPI needs), or next to nothing when uv's
  # cache already holds torch's wheel for this Python: refuse early, by name, where uv would stop half-way with
  # "No space left on device".
  tag=$("$venv/bin/python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  torch_pin=$(sed -n 's/^torch==//p' requirements.txt)
  if compgen -G "$UV_CACHE_DIR/wheels-v*/pypi/torch/$torch_pin-$tag-*" > /dev/null; then need_gb=1; else need_gb=9; fi
  need_gb=${LABKIT_VENV_GB:-$need_gb}
  free_gb=$(df -Pk .venv | awk 'NR == 2 { printf "%d", $4 / 1048576 }')
  if ! compgen -G ".venv/lib/python3*/site-packages/torch" > /dev/null && [ "$free_gb" -lt "$need_gb" ]; then
    echo "[bootstrap] not enough disk for .venv: $free_gb GB free on $(df -P .venv | awk 'NR == 2 {print $6}')," \
      "the pinned venv needs about $need_gb GB (make test builds the simulated images in .venvs/ too: up to ~17 GB" \
      "more, less what uv's cache $UV_CACHE_DIR already holds). Free some space, or set LABKIT_VENV_GB to try anyway." >&2
    exit 1
  fi
  echo "[bootstrap] installing pinned requirements into .venv (first time on a machine: ~2 min, ~8 GB)" >&2
  start=$(date +%s)
  "$venv/bin/python" -m pip install --quiet --no-cache-dir "$(grep -E '^uv==' requirements.txt)"
  "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" -r requirements.txt
  "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --no-deps -e . > .venv/labkit-editable.log 2>&1 ||
    { cat .venv/labkit-editable.log >&2; exit 1; }
  "$venv/bin/python" -c "import labkit, data_tools" || { echo "[bootstrap] editable install of labkit failed" >&2; exit 1; }
  echo "$want" > "$stamp"
  echo "[bootstrap] done in $(( $(date +%s) - start )) s" >&2
fi
# Chromium for tests/test_browser.py (the dashboard seen live in JupyterLab): Debian's packages, installed
# only as root with apt-get and only when missing; anywhere else the browser tests skip and say how to run them.
if ! { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    echo "[bootstrap] installing chromium and chromium-driver with apt-get (for tests/test_browser.py)" >&2
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
        > .venv/apt-chromium.log 2>&1; then
      tail -n 5 .venv/apt-chromium.log >&2
      echo "[bootstrap] apt-get could not install chromium / chromium-driver (full log: .venv/apt-chromium.log):" \
        "tests/test_browser.py will skip" >&2
    fi
  else
    echo "[bootstrap] no /usr/bin/chromium + /usr/bin/chromedriver (not root, or no apt-get): tests/test_browser.py" \
      "will skip; to run it: sudo apt-get install chromium chromium-driver" >&2
  fi
fi
