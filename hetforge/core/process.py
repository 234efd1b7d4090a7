"""What this process has used of the host (its own peak resident memory), and how it ends."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def process_peak_rss_bytes() -> int:
    """This process's peak resident memory. Linux's VmHWM is the process's own; ru_maxrss starts at
    the memory of whatever launched it (Linux keeps it across fork and exec), so a run started from
    a large process (a test runner, a notebook) would report that process's peak as its own."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # not on Windows

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB elsewhere


def env_int(*names: str, default: int | None = None) -> int | None:
    """The first of these environment variables that is set, as an integer (torchrun's name first,
    then srun's)."""
    for n in names:
        if os.environ.get(n, "") != "":
            return int(os.environ[n])
    return default


def launch_world_size() -> int:
    """How many ranks the launcher started, known before any connection is made."""
    return env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)


def exit_process(code: int) -> NoReturn:
    """End the process with `code`. A worker of a multi-process launch (WORLD_SIZE from torchrun,
    or SLURM_NTASKS from srun, above 1: `launch_world_size`) ends without the interpreter's
    finalization, once its output is flushed. By then the command has closed its metrics,
    checkpoints, loaders and process groups; what finalization still destroys can include a gloo
    group whose worker threads are alive, and that aborts the process ("terminate called without
    an active exception"). The abort was seen twice in the killed-rank restart test under load,
    each time after a run that had finished and printed its summary: a complete run reported as a
    failed one to the launcher, and to any scheduler behind it."""
    try:
        launched = launch_world_size() > 1
    except ValueError:  # a variable that is no count: the command ran as one process
        launched = False
    if launched:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    raise SystemExit(code)
