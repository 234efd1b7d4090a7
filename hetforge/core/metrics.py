"""The metrics record: one JSONL file per run (the record of truth), mirrored to TensorBoard and,
optionally, Weights & Biases (`train.wandb: offline` works without a network; `wandb sync` later).

The file is appended to across resumes; readers keep the last record of each (kind, step), so a run
resumed from an earlier checkpoint than its last log line still yields one clean curve. Training
writes it, the report and the sweep read it.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from hetforge.core.errors import HetforgeError

class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = True, wandb: str = "off", project: str = "hetforge",
                 name: str | None = None, config: dict | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = self._wb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if wandb != "off":
            self._wb = _wandb_run(run_dir, wandb, project, name, config)

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        record = {"kind": kind, "step": step, **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
        if self._wb is not None:
            scalars = {f"{kind}/{k}": v for k, v in values.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if scalars:
                self._wb.log(scalars, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wb is not None:
            self._wb.finish()


def _wandb_run(run_dir: Path, mode: str, project: str, name: str | None, config: dict | None):
    """One W&B run per run directory: its id is kept there, so a resumed run continues it."""
    try:
        import wandb
    except ImportError:
        raise HetforgeError(f"train.wandb={mode} needs the wandb package: pip install 'hetforge[wandb]'") from None
    id_file = run_dir / "wandb_id.txt"
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
    id_file.write_text(run_id)
    return wandb.init(project=project, name=name, id=run_id, resume="allow", mode=mode, dir=str(run_dir),
                      config=config, settings=wandb.Settings(silent=True))


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
