"""Barrel's benchmarks: real barreld processes, the real bundled model, llama-cpp-python's caches alongside.

`python -m bench [--quick]` runs the whole suite and writes bench/RESULTS.md and the PNG plots;
`python -m bench.warm_vs_cold` is the single 1,500-token warm-vs-cold comparison; `python -m bench.conversation`
runs an 8-turn conversation and a restart against llama-cpp-python's OpenAI-compatible server and writes its
own section of RESULTS.md, which `python -m bench` keeps.
"""
