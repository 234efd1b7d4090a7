#!/usr/bin/env bash
# The GPU check in one call: on a GPU machine with PyTorch preinstalled and no network, writes its
# logs and results.json under $OUT (default runs/gpu_check). Installs nothing; where hetforge's own
# dependencies are missing there, carry them as wheels in .whl/ (see /work/.library/device/README.md)
# and they are unpacked to a temporary path first.
#   bash bench/gpu_check.sh             # on the GPU, under 8 minutes on an H200
#   bash bench/gpu_check.sh --dry-run   # the same steps on the CPU, tiny sizes
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu_check}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [ -d .whl ] && ! "$PY" -c "import pydantic, highspy" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/hetforge-site .whl/*.whl
  export PYTHONPATH="/tmp/hetforge-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
set -o pipefail
"$PY" bench/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
