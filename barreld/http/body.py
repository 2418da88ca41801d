"""What several HTTP APIs read alike from a JSON body: typed fields, the sampler's settings under OpenAI's and
llama.cpp's server's names, stop strings, the cache salt. A field of the wrong type is InvalidArgument (400);
fields an API has and Barrel does not use are ignored, as OpenAI ignores unknown ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from barreld.engine.sampling import KNOBS, SamplingParams
from barreld.errors import InvalidArgument
from barreld.service.calls import check_cache_salt

if TYPE_CHECKING:
    from barreld.engine.tools import SchemaChecks

DEFAULT_TEMPERATURE = 0.0  # Barrel's greedy default, not OpenAI's 1
NUMBER = ((int, float), "a number")
WHOLE = (int, "an integer")
SAMPLING_FIELDS = {name: WHOLE if kind is int else NUMBER for name, kind in KNOBS.items()}


class Body:
    """A request body with typed reads: a present field of the wrong type is a 400 naming it. `checks` holds
    the verdicts on the tool schemas its tenant sent before."""

    def __init__(self, doc: Mapping[str, Any], checks: SchemaChecks | None = None) -> None:
        self.doc = doc
        self.checks = checks

    def get(self, name: str, kind: type | tuple[type, ...], what: str) -> Any:
        value = self.doc.get(name)
        if value is None:
            return None
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            raise InvalidArgument(f"{name} must be {what}, got {type(value).__name__}")
        return value


def cache_salt(body: Body) -> str:
    return check_cache_salt(body.get("cache_salt", str, "a string") or "")


def template_options(body: Body, **switches: object) -> tuple[tuple[str, object], ...]:
    """The request's variables for the chat template: `chat_template_kwargs`, as llama.cpp's server and vLLM
    take it (`enable_thinking`, `reasoning_effort`, ...), and the switches a route maps from its own fields
    (None: not sent), which win over the same names there."""
    given = body.get("chat_template_kwargs", dict, "an object of chat template variables") or {}
    return tuple({**given, **{k: v for k, v in switches.items() if v is not None}}.items())


def sampling(body: Body) -> SamplingParams:
    """The sampler's settings under OpenAI's names and llama.cpp's server's; absent ones at their defaults."""
    temperature = body.get("temperature", (int, float), "a number")
    given = {name: body.get(name, *kind) for name, kind in SAMPLING_FIELDS.items()}
    return SamplingParams(
        temperature=DEFAULT_TEMPERATURE if temperature is None else float(temperature),
        seed=body.get("seed", int, "an integer"),
        logit_bias=_logit_bias(body),
        **{name: value for name, value in given.items() if value is not None},
    )


def _logit_bias(body: Body) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias", dict, "an object mapping token ids to numbers") or {}
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise InvalidArgument(f"bad logit_bias key {key[:40]!r}: expected a token id (a whole number)")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidArgument(f"bad logit_bias[{key}]: expected a number from -100 to 100")
        out.append((int(key), float(value)))
    return tuple(out)


def utf8(text: str, what: str) -> bytes:
    """JSON can spell a lone UTF-16 surrogate (\\ud800), which no UTF-8 text holds: a 400, not a crash."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what} holds an unpaired surrogate (\\ud800-\\udfff); send valid Unicode") from None


def stop_strings(body: Body, name: str = "stop") -> tuple[str, ...]:
    stop = body.get(name, (str, list), "a string or a list of strings")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) for s in stops):
        raise InvalidArgument(f"{name} must be a string or a list of strings")
    for s in stops:
        utf8(s, name)
    return stops


def function_tool(f: object, where: str, checks: SchemaChecks | None):
    """One function tool in OpenAI's shape {name, description, parameters} (chat nests it under `function`,
    the Responses API does not)."""
    from barreld.engine.tools import tool

    if not isinstance(f, dict):
        raise InvalidArgument(f"{where} must be a function tool {{name, description, parameters}}")
    return tool(f.get("name"), f.get("description"), f.get("parameters"), where, checks)
