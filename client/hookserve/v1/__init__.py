"""Generated gRPC stubs for hookserve.v1 (regenerate with `make proto`; do not edit)."""
