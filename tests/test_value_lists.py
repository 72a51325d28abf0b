"""Every value list of the contract is declared once on the server, and agrees with the
proto: for each proto enum, one domain enum member per value (same number, same name),
the parser turning each value into that member, and, where the list has one, exactly
one entry per member in its server table. A member missing or extra on either side
fails here."""

from __future__ import annotations

import pytest

from hookserve.v1 import hookserve_pb2 as pb
from hookserve_server import wire
from hookserve_server.attribution_spec import METHODS, AttributionSpec, Baseline, Method, Score
from hookserve_server.capture.reduce import DTYPES, REDUCTIONS, reduced_shape
from hookserve_server.errors import InvalidArgument
from hookserve_server.spec import DType, LayerSpec, Layout, Mode, Reduction


def _layer(**kw):
    return wire.to_spec(pb.ExtractionSpec(layers=[pb.LayerRequest(name="conv1", **kw)]))


IG = pb.ATTRIBUTION_METHOD_INTEGRATED_GRADIENTS


def _attribution(**kw):
    kw.setdefault("method", pb.ATTRIBUTION_METHOD_GRADIENT)
    return wire.to_attribution_spec(pb.AttributionSpec(**kw))


#: (proto enum, its prefix, domain enum, server table or None, parse one number,
#:  message for an unknown number, the default for UNSPECIFIED or None: refused)
LISTS = {
    "reduction": (pb.Reduction, "REDUCTION_", Reduction, REDUCTIONS,
                  lambda n: _layer(reduction=n).layers[0].reduction,
                  "invalid reduction for conv1", Reduction.NONE),
    "dtype": (pb.DType, "DTYPE_", DType, DTYPES, lambda n: _layer(dtype=n).layers[0].dtype,
              "invalid dtype for conv1", DType.FLOAT32),
    "mode": (pb.Preprocessing.Mode, "MODE_", Mode, None,
             lambda n: wire.to_spec(pb.ExtractionSpec(
                 preprocessing=pb.Preprocessing(mode=n))).preprocessing.mode,
             "unknown preprocessing mode", Mode.DEFAULT),
    "method": (pb.AttributionMethod, "ATTRIBUTION_METHOD_", Method, METHODS,
               lambda n: _attribution(method=n).method, "invalid method", None),
    "score": (pb.AttributionScore, "ATTRIBUTION_SCORE_", Score, None,
              lambda n: _attribution(score=n).score, "invalid score", Score.LOGIT),
    "baseline": (pb.AttributionBaseline, "ATTRIBUTION_BASELINE_", Baseline, None,
                 lambda n: _attribution(ig_baseline=n, method=IG).ig_baseline, "invalid baseline",
                 Baseline.ZEROS),
}


@pytest.mark.parametrize("name", sorted(LISTS))
def test_proto_enum_domain_enum_parser_and_table_agree(name):
    enum_type, prefix, domain, table, parse, unknown, default = LISTS[name]
    proto = {n: v for n, v in enum_type.items() if n != f"{prefix}UNSPECIFIED"}
    # Every proto value is one domain member with the same number, and back.
    assert sorted(proto.values()) == sorted(m.value for m in domain)
    for proto_name, number in proto.items():
        member = domain(number)
        # Names agree too (AVG_POOL is AVG, MAX_POOL is MAX).
        assert proto_name.removeprefix(prefix).removesuffix("_POOL") == member.name
        assert parse(number) is member
    if table is not None:  # exactly one entry per member
        assert set(table) == set(domain)
    if default is None:
        with pytest.raises(InvalidArgument, match="sets no"):
            parse(0)
    else:
        assert parse(0) is default
    with pytest.raises(InvalidArgument, match=unknown):
        parse(99)


def test_reduction_shapes_are_those_the_proto_documents():
    shapes = {r: reduced_shape(LayerSpec("x", r), (8, 5, 3)) for r in Reduction
              if r is not Reduction.CLS}
    assert shapes == {Reduction.NONE: (8, 5, 3), Reduction.AVG: (8,), Reduction.MAX: (8,),
                      Reduction.FLATTEN: (120,), Reduction.STATS: (8, 5)}
    # the channels are kept whatever the layout; cls is token 0 of a [T, D] layer: (D,)
    assert reduced_shape(LayerSpec("x", Reduction.AVG, layout=Layout.HWC), (7, 7, 96)) == (96,)
    assert reduced_shape(LayerSpec("x", Reduction.CLS, layout=Layout.TD), (197, 768)) == (768,)


def test_method_costs_are_those_the_proto_documents():
    # passes x (1 + 2k), plus SmoothGrad's clean forward; defaults: 32 steps, 16 samples.
    costs = {m: AttributionSpec("m", m).cost for m in Method}
    assert costs == {Method.GRAD_CAM: 3, Method.HIRES_CAM: 3, Method.LAYER_CAM: 3,
                     Method.GRADIENT: 3, Method.GRADIENT_X_INPUT: 3,
                     Method.INTEGRATED_GRADIENTS: 33 * 3, Method.SMOOTH_GRAD: 16 * 3 + 1}
    assert AttributionSpec("m", Method.INTEGRATED_GRADIENTS, top_k=2, ig_steps=4).cost == 5 * 5
    assert {m for m in Method if m.is_cam} == {Method.GRAD_CAM, Method.HIRES_CAM,
                                              Method.LAYER_CAM}
