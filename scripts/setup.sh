#!/usr/bin/env bash
# Create .venv and install hetforge with its pinned dependencies. Idempotent: re-installs only when
# pyproject.toml changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.hetforge-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --disable-pip-version-check -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
