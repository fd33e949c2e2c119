"""Multi-process test launches with a time limit: a hang fails its test with a clear message, and nothing
of the launch is left running (torchrun starts each worker in a session of its own, so killing the
launcher's process group alone would leave the workers behind)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents first (read from ``/proc``; only ``pid`` without it)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree = [pid]
    for parent in tree:  # grows while it is walked: breadth first
        tree += children.get(parent, [])
    return tree


def kill_tree(pid: int) -> int:
    """SIGKILL ``pid`` and its descendants (collected first: once the launcher is gone its workers are
    orphans no longer found under it); how many processes there were."""
    tree = process_tree(pid)
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)
    return len(tree)


def run_launch(cmd: list[str], env: dict[str, str], timeout: float, what: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` (a launcher and its workers) to its end; past ``timeout`` seconds (a hang) kill it all and
    fail the test, naming ``what`` and showing the end of its output."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        killed = kill_tree(proc.pid)
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(
            f"{what}: no exit within {timeout:.0f} s (a hang); its {killed} processes were killed\n"
            f"{stdout[-2000:]}\n{stderr[-4000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
