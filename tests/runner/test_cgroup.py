"""Whose folders of function cgroups (and working folders) a runner may remove at its start: those
of runners that are no longer running, told by the process id and start time in their names."""

from __future__ import annotations

import os
import subprocess
import sys

from runner import cgroup


def test_a_folder_belongs_to_a_live_runner_only_while_that_very_process_runs() -> None:
    me = os.getpid()
    mine = f"{cgroup.PREFIX}{me}-{cgroup.start_time(me)}"
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    assert cgroup.owner_alive(mine)
    assert not cgroup.owner_alive(f"{cgroup.PREFIX}{ended.pid}-{cgroup.start_time(me)}")  # gone
    assert not cgroup.owner_alive(f"{cgroup.PREFIX}{me}-1")  # this id, another process's start: reused
    assert cgroup.owner_alive(f"{cgroup.PREFIX}{me}")  # an older runner's name: the id alone
    assert not cgroup.owner_alive(f"{cgroup.PREFIX}{ended.pid}")
    assert cgroup.owner_alive(f"{cgroup.PREFIX}something-else")  # not a runner's: left alone
