"""--compile auto beyond resnet and vgg: the pruned extraction graph of each torchvision
family answers as its eager hooks do (CHW, HWC and TD layers, `:input`s of in-place
activations, concatenating blocks, attention, the classifier's head).

One server per test with the dynamo "eager" backend (the graph is traced and pruned
as with inductor, no code generated: seconds). The same server answers each layer set
twice: first by the eager hooks (nothing is compiled yet), then, once its graph is
ready, from the graph."""

from __future__ import annotations

import pytest
from test_compiled import assert_same, extract, settle, stats

from hookserve_server.engine.config import CompileSettings

from conftest import rand_image
from helpers import small_server

#: model -> (input side, its layers: one of each layout it has, an `:input`, the head)
FAMILIES = {
    "mobilenet_v3_small": (64, ["features.4.block.1", "features.7.block.0.2:input",
                                "classifier.2"]),
    "efficientnet_b0": (64, ["features.3.1.block.0", "features.5.0.block.1.0:input",
                             "classifier.0"]),
    "convnext_tiny": (64, ["features.3.1.block.3", "features.5.3.block.0:input",
                           "classifier.1"]),
    "densenet121": (64, ["features.denseblock2.denselayer9.norm1",
                         "features.denseblock3.denselayer11.relu2:input", "features.norm5"]),
    "shufflenet_v2_x0_5": (64, ["stage2.3.branch2.6", "conv5.2", "fc:input"]),
    "googlenet": (64, ["inception3b.branch4", "avgpool:input", "fc"]),
    "regnet_y_400mf": (64, ["trunk_output.block2.block2-2.f.c.0",
                            "trunk_output.block3.block3-3.f.c:input", "fc"]),
    "swin_t": (64, ["features.3.0.mlp", "features.5.1:input", "head"]),
    "vit_b_32": (224, ["encoder.layers.encoder_layer_2",
                       "encoder.layers.encoder_layer_6.dropout:input", "heads"]),
}
GROUPS = [["mobilenet_v3_small", "efficientnet_b0", "convnext_tiny"],
          ["densenet121", "shufflenet_v2_x0_5", "googlenet"],
          ["regnet_y_400mf", "swin_t", "vit_b_32"]]


@pytest.mark.parametrize("models", GROUPS, ids=lambda g: "+".join(g))
def test_each_family_compiled_answers_as_its_eager_hooks(make_server, models):
    s = make_server(*small_server("--max-batch-size", "1", "--max-batch-delay-ms", "1",
                                  models=models))
    # due a compile at a layer set's fourth batch: the four asks below, one image each
    s.engine.compile_graphs(CompileSettings("auto", after=4, backend="eager"))
    for model in models:
        side, layers = FAMILIES[model]
        asks = [(image, {"native": True, "reduction": reduction})
                for image in (rand_image(side, side, seed=0), rand_image(side, side, seed=1))
                for reduction in ("none", "avg")]
        hits = stats(s).hits
        eager = [extract(s, model, layers, [image], **kw) for image, kw in asks]
        assert stats(s).hits == hits, f"{model}: a graph was used before its compile"
        settle(s)
        compiled = [extract(s, model, layers, [image], **kw) for image, kw in asks]
        assert stats(s).hits == hits + len(asks), f"{model}: its graph was not used"
        for got, want in zip(compiled, eager, strict=True):
            assert_same(got, want)
    assert stats(s).failures == 0 and stats(s).compiles == len(models)
