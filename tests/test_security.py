"""Only the right clients get in: TLS, mutual TLS and bearer tokens, proven both ways
(the right client is accepted, each wrong one refused). Plus: weights are loaded with
weights_only=True, and nothing a client sends becomes a filesystem path.

Certificates are generated per session with `cryptography` (tests/certs.py).
"""

from __future__ import annotations

import ast
import pathlib
import pickle

import grpc
import pytest
import torch
import torchvision

import hookserve
from hookserve_server.errors import ConfigError

from conftest import TOKEN, RunningServer, rand_image
from helpers import small_server

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASE = small_server("--max-batch-delay-ms", "2")


@pytest.fixture(scope="module")
def tls_server(pki):
    s = RunningServer(BASE + ["--tls-cert", str(pki["server"].cert_path),
                              "--tls-key", str(pki["server"].key_path)])
    yield s
    s.stop(2.0)


@pytest.fixture(scope="module")
def mtls_server(pki):
    s = RunningServer(BASE + ["--tls-cert", str(pki["server"].cert_path),
                              "--tls-key", str(pki["server"].key_path),
                              "--tls-client-ca", str(pki["client_ca"].path)])
    yield s
    s.stop(2.0)


def works(c: hookserve.Client) -> None:
    assert [m.name for m in c.list_models()] == ["resnet18"]
    assert c.extract(rand_image(32, 32), "conv1", reduction="avg")["conv1"].shape == (64,)


def refused(c: hookserve.Client,
            code=grpc.StatusCode.UNAVAILABLE) -> hookserve.errors.HookserveError:
    with pytest.raises(hookserve.errors.HookserveError) as e:
        c.list_models()
    assert e.value.code == code, e.value
    with pytest.raises(hookserve.errors.HookserveError) as e2:
        c.extract(rand_image(32, 32), "conv1", reduction="avg")
    assert e2.value.code == code, e2.value
    return e.value


# -- TLS -------------------------------------------------------------------------------


def test_tls_accepts_a_client_that_trusts_the_server_ca(tls_server, pki):
    with hookserve.Client(f"grpcs://{tls_server.address}", timeout=30,
                          root_certificates=pki["server_ca"].path) as c:
        works(c)
    # CA given as PEM bytes, host named by its DNS SAN.
    with hookserve.Client(f"grpcs://localhost:{tls_server.port}", timeout=30,
                          root_certificates=pki["server_ca"].pem) as c:
        works(c)


@pytest.mark.parametrize("how", ["plaintext", "other-ca", "system-roots"])
def test_tls_refuses_clients_that_cannot_verify_it(tls_server, pki, how):
    if how == "plaintext":
        c = hookserve.Client(tls_server.address, timeout=10, retries=0)
    elif how == "other-ca":
        c = hookserve.Client(f"grpcs://{tls_server.address}", timeout=10, retries=0,
                             root_certificates=pki["rogue_ca"].pem)
    else:
        c = hookserve.Client(f"grpcs://{tls_server.address}", timeout=10, retries=0)
    with c:
        refused(c)


def test_client_refuses_a_server_with_a_certificate_from_another_ca(pki):
    s = RunningServer(BASE + ["--tls-cert", str(pki["rogue_server"].cert_path),
                              "--tls-key", str(pki["rogue_server"].key_path)])
    try:
        with hookserve.Client(f"grpcs://{s.address}", timeout=10, retries=0,
                              root_certificates=pki["server_ca"].pem) as c:
            refused(c)
    finally:
        s.stop(1.0)


# -- mutual TLS ------------------------------------------------------------------------


def test_mtls_accepts_a_client_certificate_signed_by_the_client_ca(mtls_server, pki):
    with hookserve.Client(f"grpcs://{mtls_server.address}", timeout=30,
                          root_certificates=pki["server_ca"].path,
                          certificate_chain=pki["client"].cert_path,
                          private_key=pki["client"].key_path) as c:
        works(c)


@pytest.mark.parametrize("how", ["no-client-cert", "rogue-client-cert", "plaintext"])
def test_mtls_refuses_clients_without_a_trusted_certificate(mtls_server, pki, how):
    kw = {"root_certificates": pki["server_ca"].pem}
    target = f"grpcs://{mtls_server.address}"
    if how == "rogue-client-cert":
        kw.update(certificate_chain=pki["rogue_client"].cert, private_key=pki["rogue_client"].key)
    elif how == "plaintext":
        kw, target = {}, mtls_server.address
    with hookserve.Client(target, timeout=10, retries=0, **kw) as c:
        refused(c)
    # The refused handshakes cost the server nothing: the right client still works.
    with hookserve.Client(target if how != "plaintext" else f"grpcs://{mtls_server.address}",
                          timeout=30, root_certificates=pki["server_ca"].pem,
                          certificate_chain=pki["client"].cert,
                          private_key=pki["client"].key) as c:
        works(c)


