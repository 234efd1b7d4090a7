"""The metrics record: one JSONL file per run (the record of truth), mirrored to TensorBoard.

The file is appended to across resumes; readers keep the last record of each (kind, step), so a run
resumed from an earlier checkpoint than its last log line still yields one clean curve. Training
writes it, the report and the sweep read it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        record = {"kind": kind, "step": step, **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Records by kind, sorted by step, last write winning for a repeated step (events: for a
    repeated step and event name, so that different events of one step all stay)."""
    by_key: dict[tuple, dict] = {}
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            by_key[(rec["kind"], rec["step"], rec.get("event", ""))] = rec
    out: dict[str, list[dict]] = {}
    for (kind, *_), rec in sorted(by_key.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        out.setdefault(kind, []).append(rec)
    return out
