"""JSON schema to GBNF with llama.cpp's rules (common/json-schema-to-grammar.cpp).

The same rule names and the same text, rule for rule, so that the grammar llama.cpp makes of
a schema is the grammar llamapy makes (tests/data/llama_cpp_json_schemas.json holds llama.cpp's
own cases): `root`, `space`, the primitives (`string`, `char`, `number`, `integer`, `value`,
`object`, `array`, ...), a rule per property (`a`, `a-kv`) and per optional tail
(`a-rest`), integer ranges written digit by digit (json_schema_numbers.py), `pattern`s
turned into rules (json_schema_pattern.py; one that cannot be is accepted as any string,
with a warning, as llama.cpp does), and the rules sorted by name.

One deliberate difference: a pattern is read by characters where llama.cpp reads bytes, so a
non-ASCII character followed by a quantifier is repeated whole (llama.cpp repeats its last
byte, which makes a grammar it cannot read).
"""
from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .grammar_parser import GrammarError
from .json_schema import INT64_MAX, INT64_MIN, Format, Kind, Node, read_schema
from .json_schema_numbers import integer_range
from .json_schema_pattern import InvalidPattern, UnsupportedPattern, pattern_rule

INT_MAX = 2**31 - 1
SPACE_RULE = '| " " | "\\n"{1,2} [ \\t]{0,20}'


@dataclass(frozen=True)
class Builtin:
    content: str
    deps: tuple[str, ...] = ()


PRIMITIVE_RULES = {
    "boolean": Builtin('("true" | "false")'),
    "decimal-part": Builtin("[0-9]{1,16}"),
    "integral-part": Builtin("[0] | [1-9] [0-9]{0,15}"),
    "number": Builtin('("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?',
                      ("integral-part", "decimal-part")),
    "integer": Builtin('("-"? integral-part)', ("integral-part",)),
    "value": Builtin("object | array | string | number | boolean | null",
                     ("object", "array", "string", "number", "boolean", "null")),
    "object": Builtin('"{" space ( string ":" space value ("," space string ":" space value)* )? space "}"',
                      ("string", "value")),
    "array": Builtin('"[" space ( value ("," space value)* )? space "]"', ("value",)),
    "uuid": Builtin('"\\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" '
                    '[0-9a-fA-F]{12} "\\""'),
    "char": Builtin('[^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})'),
    "string": Builtin('"\\"" char* "\\""', ("char",)),
    "null": Builtin('"null"'),
}

STRING_FORMAT_RULES = {
    "date": Builtin('[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [1-2] [0-9] | "3" [0-1] )'),
    "time": Builtin('([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{3} )? ( "Z" | ( "+" | "-" ) '
                    '( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )'),
    "date-time": Builtin('date "T" time', ("date", "time")),
    "date-string": Builtin('"\\"" date "\\""', ("date",)),
    "time-string": Builtin('"\\"" time "\\""', ("time",)),
    "date-time-string": Builtin('"\\"" date-time "\\""', ("date-time",)),
}

RESERVED_NAMES = {"root", *PRIMITIVE_RULES, *STRING_FORMAT_RULES}
INVALID_RULE_CHARS = re.compile(r"[^a-zA-Z0-9-]+")
LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}


def format_literal(text: str) -> str:
    """A GBNF string literal of `text`."""
    return '"' + re.sub(r'[\r\n"\\]', lambda m: LITERAL_ESCAPES[m.group()], text) + '"'


