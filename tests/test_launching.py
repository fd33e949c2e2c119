"""tests/launching.py: a launch past its time limit fails its test by name and leaves no process running.

The hung "launch" is a Python parent that starts a child in a session of its own (as torchrun starts its
workers) and both sleep; the child's pid is read from a file the child writes.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from launching import run_launch

HUNG_LAUNCH = """
import subprocess, sys, time
child = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
subprocess.Popen([sys.executable, "-c", child, sys.argv[1]], start_new_session=True)
print("launched", flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a killed child not yet reaped is a zombie: not running
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:  # reaped meanwhile
        return False


def test_a_hung_launch_fails_naming_it_and_its_workers_are_killed(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(pytest.fail.Exception) as failure:
        run_launch([sys.executable, "-c", HUNG_LAUNCH, str(pid_file)], dict(os.environ), 5, "hung launch")
    message = str(failure.value)
    assert message.startswith("hung launch: no exit within 5 s (a hang); its 2 processes were killed"), message
    assert "launched" in message  # the end of its output
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), "the launcher's worker (a session of its own) was left running"


def test_a_launch_that_ends_returns_its_status_and_output():
    proc = run_launch([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], dict(os.environ), 60, "ok")
    assert (proc.returncode, proc.stdout) == (3, "out\n")
