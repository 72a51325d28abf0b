"""Soak: many images with random layer sets leave nothing behind.

After each run the models carry no forward hooks, nothing is queued, no Extract
session is still referenced, and (slow test) the process RSS stays flat over
thousands of images once warm.
"""

from __future__ import annotations

import ctypes
import gc
import random
import statistics
import warnings

import pytest

from hookserve_server.engine import Session

from conftest import rand_image
from helpers import small_server

FLAGS = [*small_server(models=("resnet18", "vgg11")),
         "--max-batch-size", "8", "--max-batch-delay-ms", "1"]
REDUCTIONS = ["none", "avg", "max", "flatten"]
DTYPES = ["float32", "float16", "bfloat16"]


def rss_bytes() -> int:
    """Resident set size after returning free heap pages to the OS.

    Without malloc_trim, glibc keeps freed arenas mapped and RSS swings by 100+ MiB
    between rounds with the same live memory.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def run_images(s, n: int, seed: int, per_stream: int = 40) -> int:
    """Stream n images in streams of `per_stream`, each with a random layer set."""
    rng = random.Random(seed)
    images = [rand_image(rng.choice([48, 64, 80]), rng.choice([48, 64, 96]), i)
              for i in range(16)]
    ok = 0
    with s.client(timeout=300) as c:
        names = {m: [li.name for li in c.describe(m, 64).layers]
                 for m in ("resnet18", "vgg11")}
        for start in range(0, n, per_stream):
            model = rng.choice(list(names))
            layers = {name: {"reduction": rng.choice(REDUCTIONS), "dtype": rng.choice(DTYPES),
                             "l2_normalize": rng.random() < 0.2}
                      for name in rng.sample(names[model], rng.randint(1, 4))}
            geometry = rng.choice([{"resize": 64, "crop": 64}, {"native": True},
                                   {"resize": 72}])
            batch = [images[rng.randrange(len(images))]
                     for _ in range(min(per_stream, n - start))]
            for r in c.extract_many(batch, layers, model=model, **geometry):
                assert r.ok, r.error
                assert list(r.features) == list(layers)
                ok += 1
    return ok


def assert_idle(s) -> None:
    assert s.engine.hook_count() == 0
    assert s.engine.queued == 0
    gc.collect()
    with warnings.catch_warnings():  # isinstance() wakes torch's deprecated aliases
        warnings.simplefilter("ignore")
        assert not [o for o in gc.get_objects()
                    if isinstance(o, Session) and o.engine is s.engine]


def test_short_soak_leaves_nothing_behind(make_server):
    s = make_server(*FLAGS)
    assert run_images(s, 160, seed=1) == 160
    assert_idle(s)


@pytest.mark.slow
def test_soak_rss_stays_flat(make_server):
    s = make_server(*FLAGS)
    run_images(s, 600, seed=2)                      # warm: caches, allocator pools
    assert_idle(s)
    rss = []
    for round_ in range(8):
        assert run_images(s, 400, seed=10 + round_) == 400
        assert_idle(s)
        rss.append(rss_bytes())
    mib = [round(r / 2**20) for r in rss]
    print(f"RSS after each round of 400 images (MiB): {mib}")
    # Flat: the last rounds sit where the first ones did. A leak of even one 64x64
    # feature map per image would add > 100 MiB over the 2000 images in between.
    growth = statistics.median(rss[-3:]) - statistics.median(rss[:3])
    assert growth < 48 * 2**20, f"RSS grew {growth / 2**20:.0f} MiB: {mib}"