def json_dump(value: Any) -> str:
    """A JSON value as llama.cpp's dump() writes it: compact, UTF-8 kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def build_repetition(item: str, min_items: int, max_items: int, separator: str = "") -> str:
    """`item` repeated min..max times (max INT_MAX: unbounded), with `separator` between."""
    has_max = max_items != INT_MAX
    if max_items == 0:
        return ""
    if min_items == 0 and max_items == 1:
        return item + "?"
    if not separator:
        if min_items == 1 and not has_max:
            return item + "+"
        if min_items == 0 and not has_max:
            return item + "*"
        return f"{item}{{{min_items},{max_items if has_max else ''}}}"
    rest = build_repetition(f"({separator} {item})", 0 if min_items == 0 else min_items - 1,
                            max_items - 1 if has_max else max_items)
    result = f"{item} {rest}"
    return f"({result})?" if min_items == 0 else result


def not_strings(strings: list[str], char_rule: str) -> str:
    """A JSON string that is none of `strings` (a trie of them, one branch per next character)."""
    trie: dict = {}
    for s in strings:
        node = trie
        for c in s:
            node = node.setdefault(c, {})
        node.setdefault(None, True)  # a word ends here
    out = ['["] ( ']

    def visit(node: dict) -> None:
        children = sorted((c for c in node if c is not None), key=ord)
        for i, c in enumerate(children):
            if i:
                out.append(" | ")
            out.append(f"[{c}]")
            if any(k is not None for k in node[c]):
                out.append(" (")
                visit(node[c])
                out.append(")")
            else:
                out.append(f" {char_rule}+")
        if children:
            out.append(f' | [^"{"".join(children)}] {char_rule}*')

    visit(trie)
    out.append(" )")
    if None not in trie:
        out.append("?")
    out.append(' ["]')
    return "".join(out)


class SchemaConverter:
    """common_chat_schema_converter: rules by name, errors and warnings."""

    def __init__(self, dotall: bool = False) -> None:
        self.dotall = dotall
        self.rules: dict[str, str] = {"space": SPACE_RULE}
        self.resolving: set[str] = set()
        self.errors: list[str] = []
        self.warnings: list[str] = []

    # ---- rules ------------------------------------------------------------------------------
    def add_rule(self, name: str, rule: str) -> str:
        """The rule's name, escaped, and numbered when another rule already has it."""
        esc = INVALID_RULE_CHARS.sub("-", name)
        if self.rules.get(esc, rule) == rule:
            self.rules[esc] = rule
            return esc
        i = 0
        while f"{esc}{i}" in self.rules and self.rules[f"{esc}{i}"] != rule:
            i += 1
        self.rules[f"{esc}{i}"] = rule
        return f"{esc}{i}"

    def add_primitive(self, name: str, rule: Builtin) -> str:
        n = self.add_rule(name, rule.content)
        for dep in rule.deps:
            dep_rule = PRIMITIVE_RULES.get(dep) or STRING_FORMAT_RULES.get(dep)
            if dep_rule is None:
                self.errors.append(f"Rule {dep} not known")
                continue
            if dep not in self.rules:
                self.add_primitive(dep, dep_rule)
        return n

    def primitive(self, rule_name: str, kind: str) -> str:
        return self.add_primitive("root" if rule_name == "root" else kind, PRIMITIVE_RULES[kind])

    def grammar(self) -> str:
        return "".join(f"{name} ::= {self.rules[name]}\n" for name in sorted(self.rules))

    # ---- nodes ------------------------------------------------------------------------------
    def visit(self, node: Node, name: str) -> str:
        rule_name = name + "-" if name in RESERVED_NAMES else (name or "root")
        sub = name + "-" if name else ""
        kind = node.kind
        if kind == Kind.REF:
            return self.add_rule(rule_name, self.resolve_ref(node))
        if kind == Kind.ANY_OF:
            return self.add_rule(rule_name, " | ".join(
                self.visit(alt, f"{name}{'-' if name else 'alternative-'}{i}") for i, alt in enumerate(node.children)))
        if kind == Kind.ALL_OF:
            return self.all_of(node, name, rule_name)
        if kind == Kind.CONST:
            return self.add_rule(rule_name, format_literal(json_dump(node.values[0])))
        if kind == Kind.ENUM:
            return self.add_rule(rule_name, "(" + " | ".join(format_literal(json_dump(v)) for v in node.values) + ")")
        if kind == Kind.OBJECT:
            if not node.properties and node.additional is not None and node.additional.kind == Kind.ANY:
                return self.add_rule(rule_name, self.add_primitive("object", PRIMITIVE_RULES["object"]))
            required = {n for n, _, req in node.properties if req}
            return self.add_rule(rule_name, self.object_rule([(n, s) for n, s, _ in node.properties], required, name,
                                                             node.additional))
        if kind == Kind.TUPLE:
            items = ' "," space '.join(self.visit(item, f"{sub}tuple-{i}") for i, item in enumerate(node.children))
            return self.add_rule(rule_name, f'"[" space {items} space "]"')
        if kind == Kind.ARRAY:
            if node.items.kind == Kind.ANY and node.min_items == 0 and node.max_items < 0:
                return self.primitive(rule_name, "array")
            item = self.visit(node.items, f"{sub}item")
            max_items = INT_MAX if node.max_items < 0 else node.max_items
            items = build_repetition(item, node.min_items, max_items, '"," space')
            return self.add_rule(rule_name, f'"[" space {items} space "]"')
        if kind == Kind.STRING:
            return self.string(node, rule_name)
        if kind == Kind.INTEGER:
            if node.minimum == INT64_MIN and node.maximum == INT64_MAX:
                return self.primitive(rule_name, "integer")
            return self.add_rule(rule_name, "(" + integer_range(node.minimum, node.maximum) + ")")
        if kind in (Kind.NUMBER, Kind.BOOLEAN, Kind.NULL):
            return self.primitive(rule_name, kind.value)
        return self.add_rule(rule_name, self.add_primitive("value", PRIMITIVE_RULES["value"]))  # ANY

    def string(self, node: Node, rule_name: str) -> str:
        if node.pattern:
            return self.visit_pattern(node.pattern, rule_name)
        if node.format == Format.UUID:
            return self.primitive(rule_name, "uuid")
        if node.format != Format.NONE:
            prim = f"{node.format.value}-string"
            return self.add_rule(rule_name, self.add_primitive(prim, STRING_FORMAT_RULES[prim]))
        if node.min_length > 0 or node.max_length >= 0:
            char = self.add_primitive("char", PRIMITIVE_RULES["char"])
            max_len = INT_MAX if node.max_length < 0 else node.max_length
            return self.add_rule(rule_name, f'"\\"" {build_repetition(char, node.min_length, max_len)} "\\""')
        return self.primitive(rule_name, "string")

    def visit_pattern(self, pattern: str, name: str) -> str:
        snapshot = dict(self.rules)
        try:
            return self.add_rule(name, pattern_rule(pattern, name, self.add_rule, self.dotall))
        except UnsupportedPattern as e:
            self.rules = snapshot
            self.warnings.append(f"pattern {pattern} is not supported ({e}), accepting any string")
            return self.add_rule(name, self.add_primitive("string", PRIMITIVE_RULES["string"]))
        except InvalidPattern as e:
            self.rules = snapshot
            self.errors.append(f"Invalid pattern {pattern}: {e}")
            return ""

    def resolve_ref(self, node: Node) -> str:
        fragment = node.ref.split("#", 1)[1] if "#" in node.ref else node.ref
        ref_name = "ref" + INVALID_RULE_CHARS.sub("-", fragment)
        if ref_name not in self.rules and node.ref not in self.resolving:
            if node.target is None:
                self.errors.append(f"Unresolved $ref {node.ref}")
                return ""
            self.resolving.add(node.ref)
            ref_name = self.visit(node.target, ref_name)
            self.resolving.discard(node.ref)
        return ref_name

    def object_rule(self, properties: list[tuple[str, Node]], required: set[str], name: str,
                    additional: Node | None) -> str:
        sep = "-" if name else ""
        required_props, optional_props, prop_names = [], [], []
        kv_rules: dict[str, str] = {}
        for prop, schema in properties:
            prop_rule = self.visit(schema, f"{name}{sep}{prop}")
            kv_rules[prop] = self.add_rule(f"{name}{sep}{prop}-kv",
                                           f"{format_literal(json_dump(prop))} space \":\" space {prop_rule}")
            (required_props if prop in required else optional_props).append(prop)
            prop_names.append(prop)
        if additional is not None:
            sub = f"{name}{sep}additional"
            value = (self.visit(additional, f"{sub}-value") if additional.kind != Kind.ANY
                     else self.add_primitive("value", PRIMITIVE_RULES["value"]))
            key = (self.add_primitive("string", PRIMITIVE_RULES["string"]) if not prop_names
                   else self.add_rule(f"{sub}-k", not_strings(prop_names, self.add_primitive("char",
                                                                                             PRIMITIVE_RULES["char"]))))
            kv_rules["*"] = self.add_rule(f"{sub}-kv", f'{key} ":" space {value}')
            optional_props.append("*")
        if not required_props and not optional_props:
            return '"{" space "}"'
        rule = '"{" space ' + ' "," space '.join(kv_rules[p] for p in required_props)
        if optional_props:
            rule += " ("
            if required_props:
                rule += ' "," space ( '

            def chained(keys: list[str], first_is_optional: bool) -> str:
                if not keys:
                    return ""
                k = keys[0]
                comma_ref = f'( "," space {kv_rules[k]} )'
                if first_is_optional:
                    res = comma_ref + ("*" if k == "*" else "?")
                else:
                    res = kv_rules[k] + (f" {comma_ref}*" if k == "*" else "")
                if len(keys) > 1:
                    res += " " + self.add_rule(f"{name}{sep}{k}-rest", chained(keys[1:], True))
                return res

            rule += " | ".join(chained(optional_props[i:], False) for i in range(len(optional_props)))
            if required_props:
                rule += " )"
            rule += " )?"
        return rule + ' space "}"'

    def all_of(self, node: Node, name: str, rule_name: str) -> str:
        required: set[str] = set()
        properties: list[tuple[str, Node]] = []
        enum_counts: dict[str, int] = {}

        def add(component: Node, is_required: bool) -> None:
            if component.kind == Kind.REF:
                if component.target is not None:
                    add(component.target, is_required)
            elif component.kind == Kind.OBJECT:
                for prop, schema, _ in component.properties:
                    properties.append((prop, schema))
                    if is_required:
                        required.add(prop)
            elif component.kind == Kind.ENUM:
                for value in component.values:
                    literal = format_literal(json_dump(value))
                    enum_counts[literal] = enum_counts.get(literal, 0) + 1

        for child in node.children:
            if child.kind == Kind.ANY_OF:
                for alt in child.children:
                    add(alt, False)
            else:
                add(child, True)
        common = [v for v in sorted(enum_counts, key=lambda s: s.encode()) if enum_counts[v] == len(node.children)]
        if common:
            return self.add_rule(rule_name, "(" + " | ".join(common) + ")")
        return self.add_rule(rule_name, self.object_rule(properties, required, name, None))

    def check(self, warn: Callable[[str], None] | None) -> None:
        if self.errors:
            raise GrammarError("JSON schema conversion failed: " + "; ".join(self.errors))
        if self.warnings:
            message = "JSON schema conversion was incomplete: " + "; ".join(self.warnings)
            if warn is None:
                warnings.warn(message, stacklevel=3)
            else:
                warn(message)


def json_schema_to_grammar(schema: Any, warn: Callable[[str], None] | None = None) -> str:
    """The GBNF grammar llama.cpp makes of a JSON schema (a dict, or its JSON text). Raises
    GrammarError; `warn` hears of the parts accepted more loosely than the schema says (a
    pattern that has no grammar: any string), a Python warning without it."""
    root = read_schema(schema)
    converter = SchemaConverter()
    try:
        converter.visit(root, "")
    except RecursionError:
        raise GrammarError("JSON schema: nested too deeply") from None
    converter.check(warn)
    return converter.grammar()


JSON_OBJECT_SCHEMA = {"type": "object"}


def any_json_object_grammar() -> str:
    """response_format {"type": "json_object"}: llama.cpp's grammar of any JSON object."""
    return json_schema_to_grammar(JSON_OBJECT_SCHEMA)
