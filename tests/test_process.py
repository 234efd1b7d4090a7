"""Measuring this process's own memory (`hetforge.core.process`)."""

import subprocess
import sys

import pytest

from hetforge.core.process import process_peak_rss_bytes

CHILD = ("import resource; from hetforge.core.process import process_peak_rss_bytes as p; "
         "print(p(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")


@pytest.mark.measure
def test_a_process_peak_is_its_own_not_its_launchers():
    """A run started from a large process (here this one, holding 512 MiB more) reports its own
    peak, where ru_maxrss starts at the launcher's."""
    held = bytearray(512 * 2**20)
    held[::4096] = b"\x01" * len(held[::4096])  # touch every page: resident
    assert process_peak_rss_bytes() > 512 * 2**20
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    own, maxrss = (int(x) for x in out.split())
    assert maxrss >= 512 * 2**20  # the premise: the launcher's memory shows in ru_maxrss
    assert own < maxrss - 256 * 2**20  # the child's own peak does not carry it
    del held
