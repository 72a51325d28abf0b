"""One client per peer, same shape: `connect()` gives `(extract, close)` where
`extract(jpeg) -> float32 array` asks for one image's hooked, reduced layer.

Each client thread connects on its own (its own channel or HTTP connection), as
separate users would.
"""

from __future__ import annotations

import base64
import glob
import http.client
import importlib.util
import json
import time
from pathlib import Path

import grpc
import numpy as np

import hookserve

BIG = [("grpc.max_send_message_length", 64 << 20),
       ("grpc.max_receive_message_length", 64 << 20)]


class HookserveCaller:
    """hookserve via the SDK: `Client.extract(jpeg, {layer: {reduction}}, model=...)`."""

    name = "hookserve"

    def __init__(self, address: str, model: str, layer: str, reduce: str,
                 name: str = "hookserve") -> None:
        self.address, self.model, self.layer, self.name = address, model, layer, name
        self.layers = {layer: {"reduction": reduce}} if reduce != "none" else [layer]

    def connect(self):
        c = hookserve.Client(self.address, timeout=600)

        def extract(jpeg: bytes) -> np.ndarray:
            return c.extract(jpeg, self.layers, model=self.model)[self.layer]

        return extract, c.close


class LitServeCaller:
    """LitServe over HTTP/1.1 keep-alive: POST /extract/<model> {"image": base64}."""

    name = "litserve"

    def __init__(self, port: int, model: str) -> None:
        self.port, self.path = port, f"/extract/{model}"

    def wait_ready(self, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                r = conn.getresponse()
                if r.status == 200 and r.read().strip(b'"') == b"ok":
                    return
            except OSError:
                pass
            if time.monotonic() > end:
                raise RuntimeError("LitServe did not become ready")
            time.sleep(0.5)  # start-up poll of a third-party server, not a test sync

    def connect(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)

        def extract(jpeg: bytes) -> np.ndarray:
            body = json.dumps({"image": base64.b64encode(jpeg).decode()})
            conn.request("POST", self.path, body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            if r.status != 200:
                raise RuntimeError(f"LitServe {r.status}: {data[:200]!r}")
            return np.frombuffer(data, np.float32)

        return extract, conn.close


def load_v2_protos(kserve_python: str):
    """KServe's own generated grpc_predict_v2_pb2, loaded from its venv by path (the
    module only needs google.protobuf, which this venv has)."""
    venv = Path(kserve_python).absolute().parent.parent
    hits = glob.glob(str(venv / "lib/python3*/site-packages/kserve/protocol/grpc/"
                         "grpc_predict_v2_pb2.py"))
    if not hits:
        raise RuntimeError(f"kserve's grpc_predict_v2_pb2.py not found under {venv}")
    spec = importlib.util.spec_from_file_location("grpc_predict_v2_pb2", hits[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class KServeCaller:
    """KServe v2 gRPC: ModelInfer, BYTES input in bytes_contents, FP32 raw output."""

    name = "kserve"
    SERVICE = "/inference.GRPCInferenceService/"

    def __init__(self, address: str, model: str, pb) -> None:
        self.address, self.model, self.pb = address, model, pb

    def wait_ready(self, timeout: float = 300) -> None:
        with grpc.insecure_channel(self.address) as ch:
            ready = ch.unary_unary(self.SERVICE + "ModelReady",
                                   request_serializer=self.pb.ModelReadyRequest.SerializeToString,
                                   response_deserializer=self.pb.ModelReadyResponse.FromString)
            if not ready(self.pb.ModelReadyRequest(name=self.model), timeout=timeout,
                         wait_for_ready=True).ready:
                raise RuntimeError(f"KServe model {self.model} not ready")

    def connect(self):
        pb = self.pb
        ch = grpc.insecure_channel(self.address, options=BIG)
        infer = ch.unary_unary(self.SERVICE + "ModelInfer",
                               request_serializer=pb.ModelInferRequest.SerializeToString,
                               response_deserializer=pb.ModelInferResponse.FromString)

        def extract(jpeg: bytes) -> np.ndarray:
            req = pb.ModelInferRequest(model_name=self.model)
            t = req.inputs.add(name="image", datatype="BYTES", shape=[1])
            t.contents.bytes_contents.append(jpeg)
            resp = infer(req, timeout=600)
            return np.frombuffer(resp.raw_output_contents[0], np.float32)

        return extract, ch.close


class FloorCaller:
    """In process, in the bench's own process (the floor): decode + hooked forward."""

    name = "in-process"

    def __init__(self, hooked) -> None:
        self.hooked = hooked

    def connect(self):
        return (lambda jpeg: self.hooked.extract([jpeg])[0]), (lambda: None)
