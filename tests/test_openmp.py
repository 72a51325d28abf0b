"""`hookserve serve` sets a short OpenMP spin (GOMP_SPINCOUNT) before torch loads,
unless the operator chose a wait policy; the start-up log says which is in force."""

from __future__ import annotations

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
