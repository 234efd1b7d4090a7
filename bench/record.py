"""What a bench run leaves behind: its last line (one JSON object, the figures its issue names) and
the same figures in bench/results/NAME.json with the command and the machine, from which
bench/report.py writes docs/benchmarks.md. The page is the last run of each bench, never edited by
hand."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """The machine a figure was measured on: CPU model and cores, the GPU where one was used, torch."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "torch": torch.__version__}


def record(figures: dict, save: bool = True) -> None:
    """Print `figures` as the run's last line and, unless `save` is off (a dry run, a test), keep them
    with the command and the machine in bench/results/<bench>.json."""
    line = json.dumps(figures)
    if save:
        RESULTS.mkdir(exist_ok=True)
        entry = {"bench": figures["bench"], "command": " ".join(shlex.quote(a) for a in [f"bench/{Path(sys.argv[0]).name}",
                                                                                            *sys.argv[1:]]),
                 "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": machine(), "figures": figures}
        (RESULTS / f"{figures['bench']}.json").write_text(json.dumps(entry, indent=1) + "\n")
    print(line, flush=True)
