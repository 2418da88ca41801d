"""The alternative a Python user reaches for: llama-cpp-python's own `LlamaRAMCache` and `LlamaDiskCache`.

Method (the same prompt text Barrel gets, the same n_ctx 4096 and n_batch 512, and both cores: llama-cpp-python
defaults to half the cores, barreld uses all of them, so n_threads is set to match):

- cold: a long-lived `Llama` (warmed up by a two-token decode, as barreld warms its context at load) with a
  new, empty cache runs `llm(prompt, max_tokens=1, stream=True)`.
- warm, same instance: that instance runs an unrelated short prompt, then the prompt again: the mirror of
  how Barrel's warm start is measured (the live state no longer holds the prompt).
- warm, fresh instance: a NEW `Llama` (warmed up the same way) on the same cache (the RAM cache object, or a
  new `LlamaDiskCache` on the same directory) runs the prompt: what a new worker or process sees.

llama-cpp-python's warm start moves its whole state through Python in fresh allocations: `load_state`
copies the KV state and its scores buffer (n_batch x n_vocab floats, 100 MB for this model) twice, and
`save_state` copies them again. On the two-core VM these runs used, that cost 50 to 300 ms from one run
to the next (page-fault cost varies), so its warm figures move more than Barrel's between runs.

Both use llama.cpp's OpenMP build; bench/harness.py sets GOMP_SPINCOUNT=10000 for every process (see there):
with libgomp's default spin-wait, llama-cpp-python ran 3-4x slower than barreld on a shared two-core machine.

Two times are taken per call: `ttft`, wall time to the first streamed chunk (the cache lookup, `load_state` and
the evaluation of the prompt's last token come before it), and `call`, wall time of the whole
`llm(prompt, max_tokens=1)` call, which is what a non-streaming caller waits for: llama-cpp-python writes
the state back to its cache (`save_state`, the whole context copied through Python) before returning. Each
call is drained to the end so the cache gets its entry back (LlamaDiskCache pops an entry when it hits).
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time

from bench.harness import model_path, quiet_stderr
from bench.ttft import Sample

CACHES = ("LlamaRAMCache", "LlamaDiskCache")
METHODS = ("fresh", "same")


def _llama():
    """A new instance, warmed up by a two-token decode as barreld warms its context when it loads a model:
    the first decode of a fresh context pays for lazy allocations and first-touch page faults, which on a
    busy virtual machine can take seconds and would otherwise be charged to the first prompt."""
    import llama_cpp

    threads = len(os.sched_getaffinity(0))
    with quiet_stderr():
        llm = llama_cpp.Llama(model_path=str(model_path()), n_ctx=4096, n_batch=512, n_threads=threads,
                              n_threads_batch=threads, verbose=False)
        bos = max(llm.token_bos(), 0)
        llm.eval([bos, bos])
        llm.reset()
    return llm


def _call(llm, prompt: str) -> Sample:
    t0 = time.perf_counter()
    first = None
    with quiet_stderr():  # LlamaDiskCache prints on every store
        for _chunk in llm(prompt, max_tokens=1, temperature=0.0, stream=True):
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return Sample(((first or end) - t0) * 1000, (end - t0) * 1000, prompt_tokens=len(llm.tokenize(prompt.encode())))


def _close(llm) -> None:
    with quiet_stderr():
        llm.close()
    gc.collect()


class LlamaSystem:
    """One of llama-cpp-python's caches, used as a long-running Python process would: one instance (warmed
    up, like barreld's context) serves every prompt. Each cold prompt gets a new, empty cache (one shared
    cache would hand a prompt another prompt's state on a one-token common prefix); the cache of the prompt
    chosen for warm runs is kept for them."""

    variants = METHODS

    def __init__(self, cache: str) -> None:
        self.name = cache
        self._tmp = tempfile.mkdtemp(prefix="bench-llamadisk-")
        self._caches: dict[str, tuple[object, str]] = {}  # prompt -> (cache, its directory)
        self._llm = None
        self._n = 0

    def __enter__(self) -> LlamaSystem:
        self._llm = _llama()
        return self

    def __exit__(self, *exc) -> None:
        if self._llm is not None:
            _close(self._llm)
            self._llm = None
        self._caches.clear()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _new_cache(self, directory: str):
        import llama_cpp

        if self.name == "LlamaRAMCache":
            return llama_cpp.LlamaRAMCache()
        return llama_cpp.LlamaDiskCache(cache_dir=directory)

    def cold(self, prompt: str) -> Sample:
        self._n += 1
        directory = f"{self._tmp}/{self._n}"
        cache = self._new_cache(directory)
        self._llm.reset()
        self._llm.set_cache(cache)
        self._caches[prompt] = (cache, directory)
        return _call(self._llm, prompt)

    def ready(self, prompt: str) -> None:
        for other in [p for p in self._caches if p != prompt]:
            _, directory = self._caches.pop(other)
            shutil.rmtree(directory, ignore_errors=True)

    def warm(self, prompt: str, variant: str) -> Sample:
        cache, directory = self._caches[prompt]
        if variant == "fresh":
            # a new instance on the same cache (for the disk cache, a new cache object on the same directory)
            llm = _llama()
            llm.set_cache(cache if self.name == "LlamaRAMCache" else self._new_cache(directory))
            sample = _call(llm, prompt)
            _close(llm)
            return sample
        self._n += 1
        self._llm.set_cache(cache)
        _call(self._llm, f"~{self._n} unrelated")
        return _call(self._llm, prompt)

    def done(self, prompt: str) -> None:
        self.ready("")  # forgets every cache and removes its directory
