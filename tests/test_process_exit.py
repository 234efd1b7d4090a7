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


@pytest.mark.parametrize("variable, world_size, finalized", [
    ("WORLD_SIZE", "2", False), ("SLURM_NTASKS", "4", False), ("WORLD_SIZE", "1", True), (None, None, True)])
def test_a_launched_worker_ends_with_its_code_and_its_output_without_finalization(variable, world_size, finalized):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "SLURM_NTASKS")}
    if variable is not None:
        env[variable] = world_size
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 3
    assert out.stdout.startswith("summary")
    assert ("finalized" in out.stdout) is finalized
