"""The gRPC front end (a thin servicer over the registry and the cache, and its server), and the Daemon that
wires config, cache, models and both front ends together."""
