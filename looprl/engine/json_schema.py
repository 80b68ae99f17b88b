"""Which JSON schemas `response_format` can force, and why the others are refused.

The grammar compiler (xgrammar) turns a schema into a grammar of the JSON it allows.
Some keywords it rejects outright, and some it silently ignores: a value that breaks
them would still be sampled, and the reply would not satisfy the schema. We refuse
those up front, naming each one and where it is, rather than return JSON that
`jsonschema.validate` rejects. Measured with xgrammar 0.2 (`tests/test_json_schema.py`
keeps the list honest):

- enforced: `type` (one or a list), `properties`, `required`, `additionalProperties`,
  `patternProperties`, `propertyNames`, `minProperties`/`maxProperties`, `items`,
  `prefixItems`, `minItems`/`maxItems`, `enum`, `const`, `anyOf`, `allOf` with one
  schema, `$ref` inside the document (`#/$defs/...`, recursion included), `minimum`,
  `maximum`, `exclusiveMinimum`, `exclusiveMaximum`, `multipleOf`, `minLength`,
  `maxLength`, `pattern`, and the formats in `ENFORCED_FORMATS`;
- refused (ignored by the compiler): the keywords in `UNSUPPORTED`, `allOf` with more
  than one schema, `uniqueItems: true`, and `$ref` to another document;
- annotations (no effect, as JSON Schema itself treats them by default): `title`,
  `description`, `default`, `examples`, and other `format` values.

An object whose schema leaves `additionalProperties` unset gets no extra properties: a
narrower reply that still satisfies the schema, and what OpenAI's strict mode asks.

A forced call's grammar holds each tool's parameters inside the call object
(`{"name": ..., "arguments": PARAMETERS}`): `relocated` rewrites their references so
that `#/$defs/...` (any nested pydantic model) and `#` (recursion) still resolve there.
"""

from __future__ import annotations

from typing import Any

UNSUPPORTED = {
    "oneOf": "use anyOf: the grammar cannot exclude a value that matches two branches",
    "not": "the grammar cannot exclude the values of a schema",
    "if": "conditional schemas are not compiled into the grammar",
    "then": "conditional schemas are not compiled into the grammar",
    "else": "conditional schemas are not compiled into the grammar",
    "contains": "list the allowed items with items or prefixItems",
    "minContains": "list the allowed items with items or prefixItems",
    "maxContains": "list the allowed items with items or prefixItems",
    "dependentRequired": "make the properties required, or use anyOf",
    "dependentSchemas": "use anyOf",
    "dependencies": "make the properties required, or use anyOf",
    "$dynamicRef": "use $ref to #/$defs/...",
    "$recursiveRef": "use $ref to #/$defs/...",
}
ENFORCED_FORMATS = frozenset(
    {
        "date-time",
        "date",
        "time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uri-template",
        "uuid",
        "json-pointer",
        "relative-json-pointer",
    }
)

# keywords whose value is one subschema, a list of them, or a name → subschema map
_ONE = (
    "additionalProperties",
    "items",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_LIST = ("anyOf", "allOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unsupported_features(schema: Any, path: str = "") -> list[str]:
    """Each keyword of `schema` (at any depth) that cannot be forced, as
    "PATH: KEYWORD (what to do instead)"; empty when the whole schema can be."""
    if not isinstance(schema, dict):
        return []
    found: list[str] = []
    here = path or "(root)"
    for keyword, hint in UNSUPPORTED.items():
        if keyword in schema:
            found.append(f"{here}: {keyword} ({hint})")
    if schema.get("uniqueItems") is True:
        found.append(f"{here}: uniqueItems (the grammar cannot exclude repeated items)")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        found.append(f"{here}: allOf with several schemas (merge them into one schema)")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        found.append(f"{here}: $ref to another document ({ref}); put it under $defs")
    for keyword in _ONE:
        if not isinstance(schema.get(keyword), list):
            found += unsupported_features(schema.get(keyword), _join(path, keyword))
    for keyword in (*_LIST, "items"):  # "items" as a list: the old tuple form
        items = schema.get(keyword)
        for i, item in enumerate(items if isinstance(items, list) else []):
            found += unsupported_features(item, f"{_join(path, keyword)}[{i}]")
    for keyword in _MAP:
        named = schema.get(keyword)
        for name, item in (named if isinstance(named, dict) else {}).items():
            found += unsupported_features(item, _join(_join(path, keyword), name))
    return found


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def safe_lengths(schema: Any) -> Any:
    """The schema with every length-limited string (`minLength`/`maxLength`, no
    `pattern`) rewritten as a pattern of plain characters. xgrammar compiles length
    limits into a rule that lets raw control characters through, which is invalid JSON;
    the pattern keeps the limit and excludes them (and quotes and backslashes, so such a
    string cannot hold escapes when a call is forced)."""
    if isinstance(schema, list):
        return [safe_lengths(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: safe_lengths(value) for key, value in schema.items()}
    limited = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and limited and "pattern" not in out:
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        upper = "" if high is None else str(int(high))
        out["pattern"] = '^[^\\x00-\\x1f"\\\\]{' + f"{low},{upper}" + "}$"
    return out


# keywords whose values are data, not subschemas: a `$ref` key inside them is not a reference
_DATA = frozenset({"const", "enum", "default", "examples"})


def relocated(schema: Any, pointer: str) -> Any:
    """`schema` as it must read once placed at `pointer` (a JSON pointer such as
    "/properties/arguments") inside a larger document: every reference within the
    document (`$ref` "#", "#/$defs/X", "#/definitions/X", any "#/...") is prefixed with
    `pointer`, so it still names the same subschema. A tool's parameters become one
    property of the call object a forced call writes; without this, a `$ref` to their
    `$defs` (any nested pydantic model has them) would no longer resolve."""
    if isinstance(schema, list):
        return [relocated(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = "#" + pointer + value[1:]
        elif key in _DATA:
            out[key] = value
        elif key in _MAP and isinstance(value, dict):  # names → subschemas ("default" is a name)
            out[key] = {name: relocated(item, pointer) for name, item in value.items()}
        else:
            out[key] = relocated(value, pointer)
    return out
