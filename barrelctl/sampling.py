"""The sampler's options, shared by `complete` and `chat` (`with_sampling` adds them to a command): checked here
by the daemon's own rules (a bad value exits 2 naming the option, before any daemon is asked), then sent as the
request's Sampling fields."""

from __future__ import annotations

import functools
import inspect
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from barrelctl.errors import EXIT_USAGE, CliError
from barreld.engine.sampling import KNOBS, MAX_SEED, SamplingParams
from barreld.errors import InvalidArgument

SPECS: tuple[tuple[str, Any, str | None, str], ...] = (  # name, type, metavar, help
    ("top_k", int, None, "Keep only the K likeliest tokens (0: off)."),
    ("top_p", float, None, "Keep the likeliest tokens whose probabilities add up to P (0 < P <= 1; 1: off)."),
    ("min_p", float, None, "Drop tokens less likely than P times the likeliest (0..1; 0: off)."),
    ("typical_p", float, None, "Locally typical sampling with mass P (0 < P <= 1; 1: off)."),
    ("repeat_penalty", float, None, "Make recent tokens less likely by this factor (1: off)."),
    ("repeat_last_n", int, None, "Recent tokens the penalties look back over, the prompt's included (default 64)."),
    ("presence_penalty", float, None, "Lower the logit of each recent token by this (-2..2)."),
    ("frequency_penalty", float, None, "Lower each recent token's logit by this times its count (-2..2)."),
    ("logit_bias", list[str], "TOKEN=BIAS", "Add BIAS (-100..100) to token id TOKEN's logit; -100 keeps it out "
                                            "(repeatable)."),
    ("json_schema", Path, "FILE", "The reply is JSON that validates against this JSON Schema file."),
    ("grammar", Path, "FILE", "The reply matches this GBNF grammar file (start rule root)."),
)
OPTIONS = {
    name: Annotated[kind | None, typer.Option("--" + name.replace("_", "-"), metavar=metavar, help=text,
                                              show_default=False)]
    for name, kind, metavar, text in SPECS
}
_FIELD = re.compile(r"\bbad (" + "|".join(KNOBS) + r"|logit_bias|temperature|seed)\b")


def check_sampling(max_tokens: int, temperature: float, seed: int | None) -> None:
    if max_tokens < 1:
        raise CliError(f"bad --max-tokens {max_tokens}: must be at least 1", EXIT_USAGE)
    if temperature < 0:
        raise CliError(f"bad --temperature {temperature}: must be >= 0", EXIT_USAGE)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise CliError(f"bad --seed {seed}: expected 0..{MAX_SEED}", EXIT_USAGE)


def with_sampling(command: Callable[..., None]) -> Callable[..., None]:
    """Adds the sampler's options to `command`, which takes `max_tokens`, `temperature`, `seed` (or not) and
    `sampling`: the Sampling message's fields for the options given, all of them checked first."""
    sig = inspect.signature(command, eval_str=True)
    kept = [p for p in sig.parameters.values() if p.name != "sampling"]
    keyword = inspect.Parameter.KEYWORD_ONLY
    added = [inspect.Parameter(n, keyword, default=None, annotation=a) for n, a in OPTIONS.items()]

    @functools.wraps(command)
    def run(**kwargs: Any) -> None:
        given = {name: kwargs.pop(name) for name in OPTIONS}
        check_sampling(kwargs["max_tokens"], kwargs["temperature"], kwargs.get("seed"))
        command(**kwargs, sampling=sampling_request(kwargs["temperature"], kwargs.get("seed"), given))

    run.__signature__ = sig.replace(parameters=[*kept, *added])
    return run


def sampling_request(temperature: float, seed: int | None, given: dict[str, Any]) -> dict[str, Any]:
    """The Sampling message's fields for the options given; CliError (exit 2) names the first bad one."""
    fields = {k: given[k] for k in KNOBS if given.get(k) is not None}
    logit_bias = dict(_bias(item) for item in given.get("logit_bias") or ())
    json_schema, grammar = given.get("json_schema"), given.get("grammar")
    if grammar is not None:
        fields["grammar"] = _read(grammar, "--grammar")
    if json_schema is not None:
        fields["json_schema"] = _read(json_schema, "--json-schema")
    try:
        SamplingParams(temperature=temperature, seed=seed, logit_bias=tuple(logit_bias.items()),
                       **{k: v for k, v in fields.items() if k in KNOBS})
        if json_schema is not None and grammar is not None:
            raise InvalidArgument("pass either --json-schema or --grammar, not both")
        if json_schema is not None:
            from barreld.engine.grammar import schema_grammar

            schema_grammar(_json(fields["json_schema"]))
    except InvalidArgument as exc:
        message = _FIELD.sub(lambda m: "bad --" + m.group(1).replace("_", "-"), str(exc))
        raise CliError(message, EXIT_USAGE) from None
    return {**fields, "logit_bias": logit_bias}


def _bias(item: str) -> tuple[int, float]:
    token, sep, value = item.partition("=")
    try:
        if not sep or not token.strip().isdigit():
            raise ValueError
        return int(token), float(value)
    except ValueError:
        raise CliError(f"bad --logit-bias {item!r}: expected TOKEN=BIAS, a token id and a number", EXIT_USAGE) from None


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CliError(f"bad --json-schema: not JSON ({str(exc)[:200]})", EXIT_USAGE) from None


def _read(path: Path, option: str) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {option} {path}: {exc}", EXIT_USAGE) from None
