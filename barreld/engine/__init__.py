"""The llama.cpp side of barreld: a small backend interface, sampling, and the per-model worker."""
