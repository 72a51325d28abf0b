"""KServe's own clients (`InferenceGRPCClient`, `InferenceRESTClient`, from the kserve
package as published) against a running hookserve. Run by test_oip_kserve.py with the
python of a venv that has kserve (its protobuf pin keeps it out of hookserve's venv):

    python kserve_clients.py JOB.json OUT_DIR

JOB.json: {"grpc": "host:port", "rest": "http://host:port", "token": "...",
"model": "resnet18", "images": [paths], "pixels": "pixels.npy",
"layers": {name: {parameter: value}}}. Writes OUT_DIR/result.json (health, metadata,
errors) and OUT_DIR/<case>.npz (each requested layer's answer) for the test to check.
Needs only kserve and numpy; nothing of hookserve.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import grpc
import httpx
import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, RESTConfig
from kserve.protocol.grpc.grpc_predict_v2_pb2 import ModelMetadataRequest
from kserve.protocol.infer_type import InferInput, InferRequest, RequestedOutput


def image_bytes(paths: list[str], *, typed: bool = False) -> InferInput:
    """IMAGE as BYTES [N]: raw (4-byte length + bytes each) or typed elements."""
    blobs = [Path(p).read_bytes() for p in paths]
    if typed:
        return InferInput("IMAGE", [len(blobs)], "BYTES", data=blobs)
    t = InferInput("IMAGE", [len(blobs)], "BYTES")
    t.set_data_from_numpy(np.array(blobs, dtype=np.object_), binary_data=True)
    return t


def pixels(job: dict) -> InferInput:
    """INPUT__0 as UINT8 [N, H, W, 3] elements: typed contents on gRPC, JSON on REST."""
    px = np.load(job["pixels"])
    t = InferInput("INPUT__0", list(px.shape), "UINT8")
    t.set_data_from_numpy(px, binary_data=False)
    return t


def request(job: dict, inputs: list[InferInput], layers: dict) -> InferRequest:
    outs = [RequestedOutput(name, dict(params)) for name, params in layers.items()]
    return InferRequest(job["model"], inputs, request_outputs=outs)


def arrays(res, names) -> dict:
    return {n: res.get_output_by_name(n).as_numpy() for n in names}


async def grpc_side(job: dict, out: Path) -> dict:
    auth = (("authorization", f"Bearer {job['token']}"),)
    r: dict = {}
    async with InferenceGRPCClient(job["grpc"], timeout=120, retries=0) as c:
        r["live"] = await c.is_server_live(headers=auth)
        r["ready"] = await c.is_server_ready(headers=auth)
        r["model_ready"] = await c.is_model_ready(job["model"], headers=auth)
        r["unknown_model_ready"] = await c.is_model_ready("resnet99", headers=auth)
        # The client has no metadata call of its own: its stub's, on its channel.
        m = await c._client_stub.ModelMetadata(ModelMetadataRequest(name=job["model"]),
                                               metadata=auth, timeout=120)
        r["metadata"] = {"inputs": [t.name for t in m.inputs],
                         "outputs": {t.name: list(t.shape) for t in m.outputs}}
        layers = job["layers"]
        for case, typed in (("grpc_raw", False), ("grpc_typed", True)):
            res = await c.infer(request(job, [image_bytes(job["images"], typed=typed)],
                                        layers), headers=auth)
            np.savez(out / f"{case}.npz", **arrays(res, layers))
        res = await c.infer(request(job, [pixels(job)], layers), headers=auth)
        np.savez(out / "grpc_pixels.npz", **arrays(res, layers))
        try:
            await c.infer(request(job, [image_bytes(job["images"][:1])],
                                  {"no.such.layer": {}}), headers=auth)
            r["unknown_layer"] = None
        except grpc.aio.AioRpcError as e:
            r["unknown_layer"] = [e.code().name, e.details()]
        try:
            await c.infer(request(job, [image_bytes(job["images"][:1])], {}))
            r["no_token"] = None
        except grpc.aio.AioRpcError as e:
            r["no_token"] = [e.code().name, e.details()]
    return r


async def rest_side(job: dict, out: Path) -> dict:
    base = job["rest"]
    auth = {"authorization": f"Bearer {job['token']}"}
    r: dict = {}
    async with InferenceRESTClient(RESTConfig(protocol="v2", retries=0,
                                              timeout=120)) as c:
        r["live"] = await c.is_server_live(base)
        r["ready"] = await c.is_server_ready(base)
        r["model_ready"] = await c.is_model_ready(base, job["model"], headers=auth)
        r["unknown_model_ready"] = await c.is_model_ready(base, "resnet99", headers=auth)
        # No metadata call of its own either: its httpx client, GET /v2/models/{m}.
        m = (await c._client.get(f"{base}/v2/models/{job['model']}", headers=auth)).json()
        r["metadata"] = {"inputs": [t["name"] for t in m["inputs"]],
                         "outputs": {t["name"]: t["shape"] for t in m["outputs"]}}
        layers = job["layers"]
        res = await c.infer(base, request(job, [image_bytes(job["images"])], layers),
                            model_name=job["model"], headers=dict(auth))
        np.savez(out / "rest_binary.npz", **arrays(res, layers))
        # INPUT__0 as JSON integers; the answers asked back as binary data.
        binary = {n: {**p, "binary_data": True} for n, p in layers.items()}
        res = await c.infer(base, request(job, [pixels(job)], binary),
                            model_name=job["model"], headers=dict(auth))
        np.savez(out / "rest_pixels.npz", **arrays(res, layers))
        for case, names, headers in (("unknown_layer", {"no.such.layer": {}}, auth),
                                     ("no_token", {}, None)):
            try:
                await c.infer(base, request(job, [image_bytes(job["images"][:1])], names),
                              model_name=job["model"],
                              headers=dict(headers) if headers else None)
                r[case] = None
            except httpx.HTTPStatusError as e:
                # str(e): the message KServe's client makes of the answer's "error"
                r[case] = [e.response.status_code, e.response.json()["error"], str(e)]
    return r


async def main(job: dict, out: Path) -> None:
    result = {"grpc": await grpc_side(job, out), "rest": await rest_side(job, out)}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])))
