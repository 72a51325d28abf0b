"""What a forward pass captures: the layer table, the hook plan, the batched forward
pass and the reductions. torch only; no grpc, no knowledge of calls or streams."""
