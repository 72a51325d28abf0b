"""Observability: the Prometheus endpoint (--metrics-port) and the one-line-per-call log.

A real server with --metrics-port 0; the endpoint is scraped over HTTP before and after
real calls, and the differences must match what the client saw.
"""

from __future__ import annotations

import json
import logging
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import hookserve
from hookserve.cli import build_parser
from hookserve_server.app import start_metrics

from conftest import RunningServer, encode, rand_image
from helpers import R18, wait_until

FLAGS = (*R18, "--max-batch-delay-ms", "20", "--metrics-port", "0")


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """GET /metrics -> {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    out[("__families__", ())] = {f.name for f in text_string_to_metric_families(text)}
    return out


def call_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hookserve.calls"]


def delta(after, before, name, **labels) -> float:
    if name == "hookserve_requests_total":  # set for Attribute calls only
        labels.setdefault("attribution_method", "")
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def metrics_server():
    # Module-scoped: one server (and one warm-up) for every test here.
    s = RunningServer(list(FLAGS))
    yield s
    s.stop(2.0)


def test_metrics_count_what_the_client_saw(metrics_server):
    port = metrics_server.metrics_port
    assert port
    before = scrape(port)
    images = [encode(rand_image(64, 64, seed=i)) for i in range(5)] + [b"not an image"]
    with metrics_server.client(timeout=120) as c:
        results = list(c.extract_many(images, ["layer4", "avgpool"], native=True))
        one = c.extract(encode(rand_image(48, 48, seed=9)), "layer1", native=True)
    ok = [r for r in results if r.ok]
    assert len(ok) == 5 and not results[5].ok
    sent = sum(a.nbytes for r in ok for a in r.features.values()) + one["layer1"].nbytes
    after = scrape(port)

    # requests and images by model and status code
    # extract_many is an Extract stream; extract() of one image is ExtractImage
    assert delta(after, before, "hookserve_requests_total",
                 method="Extract", model="resnet18", code="OK") == 1
    assert delta(after, before, "hookserve_requests_total",
                 method="ExtractImage", model="resnet18", code="OK") == 1
    assert delta(after, before, "hookserve_images_total", model="resnet18", code="OK") == 6
    assert delta(after, before, "hookserve_images_total",
                 model="resnet18", code="INVALID_ARGUMENT") == 1
    # bytes sent: exactly the tensor bytes the client received
    assert delta(after, before, "hookserve_bytes_sent_total", model="resnet18") == sent
    # latency histograms: one observation per decoded image / answered image / batch
    assert delta(after, before, "hookserve_preprocess_seconds_count") >= 6
    assert delta(after, before, "hookserve_queue_wait_seconds_count") == 6
    assert delta(after, before, "hookserve_serialize_seconds_count") == 6
    batches = delta(after, before, "hookserve_forward_seconds_count", model="resnet18")
    assert 1 <= batches <= 6
    assert delta(after, before, "hookserve_forward_seconds_sum", model="resnet18") > 0
    # batch size histogram: its sum is the number of images that went through the model
    assert delta(after, before, "hookserve_batch_size_count", model="resnet18") == batches
    assert delta(after, before, "hookserve_batch_size_sum", model="resnet18") == 6
    # queue depth is a gauge per device, back to 0 when idle
    assert after[("hookserve_queue_depth", (("device", "cpu"),))] == 0
    # device memory: declared always; it has a sample per CUDA device (none on a CPU host)
    assert "hookserve_device_memory_bytes" in after[("__families__", ())]


def test_failed_call_is_counted_by_code(metrics_server):
    port = metrics_server.metrics_port
    before = scrape(port)
    with metrics_server.client(timeout=60) as c, pytest.raises(hookserve.errors.InvalidArgument):
        c.extract(encode(rand_image(32, 32)), "no_such_layer")
    after = scrape(port)
    assert delta(after, before, "hookserve_requests_total",
                 method="ExtractImage", model="resnet18", code="INVALID_ARGUMENT") == 1
    assert delta(after, before, "hookserve_requests_total",
                 method="ExtractImage", model="resnet18", code="OK") == 0


def test_one_structured_log_line_per_call_without_image_data(metrics_server, caplog):
    payload = encode(rand_image(64, 64, seed=3))
    with caplog.at_level(logging.INFO, logger="hookserve.calls"):
        with metrics_server.client(timeout=60) as c:
            feats = c.extract(payload, ["layer2", "layer4"], reduction="avg", native=True)
            list(c.extract_many([payload, payload], "layer3", native=True))
        # The line is written when the server-side call finishes, just after the client
        # has its last answer: wait for it (a real condition, bounded).
        wait_until(lambda: len(call_lines(caplog)) >= 2, 10, "two call log lines")
    lines = call_lines(caplog)
    assert len(lines) == 2
    first, second = (json.loads(x) for x in lines)
    for rec in (first, second):
        assert "\n" not in json.dumps(rec)
        assert {"model", "layers", "images", "bytes", "seconds", "code"} <= rec.keys()
        assert rec["model"] == "resnet18" and rec["code"] == "OK"
        assert rec["seconds"] > 0
    assert first["layers"] == ["layer2", "layer4"] and first["images"] == 1
    assert first["bytes"] == sum(a.nbytes for a in feats.values())
    assert second["layers"] == ["layer3"] and second["images"] == 2
    assert second["bytes"] > first["bytes"]
    # no image data: neither raw bytes nor any long blob (base64, hex, lists of pixels)
    for line in lines:
        assert len(line) < 600
        assert payload[:16].hex() not in line
        assert not any(isinstance(v, (list, str)) and len(str(v)) > 200
                       for v in json.loads(line).values())


def test_unary_calls_and_unknown_models_are_counted_and_logged(metrics_server, caplog):
    port = metrics_server.metrics_port
    before = scrape(port)
    caplog.set_level(logging.INFO, logger="hookserve.calls")
    with metrics_server.client(timeout=60) as c:
        c.list_models()
        c.describe("resnet18")
        for name in ("nope-1", "nope-2"):  # random names must not become label values
            with pytest.raises(hookserve.errors.NotFound):
                c.describe(name)
    after = scrape(port)
    assert delta(after, before, "hookserve_requests_total",
                 method="ListModels", model="", code="OK") == 1
    assert delta(after, before, "hookserve_requests_total",
                 method="DescribeModel", model="resnet18", code="OK") == 1
    assert delta(after, before, "hookserve_requests_total",
                 method="DescribeModel", model="unknown", code="NOT_FOUND") == 2
    assert not any("nope" in str(k) for k in after)
    lines = [json.loads(x) for x in call_lines(caplog)]
    assert [(x["method"], x["code"]) for x in lines] == [
        ("ListModels", "OK"), ("DescribeModel", "OK"), ("DescribeModel", "NOT_FOUND"),
        ("DescribeModel", "NOT_FOUND")]


def test_attribute_calls_name_the_rpc_and_the_attribution_method(metrics_server, caplog):
    port = metrics_server.metrics_port
    before = scrape(port)
    caplog.set_level(logging.INFO, logger="hookserve.calls")
    img = encode(rand_image(64, 64, seed=4))

    def attribute_lines() -> list[dict]:  # (the SDK may ask ListModels first)
        lines = (json.loads(x) for x in call_lines(caplog))
        return [x for x in lines if x["method"] == "Attribute"]

    with metrics_server.client(timeout=120) as c:
        c.attribute(img, layer="layer4", method="grad_cam")
        c.attribute(img, layer="layer4", method="layer_cam")
        c.attribute(img, layer=None, method="gradient")
        wait_until(lambda: len(attribute_lines()) >= 3, 10, "three Attribute log lines")
    after = scrape(port)
    lines = attribute_lines()
    assert [(x["method"], x["attribution_method"], x["code"]) for x in lines] == [
        ("Attribute", "grad_cam", "OK"), ("Attribute", "layer_cam", "OK"),
        ("Attribute", "gradient", "OK")]
    assert lines[0]["layers"] == ["layer4"] and lines[2]["layers"] == []
    for method in ("grad_cam", "layer_cam", "gradient"):
        assert delta(after, before, "hookserve_requests_total", method="Attribute",
                     model="resnet18", code="OK", attribution_method=method) == 1
    # every other RPC keeps an empty attribution_method
    assert not any(dict(labels).get("attribution_method")
                   for (name, labels) in after if name == "hookserve_requests_total"
                   and dict(labels).get("method") != "Attribute")


def test_metrics_bind_loopback_unless_told(monkeypatch):
    pytest.importorskip("prometheus_client")
    from hookserve_server.metrics import PrometheusTelemetry

    args = build_parser().parse_args(["serve", "--metrics-port", "0"])
    assert args.metrics_host == "127.0.0.1"
    addr, port = start_metrics(PrometheusTelemetry(), args)
    assert addr == "127.0.0.1"
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    monkeypatch.setenv("HOOKSERVE_METRICS_HOST", "[::]")
    args = build_parser().parse_args(["serve", "--metrics-port", "0"])
    addr, _ = start_metrics(PrometheusTelemetry(), args)
    assert addr == "0.0.0.0"  # the wildcard, IPv4 (works where IPv6 is off)
