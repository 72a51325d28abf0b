"""Offline checks of the Dockerfile and the deployment manifests (no Docker, no cluster).

- hadolint passes on the Dockerfile, and every ignore carries a reason;
- every Kubernetes manifest validates against the API schemas (kubernetes-validate,
  strict: unknown fields fail) for the oldest supported and the newest Kubernetes;
- the manifests agree with the code: flags and HOOKSERVE_* variables they use exist,
  probe and Service ports match the container, grace periods cover the drain, the
  Indexed Job's shard count matches its completions;
- docker-compose.yml has two replicas (and `docker-compose config` accepts it when
  docker-compose is installed).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hookserve.cli import build_parser

from helpers import K8S_VERSIONS, env_names, kubernetes_validate, tool

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
DOCKERFILE = ROOT / "Dockerfile"
#: The batch Job's backoffLimitPerIndex and podReplacementPolicy are on by default from 1.29.
JOB_K8S_VERSIONS = ("1.29.0", "1.37.0")
JOB_FILE = "job-batch.yaml"


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind() -> dict[str, dict]:
    out = {}
    for f in sorted(K8S.glob("*.yaml")):
        for d in docs(f):
            out[d["kind"]] = d
    return out


# ---------------------------------------------------------------- Dockerfile
def test_hadolint_passes():
    p = subprocess.run([tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_hadolint_ignores_are_justified():
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            before = [x for x in lines[max(0, i - 4):i] if x.startswith("#")
                      and "hadolint" not in x]
            assert before, f"Dockerfile line {i + 1}: hadolint ignore without a reason"


def test_dockerfile_shape():
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert len(froms) >= 2 and froms[-1] == "${BASE_IMAGE}"  # multi-stage, slim final
    assert re.search(r"^ARG BASE_IMAGE=python:3\.\d+-slim$", text, re.M)
    assert 'ENTRYPOINT ["hookserve", "serve"]' in text
    assert re.search(r"^USER 1000", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n.*hookserve health", text, re.M)
    assert "org.opencontainers.image.revision" in text
    assert not re.search(r"^RUN --mount", text, re.M)  # the legacy builder: no BuildKit
    # torch is installed before any of our code is copied (code edits keep that layer)
    assert text.index("$TORCH_SPEC") < text.index("COPY client")


def test_dockerfile_env_defaults_are_real_serve_settings():
    text = DOCKERFILE.read_text()
    used = set(re.findall(r"\b(HOOKSERVE_[A-Z_]+)=", text))
    assert used, "no HOOKSERVE_* defaults found"
    assert used <= env_names(), used - env_names()
    assert "HOOKSERVE_DOWNLOAD=0" in text  # start-up never downloads weights


def test_dockerignore_keeps_the_context_small():
    rules = (ROOT / ".dockerignore").read_text().split()
    assert rules[rules.index("*") if "*" in rules else -1] == "*"  # deny by default
    for needed in ("!pyproject.toml", "!client/", "!service/", "!deploy/wheels/"):
        assert needed in rules


# ---------------------------------------------------------------- Kubernetes
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_schema(version):
    files = sorted(str(f) for f in K8S.glob("*.yaml") if f.name != JOB_FILE)
    assert len(files) >= 3
    kubernetes_validate(files, version)


@pytest.mark.parametrize("version", JOB_K8S_VERSIONS)
def test_batch_job_validates_against_schema(version):
    kubernetes_validate([str(K8S / JOB_FILE)], version)


def test_batch_job_fails_a_shard_not_the_job():
    """Retries per shard; exit code 2 (a user error) fails the shard at once; evictions
    are not counted; a replacement pod starts only after the old one is gone."""
    spec = by_kind()["Job"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert "backoffLimit" not in spec  # per index instead (it would cap all shards at once)
    assert 1 <= spec["backoffLimitPerIndex"] <= 6
    assert 0 <= spec["maxFailedIndexes"] < spec["completions"]
    assert spec["podReplacementPolicy"] == "Failed"
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    (c,) = spec["template"]["spec"]["containers"]
    rules = spec["podFailurePolicy"]["rules"]
    user_error = [r for r in rules if "onExitCodes" in r]
    assert len(user_error) == 1
    (r,) = user_error
    assert r["action"] == "FailIndex"
    assert r["onExitCodes"] == {"containerName": c["name"], "operator": "In", "values": [2]}
    # ...and 2 is what `hookserve batch` exits with on a user error
    from hookserve import batch
    assert batch.EXIT_CANNOT_PROCEED == 2
    disruption = [r for r in rules if "onPodConditions" in r]
    assert [(r["action"], r["onPodConditions"][0]["type"]) for r in disruption] == \
        [("Ignore", "DisruptionTarget")]


def test_deployment_matches_the_server():
    k = by_kind()
    dep, svc = k["Deployment"], k["Service"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e["value"] for e in c.get("env", [])}
    assert set(env) <= env_names(), set(env) - env_names()
    # its args parse with the real `hookserve serve` parser
    args = build_parser().parse_args(["serve", *c.get("args", [])])
    assert args.device.startswith("cuda:")
    # GPU limits
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    # native gRPC probes on the container's gRPC port
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["grpc"]["port"] == ports["grpc"] == 50051
    # the pod's grace period covers the server's drain
    assert pod["terminationGracePeriodSeconds"] > float(env["HOOKSERVE_GRACE_SECONDS"])
    # weights come from the image or a volume, never a download
    assert env["HOOKSERVE_DOWNLOAD"] == "0"
    # runs as the image's non-root user
    assert pod["securityContext"]["runAsNonRoot"] is True
    # the headless Service selects these pods and exposes the gRPC port
    assert svc["spec"]["clusterIP"] == "None"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert {"grpc": 50051, "metrics": 9090} == {p["name"]: p["port"]
                                                for p in svc["spec"]["ports"]}


def test_indexed_job_shards_the_data_set():
    k = by_kind()
    job, svc = k["Job"], k["Service"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    (c,) = spec["template"]["spec"]["containers"]
    argv = [*c["command"], *c["args"]]
    assert argv[:2] == ["hookserve", "batch"]
    shard = next(a for a in argv if a.startswith("--shard"))
    index, n = shard.split("=", 1)[1].split("/")
    assert index == "$(JOB_COMPLETION_INDEX)"
    assert int(n) == spec["completions"]
    server = next(a for a in argv if a.startswith("--server")).split("=", 1)[1]
    assert server.startswith(f"dns:///{svc['metadata']['name']}.")
    assert server.endswith(":50051")
    # the arguments are real `hookserve batch` flags
    parser = build_parser()
    concrete = [a.replace("$(JOB_COMPLETION_INDEX)", "3") for a in argv[1:]]
    ns = parser.parse_args(concrete)
    assert ns.command == "batch"
    # a sharded run: every pod shares one --out (parts and markers, no lock)
    from hookserve.batch.command import wants_shards
    assert wants_shards(ns)
    assert "JOB_COMPLETION_INDEX" not in ns.out


def test_batch_job_image_is_built_with_the_extras_it_uses():
    """The Job names an image and how to build it: from this Dockerfile, with EXTRAS
    that cover every URL scheme and output format its arguments use."""
    text = (K8S / JOB_FILE).read_text()
    (build,) = re.findall(r"^#\s+(docker build .*)$", text, re.M)
    words = shlex.split(build)
    assert words[-1] == "."  # the repository root, where the Dockerfile is
    tag = words[words.index("-t") + 1]
    build_args = dict(w.split("=", 1) for w in words[1:] if "=" in w and not w.startswith("-"))
    (c,) = by_kind()["Job"]["spec"]["template"]["spec"]["containers"]
    assert c["image"] == tag
    extras = set(build_args["EXTRAS"].split(","))
    argv = " ".join(c["args"])
    out = next(a for a in c["args"] if a.startswith("--out="))
    needed = {"s3"} if "s3://" in argv else set()
    needed |= {"gcs"} if "gs://" in argv else set()
    needed |= {"batch"} if out.endswith((".parquet", ".h5")) else set()
    assert needed and needed <= extras, (needed, extras)
    # ...every one of them is a real extra of the package, and the Dockerfile takes the
    # build arguments (an empty TORCH_SPEC: no torch in a client image)
    import tomllib
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras <= set(declared)
    docker = DOCKERFILE.read_text()
    for arg in build_args:
        assert re.search(rf"^ARG {arg}=", docker, re.M), arg
    if build_args.get("TORCH_SPEC") == "":
        assert 'if [ -n "$TORCH_SPEC" ]' in docker
        assert "server" not in extras  # `hookserve serve` needs torch
    # the Dockerfile's own requirement list for those extras holds what they need
    line = next(x for x in docker.splitlines() if "tomllib.load" in x)
    code = re.search(r'python -c "(.*?)" "\$EXTRAS"', line).group(1)
    code = code.replace("/src/pyproject.toml", str(ROOT / "pyproject.toml"))
    reqs = subprocess.run([sys.executable, "-c", code, build_args["EXTRAS"]], check=True,
                          capture_output=True, text=True, timeout=60).stdout.split()
    names = {re.split(r"[<>=\[]", r)[0] for r in reqs}
    assert {"s3fs", "fsspec", "pyarrow", "grpcio"} <= names and "torch" not in names
    # and docs/deploy.md shows the same command
    assert " ".join(words) in " ".join((ROOT / "docs" / "deploy.md").read_text().split())


def test_servers_listen_on_every_interface_explicitly(monkeypatch):
    """`hookserve serve` listens on loopback unless told; the image, the Deployment and
    docker compose each say every interface themselves."""
    wildcard = ("[::]", "0.0.0.0")
    for k in [k for k in os.environ if k.startswith("HOOKSERVE_")]:
        monkeypatch.delenv(k)
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
    env = dict(re.findall(r"\b(HOOKSERVE_[A-Z_]+)=(\S+)", DOCKERFILE.read_text()))
    assert env["HOOKSERVE_HOST"] in wildcard
    (c,) = by_kind()["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert build_parser().parse_args(["serve", *c["args"]]).host in wildcard
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    for svc in compose["services"].values():
        assert svc["environment"]["HOOKSERVE_HOST"] in wildcard


# ---------------------------------------------------------------- docker compose
def test_compose_runs_two_replicas_that_drain_cleanly():
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    services = compose["services"]
    assert len(services) >= 2
    host_ports = set()
    for svc in services.values():
        env = svc["environment"]
        assert set(env) <= env_names(), set(env) - env_names()
        grace = float(env["HOOKSERVE_GRACE_SECONDS"])
        assert float(svc["stop_grace_period"].rstrip("s")) > grace
        host_ports.update(p.rsplit(":", 1)[0] for p in svc["ports"])
    assert len(host_ports) == 2 * len(services)  # every replica reachable on its own port


def test_compose_config_is_accepted_by_docker_compose(tmp_path):
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed")
    for files in (["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"]):
        cmd = [exe, *sum((["-f", str(ROOT / "deploy" / f)] for f in files), []), "config",
               "-q"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, shlex.join(cmd) + "\n" + p.stderr
