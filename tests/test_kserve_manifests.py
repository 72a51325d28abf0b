"""Offline checks of deploy/kserve (no cluster): the ServingRuntime and the
InferenceService agree with each other and with the server, and the runtime's
container validates against the Kubernetes schema (as tests/test_manifests.py does for
deploy/k8s). KServe's own kinds are custom resources, so their fields are checked
here."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hookserve.cli import build_parser

from helpers import K8S_VERSIONS, env_names, kubernetes_validate

KSERVE = Path(__file__).resolve().parents[1] / "deploy" / "kserve"


def load(name: str) -> dict:
    (doc,) = [d for d in yaml.safe_load_all((KSERVE / name).read_text()) if d]
    return doc


def test_runtime_and_service_agree():
    rt, isvc = load("servingruntime.yaml"), load("inferenceservice.yaml")
    assert (rt["apiVersion"], rt["kind"]) == ("serving.kserve.io/v1alpha1", "ServingRuntime")
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1",
                                                  "InferenceService")
    assert {"v2", "grpc-v2"} <= set(rt["spec"]["protocolVersions"])
    model = isvc["spec"]["predictor"]["model"]
    assert model["protocolVersion"] == "v2"
    assert model["runtime"] == rt["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in
                                            rt["spec"]["supportedModelFormats"]}
    env = {e["name"]: e["value"] for e in rt["spec"]["containers"][0]["env"]}
    grace = isvc["spec"]["predictor"]["terminationGracePeriodSeconds"]
    assert grace > float(env["HOOKSERVE_GRACE_SECONDS"])  # the drain fits


def test_runtime_container_matches_the_server():
    (c,) = load("servingruntime.yaml")["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert set(env) <= env_names(), set(env) - env_names()
    build_parser().parse_args(["serve", *c.get("args", [])])  # real flags
    (port,) = c["ports"]
    assert port["name"] == "http1"  # KServe routes REST to this port
    assert int(env["HOOKSERVE_HTTP_PORT"]) == port["containerPort"]
    assert int(env["HOOKSERVE_PORT"]) != port["containerPort"]
    for probe, path in (("readinessProbe", "/v2/health/ready"),
                        ("livenessProbe", "/v2/health/live")):
        assert c[probe]["httpGet"] == {"path": path, "port": port["containerPort"]}
    assert env["HOOKSERVE_DOWNLOAD"] == "0"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_runtime_container_validates(tmp_path, version):
    (c,) = load("servingruntime.yaml")["spec"]["containers"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hookserve"},
           "spec": {"containers": [c]}}
    f = tmp_path / "pod.yaml"
    f.write_text(yaml.safe_dump(pod))
    kubernetes_validate([str(f)], version)
