"""The SDK's value lists agree with the proto: every enum member but UNSPECIFIED is in
each client table once, no table holds a value the proto lacks, and the command line,
the Ray adapter and `hookserve batch` take their choices from these tables."""

from __future__ import annotations

import pytest

from hookserve import tables
from hookserve.cli import build_parser
from hookserve.v1 import hookserve_pb2 as pb

#: (proto enum, its prefix, name -> wire table, tables keyed by wire value)
LISTS = {
    "reduction": (pb.Reduction, "REDUCTION_", tables.REDUCTIONS, [tables.REDUCED_SHAPES]),
    "dtype": (pb.DType, "DTYPE_", tables.DTYPES, [tables.NUMPY_DTYPES]),
    "method": (pb.AttributionMethod, "ATTRIBUTION_METHOD_", tables.METHODS,
               [tables.TAKES_LAYER]),
    "score": (pb.AttributionScore, "ATTRIBUTION_SCORE_", tables.SCORES, []),
    "baseline": (pb.AttributionBaseline, "ATTRIBUTION_BASELINE_", tables.BASELINES, []),
}


def _members(enum, prefix: str) -> dict[str, int]:
    return {name: number for name, number in enum.items()
            if name != f"{prefix}UNSPECIFIED"}


@pytest.mark.parametrize("which", sorted(LISTS))
def test_every_proto_member_is_in_every_client_table(which):
    enum, prefix, names, keyed = LISTS[which]
    proto = _members(enum, prefix)
    # Name -> wire: the proto's members, in the proto's order, each once.
    assert list(names.values()) == list(proto.values()), which
    assert len(set(names)) == len(names)
    for table in keyed:
        missing = set(proto.values()) - set(table)
        extra = set(table) - set(proto.values())
        assert not missing, f"{which}: no client entry for {[enum.Name(v) for v in missing]}"
        assert not extra, f"{which}: client entries the proto lacks: {sorted(extra)}"


def test_a_member_missing_from_a_table_is_found():
    # The check above would catch a table that lost an entry (or gained one).
    enum, prefix, _, _ = LISTS["reduction"]
    short = dict(tables.REDUCED_SHAPES)
    short.pop(pb.REDUCTION_STATS)
    assert set(_members(enum, prefix).values()) - set(short) == {pb.REDUCTION_STATS}


def test_names_are_the_members_names():
    assert list(tables.REDUCTIONS) == ["none", "avg", "max", "flatten", "stats", "cls"]
    assert list(tables.DTYPES) == ["float32", "float16", "bfloat16"]
    assert list(tables.METHODS) == ["grad_cam", "hires_cam", "layer_cam", "gradient",
                                    "gradient_x_input", "integrated_gradients",
                                    "smooth_grad"]
    assert list(tables.SCORES) == ["logit", "softmax"]
    assert list(tables.BASELINES) == ["zeros", "black"]
    assert tables.CAM_METHODS == ("grad_cam", "hires_cam", "layer_cam")


def test_reduced_shapes_are_those_the_proto_documents():
    shapes = {r: tables.reduced_shape(r, (8, 5, 3)) for r in tables.REDUCTIONS if r != "cls"}
    assert shapes == {"none": (8, 5, 3), "avg": (8,), "max": (8,), "flatten": (120,),
                      "stats": (8, len(tables.STATS_COLUMNS))}
    assert tables.reduced_shape("stats", (10,)) == (1, 5)  # a vector: one row
    # the channels are kept whatever the layout; cls is a token map's token 0
    assert tables.reduced_shape("avg", (7, 7, 768), "HWC") == (768,)
    assert tables.reduced_shape("stats", (197, 768), "TD") == (768, 5)
    assert tables.reduced_shape("none", (7, 7, 768), "HWC") == (7, 7, 768)
    assert tables.reduced_shape("cls", (197, 768), "TD") == (768,)
    assert [r for r in tables.REDUCTIONS if tables.follows_size(r)] == ["none", "flatten"]


def test_numpy_dtypes_have_the_wire_sizes():
    assert {n: tables.numpy_dtype(n).itemsize for n in tables.DTYPES} == {
        "float32": 4, "float16": 2, "bfloat16": 2}


def test_input_port_is_read_in_one_rule():
    assert tables.split_port("layer3:input") == ("layer3", True)
    assert tables.split_port("layer3") == ("layer3", False)
    assert tables.split_port("features.3") == ("features.3", False)
    assert tables.split_port("a:b") == ("a:b", False)


def _choices(parser, command: str) -> dict[str, list]:
    sub = parser._subparsers._group_actions[0].choices[command]
    return {a.dest: list(a.choices) for a in sub._actions if a.choices is not None}


def test_the_cli_offers_exactly_the_tables():
    parser = build_parser()
    for command in ("extract", "batch"):
        got = _choices(parser, command)
        assert got["reduction"] == list(tables.REDUCTIONS), command
        assert got["dtype"] == list(tables.DTYPES), command
    got = _choices(parser, "attribute")
    assert got["method"] == list(tables.METHODS)
    assert got["score"] == list(tables.SCORES)
    assert got["baseline"] == list(tables.BASELINES)


def test_batch_layers_take_the_tables_reductions_and_the_input_port():
    from hookserve.batch.errors import Abort
    from hookserve.batch.spec import parse_layers

    layers = parse_layers(["layer4:avg,fc,layer3:input:stats,layer2:input"], "max")
    assert [(la.name, la.reduction) for la in layers] == [
        ("layer4", "avg"), ("fc", "max"), ("layer3:input", "stats"),
        ("layer2:input", "max")]
    with pytest.raises(Abort, match="--layers layer4:mean: a reduction after ':' is one of "
                                    "none, avg, max, flatten, stats"):
        parse_layers(["layer4:mean"], "none")
    with pytest.raises(Abort, match="--layers gives layer4 twice"):
        parse_layers(["layer4:avg", "layer4"], "none")


@pytest.mark.parametrize("item", ["layer4:avg", "layer4", "layer3:input", "layer3:input:stats",
                                  "layer4:mean", "features.0:input:bogus"])
def test_extract_and_batch_read_a_layers_item_alike(item):
    """`hookserve extract` and `hookserve batch` take one --layers syntax: the same
    layer and reduction, or the same refusal."""
    from hookserve.batch.errors import Abort
    from hookserve.batch.spec import parse_layers
    from hookserve.cli import _layer_options

    try:
        opts = _layer_options([item])
    except ValueError as exc:
        with pytest.raises(Abort) as refused:
            parse_layers([item], "none")
        assert str(refused.value) == str(exc)
        return
    [(name, o)] = opts.items()
    [layer] = parse_layers([item], "flatten")
    assert (layer.name, layer.reduction) == (name, (o or {}).get("reduction", "flatten"))


def test_batch_flag_defaults_are_declared_once():
    from hookserve.batch.defaults import DEFAULTS

    args = vars(build_parser().parse_args(["batch", "in", "--out", "o", "--layers", "fc"]))
    for given in ("command", "func", "inputs", "out", "layers", "server"):
        del args[given]
    assert args == DEFAULTS