@pytest.mark.parametrize("flags, words", [
    (["--tls-cert", "CERT"], "--tls-cert and --tls-key go together"),
    (["--tls-key", "KEY"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "CA"], "--tls-client-ca needs --tls-cert"),
    (["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"],
     "cannot read --tls-cert"),
])
def test_tls_misconfiguration_is_a_clear_startup_error(pki, flags, words):
    paths = {"CERT": str(pki["server"].cert_path), "KEY": str(pki["server"].key_path),
             "CA": str(pki["client_ca"].path)}
    with pytest.raises(ConfigError, match=words):
        RunningServer(BASE + [paths.get(f, f) for f in flags], start=False)


# -- bearer token ----------------------------------------------------------------------


def test_token_accepted(token_server):
    with token_server.client(timeout=30, token=TOKEN) as c:
        works(c)
        assert c.describe("resnet18").layer("conv1").shape == (64, 112, 112)


def test_token_from_environment(token_server, monkeypatch):
    monkeypatch.setenv("HOOKSERVE_TOKEN", TOKEN)
    with token_server.client(timeout=30) as c:
        works(c)


@pytest.mark.parametrize("token, words", [
    (None, "missing bearer token"),
    ("wrong", "invalid bearer token"),
    (TOKEN + "x", "invalid bearer token"),
    (TOKEN[:-1], "invalid bearer token"),
])
def test_wrong_or_missing_token_is_unauthenticated(token_server, monkeypatch, token, words):
    monkeypatch.delenv("HOOKSERVE_TOKEN", raising=False)
    with token_server.client(timeout=10, token=token, retries=0) as c:
        err = refused(c, grpc.StatusCode.UNAUTHENTICATED)
        assert isinstance(err, hookserve.errors.Unauthenticated)
        assert words in err.message
        with pytest.raises(hookserve.errors.Unauthenticated):
            c.describe("resnet18")


def test_token_must_come_as_a_bearer_header(token_server):
    # The raw token without "Bearer ", or under another scheme, is refused too.
    from hookserve.v1 import hookserve_pb2 as pb
    from hookserve.v1 import hookserve_pb2_grpc as pb_grpc

    with grpc.insecure_channel(token_server.address) as ch:
        stub = pb_grpc.FeatureExtractorStub(ch)
        for value in (TOKEN, f"Basic {TOKEN}", f"bearer  {TOKEN}"):
            with pytest.raises(grpc.RpcError) as e:
                stub.ListModels(pb.ListModelsRequest(), timeout=10,
                                metadata=(("authorization", value),))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.ListModels(pb.ListModelsRequest(), timeout=10,
                               metadata=(("authorization", f"Bearer {TOKEN}"),)).models
        # the scheme is case-insensitive
        assert stub.ListModels(pb.ListModelsRequest(), timeout=10,
                               metadata=(("authorization", f"bearer {TOKEN}"),)).models


def test_health_stays_open_without_a_token(token_server, monkeypatch):
    monkeypatch.delenv("HOOKSERVE_TOKEN", raising=False)
    with token_server.client(timeout=10) as c:
        assert c.health() == "SERVING"
        assert c.health("hookserve.v1.FeatureExtractor") == "SERVING"


def test_empty_token_file_is_refused_at_startup(tmp_path):
    f = tmp_path / "token"
    f.write_text("  \n")
    with pytest.raises(ConfigError, match="is empty"):
        RunningServer(BASE + ["--auth-token-file", str(f)], start=False)


def test_auth_uses_constant_time_comparison():
    src = (ROOT / "service/hookserve_server/server.py").read_text()
    assert "hmac.compare_digest(" in src


# -- weights and paths -----------------------------------------------------------------


