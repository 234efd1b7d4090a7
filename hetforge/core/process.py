"""What this process has used of the host: its own peak resident memory."""

from __future__ import annotations

import sys


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
