"""The boundary every front end (gRPC in `barreld.server`, each HTTP API in `barreld.http`) talks to the engine
through: one request type (`request.CallRequest`), one call whose events are the engine's typed reply events
(`calls`), error triage, and the Prometheus metrics (`metrics`). It imports no front end, nor gRPC or the web
stack."""
