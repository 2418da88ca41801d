"""JSON Schema to GBNF, for llama.cpp's grammar sampler: llama-cpp-python's converter, checked first.

The converter skips what it does not understand, which would give a reply the schema does not validate. So a
schema is first checked as JSON Schema (the `jsonschema` package), then every keyword that constrains a value
must be one the grammar enforces; any other is refused by name. Integer bounds (`minimum`, `maximum`,
`exclusiveMinimum`, `exclusiveMaximum`), which the converter leaves out, are written here as digit ranges;
a `number` may be bounded by whole numbers from 0 up.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from barreld.errors import InvalidArgument

# Keywords that say nothing about which values are valid.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "$defs", "definitions", "strict", "discriminator", "contentMediaType",
})
# Keywords the grammar enforces.
ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "pattern", "format", "minLength", "maxLength",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
})
FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"})
SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
JSON_OBJECT: dict[str, Any] = {"type": "object"}
MAX_DEPTH = 32
MAX_COUNT = 1000  # the most repetitions of a string's characters, an array's items or a pattern's atom
FRACTION = '("." [0-9]{1,15})?'


def schema_grammar(schema: object) -> str:
    """GBNF whose every complete match is JSON that validates against `schema`; InvalidArgument names what
    is wrong with a schema that is not JSON Schema, or what it asks that the grammar cannot enforce."""
    check_schema(schema)
    return _rooted(_convert([("", schema)]))


def schemas_grammar(named: list[tuple[str, object]], root: str) -> str:
    """GBNF with one rule per (name, schema), each matching JSON valid against its schema, and `root` (GBNF
    over those names) as the start rule: a tool call's envelope around its tool's arguments."""
    for _, schema in named:
        check_schema(schema)
    return _convert(named) + f"\nroot ::= {root}"


# JSON exactly as `tojson` (Python's json.dumps, ensure_ascii off) writes it back: ", " and ": " between items and
# nothing else, the escapes it uses, numbers it writes as they were read (no exponent, no trailing zeros).
TOJSON_RULES = {
    "space": '""',
    "char": r'[^"\\\x00-\x1F] | "\\" (["\\bfnrt] | "u00" ("0" [0-7bef] | "1" [0-9a-f]))',
    "number": '("-"? integral-part) ("." ("0" | [0-9]{0,14} [1-9]))? space',
}


def tojson_grammar(gbnf: str) -> str:
    """The converter's GBNF narrowed to the one spelling `tojson` gives each value, so that a template that
    writes the arguments back with `tojson` writes the very bytes the model generated."""
    out = []
    for line in gbnf.replace('"," space', '", "').replace('":" space', '": "').splitlines():
        name = line.split(" ::= ", 1)[0]
        out.append(f"{name} ::= {TOJSON_RULES[name]}" if name in TOJSON_RULES else line)
    return "\n".join(out)


def check_schema(schema: object) -> None:
    """InvalidArgument unless `schema` is JSON Schema whose every constraint the grammar enforces."""
    import jsonschema

    if not isinstance(schema, dict):
        raise InvalidArgument(f"the JSON schema must be an object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the top level"
        raise InvalidArgument(f"not a valid JSON Schema at {where}: {exc.message[:200]}") from None
    _check_supported(schema, "#", 0)


def _check_supported(schema: object, where: str, depth: int) -> None:
    if isinstance(schema, bool):
        raise InvalidArgument(f"unsupported JSON Schema at {where}: a boolean schema")
    if depth > MAX_DEPTH:
        raise InvalidArgument(f"the JSON schema nests deeper than {MAX_DEPTH} levels at {where}")
    for key in schema:
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise InvalidArgument(f"unsupported JSON Schema keyword {key!r} at {where}")
    ref = schema.get("$ref")
    if ref is not None and not ref.startswith("#/"):
        raise InvalidArgument(f"unsupported $ref {ref[:80]!r} at {where}: only local references (#/...)")
    if "format" in schema and schema["format"] not in FORMATS:
        raise InvalidArgument(f"unsupported format {schema['format']!r} at {where}; supported: {sorted(FORMATS)}")
    if any(b in schema for b in BOUNDS):
        _number_bounds(schema, where)
    _check_counts(schema, where)
    for name in SUBSCHEMA_MAPS:
        for key, sub in schema.get(name, {}).items():
            _check_supported(sub, f"{where}/{name}/{key}", depth + 1)
    for name in SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(name, [])):
            _check_supported(sub, f"{where}/{name}/{i}", depth + 1)
    for name in ("items", "additionalProperties"):
        if isinstance(schema.get(name), dict):
            _check_supported(schema[name], f"{where}/{name}", depth + 1)


def _check_counts(schema: dict, where: str) -> None:
    """Lengths and item counts the grammar spells out one by one: a range that is empty or too long to write."""
    for low, high in (("minLength", "maxLength"), ("minItems", "maxItems")):
        if schema.get(low, 0) > schema.get(high, math.inf):
            raise InvalidArgument(f"empty range at {where}: {low} {schema[low]} is above {high} {schema[high]}")
        if max(schema.get(low, 0), schema.get(high, 0)) > MAX_COUNT:
            raise InvalidArgument(f"unsupported {low}/{high} at {where}: at most {MAX_COUNT}")
    for count in re.findall(r"\{(\d*),?(\d*)\}", schema.get("pattern", "")):
        if any(c and int(c) > MAX_COUNT for c in count):
            raise InvalidArgument(f"unsupported pattern at {where}: a repetition above {MAX_COUNT}")


def _number_bounds(schema: dict, where: str) -> tuple[int | None, int | None]:
    """The whole-number range [low, high] a bounded integer or number may take (None: unbounded)."""
    kind = schema.get("type")
    low = _bound(schema, "minimum", "exclusiveMinimum", math.ceil, 1)
    high = _bound(schema, "maximum", "exclusiveMaximum", math.floor, -1)
    if kind == "integer":
        return low, high
    whole = all(isinstance(schema.get(b, 0), int) for b in BOUNDS) and "exclusiveMaximum" not in schema
    if kind == "number" and whole and low is not None and low >= 0 and "exclusiveMinimum" not in schema:
        return low, high
    raise InvalidArgument(
        f"unsupported bounds at {where}: integers may have any bounds, numbers only a whole minimum >= 0 "
        f"and a whole maximum"
    )


def _bound(schema: dict, inclusive: str, exclusive: str, to_int: Any, step: int) -> int | None:
    values = []
    if isinstance(schema.get(inclusive), int | float):
        values.append(to_int(schema[inclusive]))
    if isinstance(schema.get(exclusive), int | float):
        edge = schema[exclusive]
        values.append(int(edge) + step if float(edge).is_integer() else to_int(edge))
    if not values:
        return None
    return max(values) if step > 0 else min(values)


def _convert(named: list[tuple[str, object]]) -> str:
    from llama_cpp.llama_grammar import SchemaConverter

    class Converter(SchemaConverter):
        """llama-cpp-python's converter, with bounded integers and numbers as digit ranges."""

        def visit(self, schema: dict, name: str) -> str:
            if any(b in schema for b in BOUNDS):
                low, high = _number_bounds(schema, name)
                rule = int_range(low, high)
                if schema.get("type") == "number":
                    rule = f'({rule}) {FRACTION}' if high is None else _bounded_decimal(low, high)
                return self._add_rule(f"{name or 'root'}-bounded", f"({rule}) space")
            return super().visit(schema, name)

    converter = Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        for name, schema in named:  # each its own base for $refs, so equal $defs paths do not collide
            rule = converter.visit(converter.resolve_refs(json.loads(json.dumps(schema)), f"input-{name}"), name)
            if name and rule != name:  # a plain type is the converter's shared rule: name it too
                converter._add_rule(name, rule)
        return converter.format_grammar()
    except (AssertionError, KeyError, ValueError, TypeError, RecursionError) as exc:
        raise InvalidArgument(f"the JSON schema could not be turned into a grammar: {str(exc)[:200]}") from None


