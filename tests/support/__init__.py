"""Test support that the tests and bench/ import and the installed wheel leaves out: private sandboxes for
barreld and barrelctl (`sandbox`), redis-servers of the tests' own (`redis_sandbox`), and tiny models built
for them (`sandbox_models`, which needs the test extra's `gguf`)."""
