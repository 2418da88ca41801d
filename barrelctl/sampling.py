"""The sampler's options, shared by `complete` and `chat`: checked here by the daemon's own rules (a bad value
exits 2 naming the option, before any daemon is asked), then sent as the request's Sampling fields."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from barrelctl.errors import EXIT_USAGE, CliError
from barreld.engine.sampling import SamplingParams
from barreld.errors import InvalidArgument

TopK = Annotated[int | None, typer.Option("--top-k", help="Keep only the K likeliest tokens (0: off).",
                                          show_default=False)]
TopP = Annotated[float | None, typer.Option("--top-p", help="Keep the likeliest tokens whose probabilities add up "
                                            "to P (0 < P <= 1; 1: off).", show_default=False)]
MinP = Annotated[float | None, typer.Option("--min-p", help="Drop tokens less likely than P times the likeliest "
                                            "(0..1; 0: off).", show_default=False)]
TypicalP = Annotated[float | None, typer.Option("--typical-p", help="Locally typical sampling with mass P "
                                                "(0 < P <= 1; 1: off).", show_default=False)]
RepeatPenalty = Annotated[float | None, typer.Option("--repeat-penalty", help="Make recent tokens less likely by "
                                                     "this factor (1: off).", show_default=False)]
RepeatLastN = Annotated[int | None, typer.Option("--repeat-last-n", help="Recent tokens the penalties look back "
                                                 "over, the prompt's included (default 64).", show_default=False)]
PresencePenalty = Annotated[float | None, typer.Option("--presence-penalty", help="Lower the logit of each recent "
                                                       "token by this (-2..2).", show_default=False)]
FrequencyPenalty = Annotated[float | None, typer.Option("--frequency-penalty", help="Lower each recent token's "
                                                        "logit by this times its count (-2..2).", show_default=False)]
LogitBias = Annotated[list[str] | None, typer.Option("--logit-bias", metavar="TOKEN=BIAS", show_default=False,
                                                     help="Add BIAS (-100..100) to token id TOKEN's logit; -100 "
                                                          "keeps it out (repeatable).")]
JsonSchema = Annotated[Path | None, typer.Option("--json-schema", metavar="FILE", show_default=False,
                                                 help="The reply is JSON that validates against this JSON "
                                                      "Schema file.")]
Grammar = Annotated[Path | None, typer.Option("--grammar", metavar="FILE", show_default=False,
                                              help="The reply matches this GBNF grammar file (start rule root).")]
NUMERIC = ("top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
           "frequency_penalty")
_FIELD = re.compile(r"\bbad (" + "|".join(NUMERIC) + r"|logit_bias)\b")


def sampling_request(
    temperature: float, seed: int | None, numeric: dict[str, Any], bias: list[str] | None,
    json_schema: Path | None, grammar: Path | None,
) -> dict[str, Any]:
    """The Sampling message's fields for the options given; CliError (exit 2) names the first bad one."""
    fields = {k: v for k, v in numeric.items() if v is not None}
    logit_bias = dict(_bias(item) for item in bias or ())
    if grammar is not None:
        fields["grammar"] = _read(grammar, "--grammar")
    if json_schema is not None:
        fields["json_schema"] = _read(json_schema, "--json-schema")
    try:
        SamplingParams(temperature=temperature, seed=seed, logit_bias=tuple(logit_bias.items()),
                       **{k: v for k, v in fields.items() if k in NUMERIC})
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
