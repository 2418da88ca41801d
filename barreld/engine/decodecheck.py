"""Whether a model file and this llama.cpp build can run here, asked of a child process before the daemon
loads the model into its own.

llama-cpp-python compiles llama.cpp for the CPU it is built on (GGML_NATIVE). Some VMs advertise
instructions they trap (Intel AMX on several clouds): such a build dies with SIGILL at its first decode,
and in the daemon's process that takes every model and every client with it. A damaged GGUF can crash
llama.cpp while it reads the file, with the same effect. So the first load of a model file with this
library on this CPU runs a small load and decode in a child (`python -m barreld.engine.decodecheck
MODEL`); a child killed by a signal fails the load with the cause and what to do, and the daemon goes
on. A passed check is remembered (library files, CPU and model file, by name, size and mtime), so later
loads cost nothing.
"""

from __future__ import annotations

import importlib.metadata
import logging
import platform
import subprocess
import sys
import time
from pathlib import Path

from barreld.deaths import TROUBLESHOOTING, describe, signal_name
from barreld.engine.backend import ModelLoadError
from barreld.engine.memo import JsonMemo, cache_dir, cpu_identity, verdict_key

log = logging.getLogger(__name__)

LOADED = b"loaded\n"  # the child's word that it read the file; a death after it is the decode's
CHILD_TIMEOUT_S = 300.0
PROBE_TEXT = b"The quick brown fox jumps over the lazy dog while the river runs under an old stone bridge."
# CPU flags (/proc/cpuinfo) and the ggml options that use them: the instructions a portable build may enable.
OPTIONAL_ISA = (
    ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
    ("avx_vnni", "GGML_AVX_VNNI"),
)
# Options a portable x86 build has on unless told otherwise: turned off where the CPU lacks them.
DEFAULT_ISA = (("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
               ("bmi2", "GGML_BMI2"))


def cmake_args(flags: frozenset[str]) -> str:
    """CMAKE_ARGS for a build that uses what this CPU runs and nothing that its build host merely saw."""
    args = ["-DGGML_NATIVE=OFF"]
    if platform.machine() in ("x86_64", "AMD64"):
        args += [f"-D{option}=ON" for flag, option in OPTIONAL_ISA if flag in flags]
        args += [f"-D{option}=OFF" for flag, option in DEFAULT_ISA if flag not in flags]
    return " ".join(args)


def rebuild_command() -> str:
    try:
        version = "==" + importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        version = ""
    return (f'CMAKE_ARGS="{cmake_args(cpu_identity()[1])}" {sys.executable} -m pip install --force-reinstall '
            f"--no-deps --no-cache-dir llama-cpp-python{version}")


def check_key(model: Path) -> str:
    """What a passed check holds for: the llama.cpp library files, the CPU, the model file."""
    return verdict_key(model)


def default_memo() -> Path:
    """$XDG_CACHE_HOME/barrel/decode-checks.json (~/.cache when unset): per user, shared by its daemons."""
    return cache_dir() / "decode-checks.json"


def child_command(model: Path) -> list[str]:
    """The check's child process; a seam the fault entry point (tests/faultd.py) replaces."""
    return [sys.executable, "-m", "barreld.engine.decodecheck", str(model)]


class DecodeCheck:
    """The registry's load check: raises ModelLoadError when the child died of a signal."""

    def __init__(self, memo: Path | None = None, timeout: float = CHILD_TIMEOUT_S) -> None:
        self.memo = JsonMemo(memo or default_memo())
        self.timeout = timeout

    def __call__(self, model: Path) -> None:
        key = check_key(model)
        if self.memo.get(key) is not None:
            return
        t0 = time.monotonic()
        try:
            child = subprocess.run(child_command(model), stdin=subprocess.DEVNULL, capture_output=True,
                                   timeout=self.timeout)
        except subprocess.TimeoutExpired:
            log.warning("decode check of %s took over %.0f s; loading it unchecked", model, self.timeout)
            return
        if child.returncode < 0:
            raise ModelLoadError(failure(model, signal_name(-child.returncode), LOADED in child.stdout))
        seconds = time.monotonic() - t0
        if child.returncode != 0:  # an error it could report: the load in this process reports it again
            log.info("decode check of %s: the child could not load it (exit %d)", model, child.returncode)
            return
        self.memo.put(key, {"model": str(model), "at": time.time(), "seconds": round(seconds, 3)})
        log.info("decode check of %s passed in %.2f s (remembered in %s)", model.name, seconds, self.memo.path)


def failure(model: Path, name: str, loaded: bool) -> str:
    """The one line a load fails with when the child died of signal `name`."""
    if loaded:
        return (f"this llama.cpp build cannot run on this CPU: a test decode of {model.name} in a child process "
                f"died of {describe(name)}; the daemon is unharmed. Rebuild llama-cpp-python for this machine: "
                f"{rebuild_command()} ({TROUBLESHOOTING})")
    return (f"llama.cpp crashed reading {model} (a test load in a child process died of {describe(name)}): "
            f"the file is damaged or truncated, or a model this llama.cpp cannot read; replace it "
            f"({TROUBLESHOOTING})")


def main(argv: list[str]) -> int:
    """The child: read the file, say so, then decode a batch and a single token as a request would."""
    from barreld.engine.backend import BatchItem, ContextSettings
    from barreld.engine.llama_backend import LlamaBackend, probe_load

    model = Path(argv[0])
    try:
        probe_load(model)
    except ModelLoadError as exc:
        print(exc, file=sys.stderr)
        return 3
    sys.stdout.buffer.write(LOADED)
    sys.stdout.flush()
    backend = LlamaBackend(model, ContextSettings(n_ctx=64, n_batch=32, n_gpu_layers=0))
    tokens = backend.tokenize(PROBE_TEXT)[:31]
    backend.decode([BatchItem(t, i, 0, i == len(tokens) - 1) for i, t in enumerate(tokens)])
    backend.decode([BatchItem(tokens[0], len(tokens), 0, True)])
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
