"""The KServe python model server serving `hooked.Hooked` over the KServe v2 (Open
Inference Protocol) gRPC API: ModelInfer with one BYTES input ("image", the JPEG in
`contents.bytes_contents`), one FP32 output named after the layer, sent as
`raw_output_contents`.

Runs in its own venv (`.venv-kserve`, see bench/peers/README.md): kserve 0.21 pins
protobuf < 7, hookserve's stubs need protobuf >= 7. ``ModelServer`` binds a fixed
port (its log does not say which port 0 became), so this picks free ports by binding
port 0 and closing it (bench only: a small race), prints ``PORT n`` (gRPC) and
serves; the client waits on ServerReady.
"""

from __future__ import annotations

import sys

from bench.peers.hooked import Hooked, free_port, server_args


def main() -> int:
    a = server_args()
    # kserve.model_server parses sys.argv when imported: give it only its own flags.
    big = str(64 << 20)
    sys.argv = [sys.argv[0], "--grpc_max_send_message_length", big,
                "--grpc_max_receive_message_length", big]
    import kserve
    from kserve import InferOutput, InferRequest, InferResponse

    class HookedModel(kserve.Model):
        def __init__(self, arch: str, layer: str, reduce: str) -> None:
            super().__init__(arch)
            self.layer = layer
            self.hooked = Hooked(arch, layer, reduce, a.threads)
            self.ready = True

        def predict(self, payload: InferRequest, headers=None) -> InferResponse:
            jpegs = payload.inputs[0].data
            out = self.hooked.extract([bytes(b) for b in jpegs])
            o = InferOutput(name=self.layer, shape=list(out.shape), datatype="FP32")
            o.set_data_from_numpy(out, binary_data=True)
            return InferResponse(response_id=payload.id, model_name=self.name,
                                 infer_outputs=[o])

    models = [HookedModel(m, la, r) for m, la, r in a.work]
    grpc_port, http_port = free_port(), free_port()
    print(f"PORT {grpc_port}", flush=True)
    kserve.ModelServer(grpc_port=grpc_port, http_port=http_port, workers=1).start(models)
    return 0


if __name__ == "__main__":
    sys.exit(main())
