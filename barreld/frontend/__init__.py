"""What both front ends (gRPC in `barreld.server`, HTTP in `barreld.http`) share: the checks on a call, the walk
over the worker's events, error triage (`calls`) and the Prometheus metrics (`metrics`). It sits below both and
imports neither, nor gRPC or the web stack."""
