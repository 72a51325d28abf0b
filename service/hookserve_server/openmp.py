"""OpenMP's wait between parallel regions, set before torch loads its OpenMP runtime.

torch's CPU kernels run on OpenMP threads, which wait for the next parallel region
either by sleeping (``OMP_WAIT_POLICY=PASSIVE``: every region then starts with a futex
wake-up of each thread) or by spinning (libgomp's default: about 3 ms; ``ACTIVE``:
minutes). A forward pass is hundreds of short regions back to back. On the 2-core dev
VM, resnet50 batch 1 took 89-98 ms with PASSIVE, 61-78 ms with a 0.1 ms spin
(``GOMP_SPINCOUNT=10000``), 57-63 ms with ACTIVE (docs/performance.md). A long spin,
though, takes the core that the decode pool, gRPC or a client on the same machine
needs next. So `hookserve serve` sets the short spin, unless the operator chose a
policy (either variable set) in the environment.

Only libgomp (torch's pip wheels on Linux) reads these; Intel's OpenMP has
KMP_BLOCKTIME instead. Importing this module does not import torch.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: libgomp spins about 100,000 times per ms (its own estimate): ~0.1 ms, then sleeps.
SPIN_COUNT = "10000"


def set_wait_default(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set GOMP_SPINCOUNT to SPIN_COUNT unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is
    set. Returns a line for the start-up log saying which policy is in force. Call it
    before torch is imported: libgomp reads its environment once, when it loads."""
    chosen = {k: environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in environ}
    if chosen:
        return "OpenMP wait policy from the environment: " + ", ".join(
            f"{k}={v}" for k, v in chosen.items())
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return (f"OpenMP threads spin ~0.1 ms before sleeping (GOMP_SPINCOUNT={SPIN_COUNT}, "
            "hookserve's default; set OMP_WAIT_POLICY or GOMP_SPINCOUNT to choose)")


def _libgomp():
    """The libgomp this process loaded (torch's bundled copy), or None."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libgomp" in path.rsplit("/", 1)[-1]:
                    return ctypes.CDLL(path)  # the loaded library: no second copy
    except OSError:
        pass
    return None


def one_thread_here() -> bool:
    """Run torch's CPU kernels on the calling thread alone, without touching other
    threads' settings; False where that cannot be done (no libgomp).

    libgomp gives every thread that starts a parallel region a team of its own, and
    once the process has more OpenMP threads than cores it throttles every team's spin
    to almost nothing (its GOMP_SPINCOUNT no longer applies). A preprocessing thread
    that resizes with torch would so make the model's forward pass as slow as with
    OMP_WAIT_POLICY=PASSIVE (measured: docs/performance.md). ``torch.set_num_threads``
    cannot be used here: it also sets the count every new thread starts with.
    """
    import torch

    gomp = _libgomp()
    if gomp is None:
        return False
    torch.get_num_threads()  # torch's per-thread set-up first, or it would undo this
    gomp.omp_set_num_threads(1)
    return torch.get_num_threads() == 1


def release_team() -> bool:
    """End the calling thread's OpenMP team: its worker threads exit (the thread gets a
    new team if it runs a parallel region again). False where that cannot be done.

    Start-up runs torch on the main thread (random weights, a channels-last copy, the
    set-up of compiled graphs), which leaves the main thread a team of idle workers;
    with the model thread's own team the process then has more OpenMP threads than
    cores, and libgomp throttles the model thread's spin (see `one_thread_here`). A
    frozen resnet50 graph at batch 1 took 22.3-22.9 ms on another thread than the one
    that built it, 19.9-20.3 ms once the builder's team was released
    (docs/performance.md). libgomp frees only the calling thread's pool here.
    """
    gomp = _libgomp()
    if gomp is None:
        return False
    return gomp.omp_pause_resource_all(1) == 0  # 1: omp_pause_soft
