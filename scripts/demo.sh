#!/usr/bin/env bash
# Set up (first run only) and run the default demo: prepare the embedded corpus, train the tiny
# GPT-NeoX on CPU, evaluate, print a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hetforge demo "$@"
