"""The Open Inference Protocol (KServe v2) front door: Triton's gRPC service and the v2
REST routes over the same engine as Extract. No torch here.

`request.py` (protocol-neutral requests and their parameters), `tensors.py` (raw
contents), `infer.py` (a request through a Session), `metadata.py` (what clients
discover), `servicer.py` (the gRPC adapter), `http.py` (the REST adapter). The
`*_pb2` modules are generated from Triton's own protos: PROTO_ORIGIN.md.
"""
