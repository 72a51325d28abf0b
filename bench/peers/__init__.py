"""hookserve beside LitServe and a KServe v2 gRPC model server (see README.md here)."""
