"""JSON schemas read into the subset llama.cpp converts (common/json-schema.cpp).

A schema becomes a tree of nodes: references into the same document (`$ref: "#/..."`, cycles
allowed), alternatives (oneOf / anyOf, or a `type` list), allOf, const, enum, and the types
with the keywords the converter uses (properties / required / additionalProperties, items /
prefixItems / minItems / maxItems, pattern / format / minLength / maxLength, integer bounds
with the exclusive ones folded in). The structural keywords decide when `type` is absent, in
llama.cpp's order. What falls outside is one error naming where it is (`#/properties/a`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .grammar_parser import GrammarError

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


class Kind(Enum):
    ANY = "any"
    REF = "ref"
    ANY_OF = "anyOf"
    ALL_OF = "allOf"
    CONST = "const"
    ENUM = "enum"
    NULL = "null"
    BOOLEAN = "boolean"
    NUMBER = "number"
    INTEGER = "integer"
    STRING = "string"
    ARRAY = "array"
    TUPLE = "tuple"
    OBJECT = "object"


class Format(Enum):
    NONE = ""
    UUID = "uuid"
    DATE = "date"
    TIME = "time"
    DATE_TIME = "date-time"


@dataclass(eq=False)
class Node:
    """One schema node; the fields a kind does not use keep their defaults."""
    kind: Kind
    children: list["Node"] = field(default_factory=list)     # anyOf / allOf alternatives, tuple items
    ref: str = ""                                            # REF: the reference and its target
    target: "Node | None" = None
    values: list[Any] = field(default_factory=list)          # CONST (one) / ENUM values
    minimum: int = INT64_MIN                                 # INTEGER bounds, inclusive
    maximum: int = INT64_MAX
    pattern: str = ""                                        # STRING
    format: Format = Format.NONE
    min_length: int = 0
    max_length: int = -1                                     # -1: unbounded
    items: "Node | None" = None                              # ARRAY
    min_items: int = 0
    max_items: int = -1
    properties: list[tuple[str, "Node", bool]] = field(default_factory=list)  # OBJECT: (name, schema, required)
    additional: "Node | None" = None                         # None: no other property allowed


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Reader:
    """common_chat_schema_builder."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.refs: dict[str, Node | None] = {}
        self.pending: list[Node] = []

    @staticmethod
    def fail(path: str, message: str) -> GrammarError:
        return GrammarError(f"JSON schema error at {path}: {message}")

    def count(self, schema: dict, key: str, path: str, default: int) -> int:
        if key not in schema:
            return default
        value = schema[key]
        if not _is_int(value) or not 0 <= value <= INT32_MAX:
            raise self.fail(path, f"{key} must be a non-negative integer")
        return value

    def bound(self, schema: dict, key: str, path: str, round_up: bool) -> int:
        """A bound as an integer; a fractional one rounded inwards (toward the integers it admits)."""
        value = schema[key]
        if _is_int(value):
            return max(INT64_MIN, min(INT64_MAX, value))
        if not _is_number(value) or not math.isfinite(value):
            raise self.fail(path, f"{key} must be a number")
        rounded = math.ceil(value) if round_up else math.floor(value)
        return max(INT64_MIN, min(INT64_MAX, rounded))

    def format(self, schema: dict, path: str) -> Format:
        if "format" not in schema:
            return Format.NONE
        value = schema["format"]
        if not isinstance(value, str):
            raise self.fail(path, "format must be a string")
        if value in ("date", "time", "date-time"):
            return Format(value)
        if value == "uuid" or (len(value) == 5 and value.startswith("uuid") and "1" <= value[4] <= "5"):
            return Format.UUID
        return Format.NONE

    def resolve(self, ref: str, path: str) -> Any:
        target = self.root
        for sel in ref[1:].split("/")[1:]:
            if isinstance(target, dict) and sel in target:
                target = target[sel]
            elif isinstance(target, list):
                index = int(sel) if sel.isascii() and sel.isdigit() else len(target)
                if index >= len(target):
                    raise self.fail(path, f"cannot resolve $ref {ref}, {sel} is out of range")
                target = target[index]
            else:
                raise self.fail(path, f"cannot resolve $ref {ref}, {sel} not found")
        return target

    def ref(self, value: Any, path: str) -> Node:
        if not isinstance(value, str):
            raise self.fail(path, "$ref must be a string")
        if not value.startswith("#/"):
            raise self.fail(path, f"unsupported $ref {value}, only references into the same document are supported")
        if value not in self.refs:
            self.refs[value] = None  # a cycle back to this $ref stops here
            self.refs[value] = self.node(self.resolve(value, path), value)
        node = Node(Kind.REF, ref=value)
        self.pending.append(node)
        return node

    def alternatives(self, kind: Kind, alts: Any, path: str) -> Node:
        if not isinstance(alts, list):
            raise self.fail(path, "must be an array of schemas")
        if not alts:
            raise self.fail(path, "must not be empty")
        return Node(kind, children=[self.node(alt, f"{path}/{i}") for i, alt in enumerate(alts)])

    def object(self, schema: dict, path: str) -> Node:
        node = Node(Kind.OBJECT)
        required = set()
        if isinstance(schema.get("required"), list):
            required = {name for name in schema["required"] if isinstance(name, str)}
        if "properties" in schema:
            properties = schema["properties"]
            if not isinstance(properties, dict):
                raise self.fail(path, "properties must be an object")
            node.properties = [(name, self.node(prop, f"{path}/properties/{name}"), name in required)
                               for name, prop in properties.items()]
        if "additionalProperties" in schema:
            additional = schema["additionalProperties"]
            if isinstance(additional, bool):
                node.additional = Node(Kind.ANY) if additional else None
            elif isinstance(additional, dict):
                node.additional = self.node(additional, f"{path}/additionalProperties")
            else:
                raise self.fail(path, "additionalProperties must be a boolean or a schema")
        elif "properties" not in schema:
            node.additional = Node(Kind.ANY)  # {"type": "object"} alone: any object
        return node

    def array(self, schema: dict, path: str) -> Node:
        node = Node(Kind.ARRAY)
        if "items" in schema or "prefixItems" in schema:
            key = "items" if "items" in schema else "prefixItems"
            items = schema[key]
            if isinstance(items, list):
                return Node(Kind.TUPLE, children=[self.node(item, f"{path}/{key}/{i}") for i, item in enumerate(items)])
            node.items = self.node(items, f"{path}/{key}")
        else:
            node.items = Node(Kind.ANY)
        node.min_items = self.count(schema, "minItems", path, 0)
        node.max_items = self.count(schema, "maxItems", path, -1)
        return node

    def string(self, schema: dict, path: str) -> Node:
        node = Node(Kind.STRING)
        if "pattern" in schema:
            if not isinstance(schema["pattern"], str):
                raise self.fail(path, "pattern must be a string")
            node.pattern = schema["pattern"]
        node.format = self.format(schema, path)
        node.min_length = self.count(schema, "minLength", path, 0)
        node.max_length = self.count(schema, "maxLength", path, -1)
        return node

    def integer(self, schema: dict, path: str) -> Node:
        node = Node(Kind.INTEGER)
        if "minimum" in schema:
            node.minimum = self.bound(schema, "minimum", path, True)
        elif "exclusiveMinimum" in schema:
            node.minimum = min(INT64_MAX, self.bound(schema, "exclusiveMinimum", path, False) + 1)
        if "maximum" in schema:
            node.maximum = self.bound(schema, "maximum", path, False)
        elif "exclusiveMaximum" in schema:
            node.maximum = max(INT64_MIN, self.bound(schema, "exclusiveMaximum", path, True) - 1)
        return node

    def node(self, schema: Any, path: str) -> Node:
        if not isinstance(schema, dict):
            raise self.fail(path, "schema must be an object")
        if "$ref" in schema:
            return self.ref(schema["$ref"], path)
        if "oneOf" in schema or "anyOf" in schema:
            key = "oneOf" if "oneOf" in schema else "anyOf"
            return self.alternatives(Kind.ANY_OF, schema[key], f"{path}/{key}")
        kind = schema.get("type")
        if isinstance(kind, list):  # {"type": [a, b], ...} is anyOf [{"type": a, ...}, {"type": b, ...}]
            if not kind:
                raise self.fail(path, "type must not be empty")
            return Node(Kind.ANY_OF, children=[self.node({**schema, "type": t}, f"{path}/type/{i}")
                                               for i, t in enumerate(kind)])
        if "const" in schema:
            return Node(Kind.CONST, values=[schema["const"]])
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise self.fail(path, "enum must be a non-empty array")
            return Node(Kind.ENUM, values=list(values))
        if kind is not None and not isinstance(kind, str):
            raise self.fail(path, "type must be a string or an array of strings")
        has_properties = "properties" in schema or (
            "additionalProperties" in schema and schema["additionalProperties"] is not True)
        if not kind:
            if has_properties:
                return self.object(schema, path)
            if "allOf" in schema:
                return self.alternatives(Kind.ALL_OF, schema["allOf"], f"{path}/allOf")
            if "items" in schema or "prefixItems" in schema:
                return self.array(schema, path)
            if any(k in schema for k in ("pattern", "minLength", "maxLength")) or \
                    self.format(schema, path) != Format.NONE:
                return self.string(schema, path)
            return Node(Kind.ANY)
        if kind == "object":
            if not has_properties and "allOf" in schema:
                return self.alternatives(Kind.ALL_OF, schema["allOf"], f"{path}/allOf")
            return self.object(schema, path)
        if kind == "string":
            if "allOf" in schema:
                return self.alternatives(Kind.ALL_OF, schema["allOf"], f"{path}/allOf")
            return self.string(schema, path)
        if kind == "array":
            return self.array(schema, path)
        if kind == "integer":
            return self.integer(schema, path)
        simple = {"number": Kind.NUMBER, "boolean": Kind.BOOLEAN, "null": Kind.NULL}
        if kind in simple:
            return Node(simple[kind])
        raise self.fail(path, f"unrecognized type {kind}")

    def read(self) -> Node:
        root = self.node(self.root, "#")
        for node in self.pending:
            node.target = self.refs[node.ref]
        return root


def read_schema(schema: Any) -> Node:
    """The node tree of a JSON schema (a dict, or its JSON text). Raises GrammarError."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise GrammarError(f"JSON schema: not valid JSON: {e}") from None
    try:
        return _Reader(schema).read()
    except RecursionError:
        raise GrammarError("JSON schema: nested too deeply") from None
