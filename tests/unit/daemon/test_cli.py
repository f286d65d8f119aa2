"""The command line under a closed pipe: `qosfs plan ... | head` must not print an
internal error (a reader that went away is not a bug of ours)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.mounting import ROOT


@pytest.mark.parametrize("args", [
    ["policy", "default"],
    ["plan", "--params", "70B", "--nodes", "8", "--ranks", "64", "--backend-write", "20GB/s"],
])
def test_a_closed_pipe_ends_the_command_quietly_as_sigpipe_would(args: list[str]) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    try:
        out = subprocess.run([sys.executable, "-m", "qosfs", *args], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=60)
    finally:
        os.close(write_end)
    assert out.stderr == ""
    assert out.returncode == 128 + signal.SIGPIPE