class _Exploit:
    """A pickle that would create a file when unpickled without weights_only."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_malicious_weights_file_runs_no_code(tmp_path):
    marker = tmp_path / "pwned"
    sd = torchvision.models.resnet18().state_dict()
    sd["evil"] = _Exploit(str(marker))
    path = tmp_path / "evil.pth"
    with open(path, "wb") as fh:
        pickle.dump(sd, fh)
    torch.save({"a": _Exploit(str(marker))}, tmp_path / "evil2.pth")
    for p in (path, tmp_path / "evil2.pth"):
        with pytest.raises(ConfigError, match="not a file torch.save writes|runs no code"):
            RunningServer(["--model", "resnet18", "--weights", str(p)], start=False)
    assert not marker.exists()


def test_every_torch_load_in_the_server_uses_weights_only():
    calls = 0
    for f in (ROOT / "service/hookserve_server").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "load"
                    and getattr(node.func.value, "id", "") == "torch"):
                calls += 1
                kw = {k.arg: k.value for k in node.keywords}
                assert "weights_only" in kw, f"{f.name}:{node.lineno}"
                assert isinstance(kw["weights_only"], ast.Constant) and kw["weights_only"].value
    assert calls >= 1


def test_client_sent_names_never_become_paths(server, client, tmp_path):
    # A real weights file and real files on the server's disk: naming them as a model or
    # layer finds nothing, and loads nothing.
    weights = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18().state_dict(), weights)
    before = set(server.engine.models)
    for name in (str(weights), "../../../../etc/passwd", "/etc/hostname", "file:///etc/passwd",
                 "resnet18/../vgg11", "~/.cache/torch"):
        with pytest.raises(hookserve.errors.NotFound):
            client.extract(rand_image(32, 32), "conv1", model=name)
        with pytest.raises(hookserve.errors.NotFound):
            client.describe(name)
        with pytest.raises(hookserve.errors.InvalidArgument, match="unknown layer"):
            client.extract(rand_image(32, 32), name)
    assert set(server.engine.models) == before
    # An image id that looks like a path is only echoed back.
    r = next(client.extract_many([rand_image(32, 32)], "conv1", reduction="avg",
                                 ids=["/etc/passwd"]))
    assert r.ok and r.id == "/etc/passwd"


def test_two_authorization_headers_are_unauthenticated(make_server, tmp_path):
    token = tmp_path / "token"
    token.write_text("tok-123\n")
    s = make_server(*BASE, "--auth-token-file", str(token))
    with grpc.insecure_channel(s.address) as ch:
        list_models = ch.unary_unary("/hookserve.v1.FeatureExtractor/ListModels")
        good = ("authorization", "Bearer tok-123")
        assert list_models(b"", metadata=[good], timeout=10) is not None
        for pair in ([good, ("authorization", "Bearer wrong")],
                     [("authorization", "Bearer wrong"), good], [good, good]):
            with pytest.raises(grpc.RpcError) as err:
                list_models(b"", metadata=pair, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "2 authorization headers" in err.value.details()


def test_a_json_log_stays_json_when_peers_misbehave(pki, tmp_path):
    """With --log-format json every stderr line is a JSON object, also when a client
    without a certificate fails the mutual TLS handshake (gRPC's own log line) and
    when a peer sends the REST port something that is not HTTP (uvicorn's)."""
    import json
    import socket
    import ssl

    from helpers import ServeProcess

    srv = pki["server"]
    proc = ServeProcess("--model", "resnet18", "--weights", "random", "--log-format", "json",
                        "--tls-cert", str(srv.cert_path), "--tls-key", str(srv.key_path),
                        "--tls-client-ca", str(pki["client_ca"].path),
                        "--http-port", "0", env={"GRPC_VERBOSITY": None})
    try:
        with hookserve.Client(f"grpcs://localhost:{proc.port}", timeout=10, retries=0,
                              root_certificates=pki["server_ca"].pem) as c, \
                pytest.raises(hookserve.errors.Unavailable):
            c.list_models()   # no client certificate: the handshake fails
        http_port = next(int(json.loads(line)["msg"].rsplit(":", 1)[1].split()[0])
                         for line in list(proc.log) if "REST routes on" in line)
        ctx = ssl.create_default_context(cafile=str(pki["server_ca"].path))
        ctx.load_cert_chain(str(pki["client"].cert_path), str(pki["client"].key_path))
        with socket.create_connection(("127.0.0.1", http_port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(b"GARBAGE\r\n\r\n")
            tls.recv(100)
    finally:
        proc.proc.terminate()
        proc.proc.wait(60)
    lines = [line for line in proc.log if line.strip()]
    assert lines
    for line in lines:
        json.loads(line)   # not JSON: the test fails here, naming the line
