"""A client's GBNF grammar is parsed by llama.cpp in a child process before the daemon parses it.

llama.cpp's grammar parser answers NULL to most bad grammars, but some make it allocate without bound and then
abort (a repetition `{3,1}` did): in the daemon that would take every model down. The child runs under a
memory limit and a deadline; what it says of a grammar is remembered by digest, so a grammar sent again costs
nothing. Grammars written from a JSON schema go through it too: a schema's pattern becomes GBNF.

`python -m barreld.engine.gbnf` is the child: the grammar on stdin; exit 0 when it parses, 1 when llama.cpp
refuses it (its reason on stderr); anything else means the parser died.
"""

from __future__ import annotations

import collections
import hashlib
import resource
import subprocess
import sys
import threading

from barreld.engine.sampling import MAX_GRAMMAR
from barreld.errors import InvalidArgument

CHILD_MEMORY = 1 << 30  # bytes of heap: a grammar that needs more is refused
CHILD_SECONDS = 20
REMEMBERED = 1024
PARSE_ERROR = "error parsing grammar:"

_lock = threading.Lock()
_verdicts: collections.OrderedDict[bytes, str | None] = collections.OrderedDict()


def check_gbnf(text: str) -> None:
    """InvalidArgument naming what is wrong unless llama.cpp parses `text` (start rule `root`) safely."""
    if len(text) > MAX_GRAMMAR:
        raise InvalidArgument(f"the grammar is {len(text)} characters; at most {MAX_GRAMMAR}")
    key = hashlib.sha256(text.encode()).digest()
    with _lock:
        known = key in _verdicts
        reason = _verdicts.get(key)
        if known:
            _verdicts.move_to_end(key)
    if not known:
        reason = _parse_in_child(text)
        with _lock:
            _verdicts[key] = reason
            while len(_verdicts) > REMEMBERED:
                _verdicts.popitem(last=False)
    if reason is not None:
        raise InvalidArgument(f"bad grammar: {reason}")


def _parse_in_child(text: str) -> str | None:
    """None when the grammar parses, else why not."""
    try:
        p = subprocess.run([sys.executable, "-m", "barreld.engine.gbnf"], input=text.encode(), capture_output=True,
                           timeout=CHILD_SECONDS)
    except subprocess.TimeoutExpired:
        return f"llama.cpp did not finish parsing it within {CHILD_SECONDS} s"
    if p.returncode == 0:
        return None
    if p.returncode == 1:
        return _reason(p.stderr.decode("utf-8", "replace"))
    return ("llama.cpp's parser ran out of memory or stack on it, or aborted (a repetition {m,n} with m above n, "
            "or thousands of nested groups, do that)")


def _reason(stderr: str) -> str:
    """llama.cpp's own words, from the lines its parser writes."""
    for line in stderr.splitlines():
        if PARSE_ERROR in line:
            return line.split(PARSE_ERROR, 1)[1].strip()[:200]
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return lines[0][:200] if lines else "llama.cpp could not parse it"


def main() -> int:
    """The child: parse stdin as GBNF within the memory limit."""
    resource.setrlimit(resource.RLIMIT_DATA, (CHILD_MEMORY, CHILD_MEMORY))
    import llama_cpp

    grammar = llama_cpp.llama_sampler_init_grammar(None, sys.stdin.buffer.read(), b"root")
    if not grammar:
        return 1
    llama_cpp.llama_sampler_free(grammar)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
