"""A compiled graph dropped from the LRU frees its memory (real inductor, frozen).

torch keeps what it compiled process-wide: dynamo's compiled code stays with the code
object of the graph's `forward`, and inductor keeps every Python module it loaded (a
frozen graph's folded and packed weights are their attributes). Without freeing
those, each evicted resnet18 graph kept about 45 MB for good, so `--compile-max-graphs`
and `--compile-max-bytes` bounded the LRU but not the server's memory, while clients
choose the layer sets that get compiled.
"""

from __future__ import annotations

import gc
import weakref

import torch
from test_compiled import extract, settle, stats

from conftest import encode, rand_image


def frozen_tensors(mods: list, model_storages: set[int]) -> list:
    """Weak references to the tensors a graph's modules hold that are not the model's
    own weights (the folded and packed ones freezing made)."""
    out = []
    for m in mods:
        for v in vars(m).values():
            if not isinstance(v, torch.Tensor):
                continue
            try:
                if v.untyped_storage().data_ptr() in model_storages:
                    continue
            except RuntimeError:   # an opaque oneDNN tensor: packed weights
                pass
            out.append(weakref.ref(v))
    return out


def test_an_evicted_graph_frees_its_frozen_weights(make_server):
    from torch._inductor.codecache import PyCodeCache

    s = make_server("--model", "resnet18", "--weights", "random", "--compile", "auto",
                    "--compile-after", "1", "--compile-max-graphs", "1",
                    "--max-batch-delay-ms", "1")
    (graphs,) = s.engine.compiled
    img = [encode(rand_image(48, 48, seed=1))]
    layer_sets = [["layer1"], ["layer2"], ["layer3"], ["layer2", "layer3"]]
    held, modules = [], []
    for layers in layer_sets:
        extract(s, "resnet18", layers, img, native=True)   # due: compiled meanwhile
        settle(s)
        ((_, _, mods),) = graphs._graphs.values()
        storages = {t.untyped_storage().data_ptr()
                    for m in graphs._copies.values()
                    for t in [*m.parameters(), *m.buffers()]}
        held.append(frozen_tensors(mods, storages))
        modules.append({id(m) for m in mods})
    assert stats(s).compiles == len(layer_sets) and stats(s).evictions == len(layer_sets) - 1
    # a dropped graph is freed on the model's thread, before its next batch: the graph
    # kept answers it, compiled once
    hits, compiles = stats(s).hits, stats(s).compiles
    extract(s, "resnet18", layer_sets[-1], img, native=True)
    assert stats(s).hits == hits + 1 and stats(s).compiles == compiles
    gc.collect()
    alive = [sum(r() is not None for r in refs) for refs in held]
    assert all(held) and alive[-1] == len(held[-1])     # the kept graph holds its own
    assert alive[:-1] == [0] * (len(layer_sets) - 1), alive
    kept = {id(m) for m in PyCodeCache.modules}
    assert not kept & set().union(*modules[:-1])


def test_freeing_a_graph_never_fails_a_batch(caplog):
    """What cannot be freed (torch's internals changed, say) is logged and left: the
    freeing runs before a batch on the model's thread, and must not fail it."""
    import logging

    from hookserve_server.capture.compiled import forget_graph

    with caplog.at_level(logging.WARNING, logger="hookserve.compile"):
        forget_graph(None, [object()])   # no module: has no __name__
    assert "could not be freed" in caplog.text
