"""Generated gRPC code for proto/barrel.proto; regenerate with `python -m barreld.rpc.generate`."""
