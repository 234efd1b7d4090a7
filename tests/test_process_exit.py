"""How a hetforge process ends: a torchrun worker skips the interpreter's finalization (where a gloo
group's destructor can abort a finished run), after flushing what it printed."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import atexit, sys
from hetforge.core.process import exit_process
atexit.register(lambda: print("finalized"))
sys.stdout.write("summary")  # no newline: still in the buffer when the process ends
exit_process(3)
"""


@pytest.mark.parametrize("world_size, finalized", [("2", False), ("1", True), (None, True)])
def test_a_launched_worker_ends_with_its_code_and_its_output_without_finalization(world_size, finalized):
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    if world_size is not None:
        env["WORLD_SIZE"] = world_size
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 3
    assert out.stdout.startswith("summary")
    assert ("finalized" in out.stdout) is finalized
