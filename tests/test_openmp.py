"""`hookserve serve` sets a short OpenMP spin (GOMP_SPINCOUNT) before torch loads,
unless the operator chose a wait policy; the start-up log says which is in force. Only
the model's thread keeps an OpenMP team: preprocessing threads run torch on one thread,
and the team that start-up gave the main thread is released once it is serving."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hookserve_server.openmp import SPIN_COUNT, set_wait_default

from helpers import R18, ServeProcess


def test_default_is_set_only_when_nothing_was_chosen():
    env: dict[str, str] = {}
    note = set_wait_default(env)
    assert env == {"GOMP_SPINCOUNT": SPIN_COUNT} and "hookserve's default" in note
    for chosen in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "active"},
                   {"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "PASSIVE",
                                             "GOMP_SPINCOUNT": "500"}):
        env = dict(chosen)
        note = set_wait_default(env)
        assert env == chosen  # untouched
        for k, v in chosen.items():
            assert f"{k}={v}" in note


@pytest.mark.parametrize("env,expect", [
    ({"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}, f"GOMP_SPINCOUNT={SPIN_COUNT}"),
    ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None},
     "from the environment: OMP_WAIT_POLICY=PASSIVE"),
])
def test_serve_logs_the_policy_in_force(env, expect):
    p = ServeProcess(*R18, env=env)
    try:
        lines = [ln for ln in p.log if "OpenMP" in ln]
        assert len(lines) == 1 and expect in lines[0], p.log[-5:]
    finally:
        p.kill()


def test_preprocessing_threads_run_torch_on_one_thread(make_server):
    """Only the model's thread may start OpenMP teams: a second team (a preprocessing
    thread resizing with torch) throttles every team's spin (openmp.one_thread_here)."""
    import torch

    s = make_server(*R18, "--threads", "2",
                    "--preprocess-workers", "2")
    pool = s.engine._preparer._pool
    counts = {pool.submit(torch.get_num_threads).result() for _ in range(8)}
    assert counts == {1}
    assert torch.get_num_threads() == 2  # other threads keep the configured count


def test_release_team_ends_the_calling_threads_workers():
    """After a parallel region a thread keeps threads - 1 idle OpenMP workers; once
    released, they exit, and a later region makes a new team."""
    code = textwrap.dedent("""
        import os, time, torch
        from hookserve_server.openmp import release_team
        torch.set_num_threads(3)
        tasks = lambda: len(os.listdir("/proc/self/task"))
        before = tasks()
        x = torch.ones(1 << 22)  # a parallel region: the main thread gets a team
        with_team = tasks()
        assert release_team()
        end = time.monotonic() + 20
        while tasks() != before and time.monotonic() < end:
            time.sleep(0.01)  # the workers exit on their own threads
        released = tasks()
        x.add_(1)
        print(before, with_team, released, tasks(), float(x[0]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, OMP_NUM_THREADS="3"))
    assert out.returncode == 0, out.stderr[-2000:]
    before, with_team, released, again, value = out.stdout.split()
    assert (int(with_team) - int(before), int(released) - int(before)) == (2, 0)
    assert int(again) - int(before) == 2 and float(value) == 2.0


def _openmp_workers(pid: int) -> int:
    """libgomp worker threads in process `pid`, from gdb's backtraces."""
    out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                         capture_output=True, text=True, timeout=120)
    if "gomp" not in out.stdout and "ptrace" in out.stderr.lower():
        pytest.skip(f"gdb cannot attach here: {out.stderr.strip()[-200:]}")
    return out.stdout.count("gomp_thread_start")


@pytest.mark.skipif(shutil.which("gdb") is None, reason="needs gdb to list the server's threads")
def test_a_serving_process_keeps_one_openmp_team():
    """Start-up converts the model to channels-last on the main thread, which gives that
    thread an OpenMP team; once serving, the only team is the model thread's (threads - 1
    workers). Two teams on 2 threads each would make libgomp throttle the model's."""
    from hookserve import Client

    p = ServeProcess(*R18, "--threads", "2", "--memory-format", "channels_last")
    try:
        Client(p.address).extract(np.zeros((40, 40, 3), np.uint8), ["layer1"])
        assert _openmp_workers(p.proc.pid) == 1
    finally:
        p.kill()
