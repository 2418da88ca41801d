"""The OpenAI-compatible HTTP API: a thin front end over the same registry and workers the gRPC servicer uses."""
