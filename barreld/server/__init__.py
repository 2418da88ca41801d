"""The gRPC layer: a thin servicer over the registry and the cache, and the daemon's lifecycle."""
