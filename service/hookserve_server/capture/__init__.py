"""What a forward pass captures: the layer table, the hook plan, the batched forward
pass and the reductions; for Attribute, the gradient tap and the attribution passes.
torch only; no grpc, no knowledge of calls or streams."""
