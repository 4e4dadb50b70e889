"""fngate.process.batch_scheduling: a process's threads, those it starts later and its children run
under SCHED_BATCH (fngate up's Redis, gateway and runners)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fngate.process import batch_scheduling
from fngate.up.supervisor import start_redis
from tests.conftest import ROOT, policies

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux's SCHED_BATCH only")


def test_every_thread_of_the_process_and_what_it_starts_afterwards_runs_under_sched_batch() -> None:
    script = textwrap.dedent(
        """
        import os, subprocess, sys, threading
        from fngate.process import batch_scheduling
        release = threading.Event()
        before = threading.Thread(target=release.wait)
        before.start()
        assert batch_scheduling() == ""
        after = threading.Thread(target=release.wait)
        after.start()
        waits = [sys.executable, "-c", "import sys; sys.stdin.read()"]
        child = subprocess.Popen(waits, stdin=subprocess.PIPE)
        print(child.pid, flush=True)
        sys.stdin.readline()
        child.communicate()
        release.set()
        """
    )
    ours = policies(os.getpid())
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, text=True
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        child = int(process.stdout.readline())
        assert len(list(Path(f"/proc/{process.pid}/task").iterdir())) >= 3
        assert policies(process.pid) == {os.SCHED_BATCH}
        assert policies(child) == {os.SCHED_BATCH}
        assert policies(os.getpid()) == ours  # the caller's own are left alone
    finally:
        process.communicate("\n", timeout=30)
    assert process.returncode == 0


def test_a_private_redis_asked_for_it_runs_under_sched_batch(tmp_path: Path) -> None:
    process, _url = start_redis(tmp_path, batch=True)
    try:
        assert policies(process.pid) == {os.SCHED_BATCH}
    finally:
        process.terminate()
        process.wait(timeout=10)
    (tmp_path / "plain").mkdir()
    plain, _url = start_redis(tmp_path / "plain")
    try:
        assert policies(plain.pid) == policies(os.getpid())  # not asked: it keeps ours
    finally:
        plain.terminate()
        plain.wait(timeout=10)


def test_a_process_that_is_gone_is_said_so() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert "cannot be listed" in batch_scheduling(process.pid)
