"""Memory-pressure-driven eviction: pressure sources and the scheduler that polls them.

Plain Python with no gRPC or llama imports; the daemon wires `PressureScheduler` to the cache's
`evict_bytes` and serves its `status()` to `barrelctl scheduler status`.
"""