def _rooted(gbnf: str) -> str:
    """A schema whose top level is a bounded number names its rule `-bounded`: root points at it."""
    if any(line.startswith("root ::=") for line in gbnf.splitlines()):
        return gbnf
    return gbnf + "\nroot ::= root-bounded"


def _bounded_decimal(low: int, high: int) -> str:
    """Decimals from whole `low` to whole `high`: below `high` any fraction, at `high` only zeros."""
    if high < low:
        raise InvalidArgument(f"empty range: minimum {low} is above maximum {high}")
    top = f'"{high}" ("." "0"{{1,15}})?'
    return top if high == low else f'({int_range(low, high - 1)}) {FRACTION} | {top}'


def int_range(low: int | None, high: int | None) -> str:
    """GBNF for the JSON integers in [low, high] (None: unbounded on that side), without leading zeros."""
    if low is not None and high is not None and low > high:
        raise InvalidArgument(f"empty range: minimum {low} is above maximum {high}")
    alts = []
    if low is None or low < 0:  # the negative part: "-" then a magnitude
        top = None if low is None else -low
        bottom = 1 if high is None or high >= 0 else -high
        alts.append(f'"-" ({_nonneg_range(bottom, top)})')
    if high is None or high >= 0:
        alts.append(_nonneg_range(max(low or 0, 0), high))
    return " | ".join(f"({a})" for a in alts)


def _nonneg_range(low: int, high: int | None) -> str:
    alts = []
    last = len(str(high)) if high is not None else len(str(low))
    for digits in range(len(str(low)), last + 1):
        a = max(low, 10 ** (digits - 1) if digits > 1 else 0)
        b = min(high, 10**digits - 1) if high is not None else 10**digits - 1
        if a <= b:
            alts.append(_between(str(a), str(b)))
    if high is None:  # every number with more digits
        alts.append('[1-9] ' + "[0-9] " * last + "[0-9]*")
    return " | ".join(f"({a})" for a in alts)


def _between(a: str, b: str) -> str:
    """Digit strings of len(a) == len(b) from a to b."""
    if len(a) == 1:
        return f"[{a}-{b}]"
    if set(a) == {"0"} and set(b) == {"9"}:
        return " ".join(["[0-9]"] * len(a))
    head, rest_a, rest_b = a[0], a[1:], b[1:]
    if a[0] == b[0]:
        return f'"{head}" ({_between(rest_a, rest_b)})'
    alts = [f'"{head}" ({_between(rest_a, "9" * len(rest_a))})']
    if int(a[0]) + 1 <= int(b[0]) - 1:
        alts.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}]" + " [0-9]" * len(rest_a))
    alts.append(f'"{b[0]}" ({_between("0" * len(rest_b), rest_b)})')
    return " | ".join(f"({x})" for x in alts)
