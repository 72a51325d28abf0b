"""`hookserve serve` sets a short OpenMP spin (GOMP_SPINCOUNT) before torch loads,
unless the operator chose a wait policy; the start-up log says which is in force."""

from __future__ import annotations

import pytest

from hookserve_server.openmp import SPIN_COUNT, set_wait_default

from test_faults import ServeProcess


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
    p = ServeProcess("--model", "resnet18", "--weights", "random", env=env)
    try:
        lines = [ln for ln in p.log if "OpenMP" in ln]
        assert len(lines) == 1 and expect in lines[0], p.log[-5:]
    finally:
        p.kill()
