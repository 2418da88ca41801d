"""Barrel daemon: owns the models, the KV cache and the gRPC socket."""

__version__ = "0.1.0"
