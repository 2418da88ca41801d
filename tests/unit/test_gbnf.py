"""A client's GBNF is parsed by llama.cpp in a child process first: a grammar that kills the parser is refused,
and the daemon's own process never sees it."""

from __future__ import annotations

import pytest

from barreld.engine import gbnf
from barreld.errors import InvalidArgument


@pytest.mark.parametrize(
    ("grammar", "words"),
    [
        ('root ::= "b"{3,1}', "ran out of memory or stack"),  # aborts llama.cpp's parser in-process
        ("root ::= " + "(" * 20000 + '"a"' + ")" * 20000, "ran out of memory or stack"),  # overflows its stack
        ("root ::= foo", "Undefined rule identifier 'foo'"),
        ('x ::= "a"', "'root'"),
        ('root ::= root "a"', "left recursion"),
        ("root ::= (", "expecting ')'"),
    ],
)
def test_a_grammar_llama_cpp_cannot_parse_is_refused_with_its_reason(grammar: str, words: str) -> None:
    with pytest.raises(InvalidArgument, match="bad grammar") as info:
        gbnf.check_gbnf(grammar)
    assert words in str(info.value)


def test_a_verdict_is_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    parse = gbnf._parse_in_child
    monkeypatch.setattr(gbnf, "_parse_in_child", lambda text: calls.append(text) or parse(text))
    for _ in range(3):
        gbnf.check_gbnf('root ::= "remembered" [0-9]{1,3}')
    assert len(calls) == 1
