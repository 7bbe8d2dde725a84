"""JSON schemas as llama.cpp turns them into grammars, and the JSON the model then writes.

llama.cpp's own test cases (tests/test-json-schema-to-grammar.cpp, extracted into
tests/data/llama_cpp_json_schemas.json by tests/record_json_schema_cases.py) give llamapy the
same grammars, character for character; what llama.cpp refuses is refused in one line; and
the texts sampled under a schema — through llamapy.generate and through llamapy-server's
`response_format` — are JSON that conforms to it (checked by a small validator written here).
"""
from __future__ import annotations

import json
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import llamapy
from llamapy.sampling.grammar_parser import GrammarError, parse_gbnf
from llamapy.sampling.json_schema_grammar import any_json_object_grammar, json_schema_to_grammar

CASES = json.loads((Path(__file__).parent / "data" / "llama_cpp_json_schemas.json").read_text(encoding="utf-8"))["cases"]


def trim(grammar: str) -> str:
    """llama.cpp's test compares grammars with the indentation of its raw strings removed."""
    return re.sub(r"(^|\n)[ \t]+", r"\1", grammar.strip(" \n\r\t"))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_llama_cpps_cases_give_the_same_grammars(case):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unsupported patterns warn (and become any string)
        if not case["ok"]:
            with pytest.raises(GrammarError) as refused:
                json_schema_to_grammar(case["schema"])
            assert "\n" not in str(refused.value)
            return
        grammar = json_schema_to_grammar(case["schema"])
    assert trim(grammar) == trim(case["grammar"])
    assert "root" in parse_gbnf(grammar).symbol_ids  # and llamapy's parser reads it


def test_the_recording_is_llama_cpps_whole_list():
    assert len(CASES) == 81 and sum(not c["ok"] for c in CASES) == 3


def test_an_unsupported_pattern_is_any_string_with_a_warning():
    heard: list[str] = []
    grammar = json_schema_to_grammar({"type": "string", "pattern": "^(?=a)a$"}, warn=heard.append)
    assert "root ::= string" in grammar and len(heard) == 1 and "(?=a)a" in heard[0]


@pytest.mark.parametrize("schema, message", [
    ({"type": "integer", "minimum": "1"}, "JSON schema error at #: minimum must be a number"),
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "at #/properties/a: unrecognized type strin"),
    ({"$ref": "#/$defs/missing"}, "cannot resolve $ref #/$defs/missing, $defs not found"),
    ({"$ref": "https://example.com/s.json"}, "only references into the same document"),
    ({"type": "string", "pattern": "^(a$"}, "Invalid pattern ^(a$: unbalanced parentheses"),
    ({"type": "array", "maxItems": -1}, "maxItems must be a non-negative integer"),
    ('{"type": ', "not valid JSON"),
])
def test_bad_schemas_are_one_line_naming_the_place(schema, message):
    with pytest.raises(GrammarError) as bad:
        json_schema_to_grammar(schema)
    assert message in str(bad.value) and "\n" not in str(bad.value)


# ---- the JSON written under a schema -------------------------------------------------------------
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer", "minimum": 1, "maximum": 99},
    "pet": {"enum": ["cat", "dog", "bird"]},
    "happy": {"type": "boolean"},
    "toys": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}},
    "required": ["name", "age", "pet", "happy"], "additionalProperties": False}


def conforms(value, schema: dict) -> bool:
    """A small validator for the keywords these tests use (type, properties, required,
    additionalProperties false, enum, integer bounds, string and array lengths)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(conforms(v, props[k]) for k, v in value.items() if k in props))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    if kind == "string":
        return isinstance(value, str) and schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
                and all(conforms(v, schema.get("items", {})) for v in value))
    return True


def test_the_validator_can_say_no():
    assert conforms({"name": "Tom", "age": 5, "pet": "cat", "happy": True}, PERSON)
    for bad in ({"name": "Tom", "age": 100, "pet": "cat", "happy": True}, {"name": "Tom", "age": 5, "pet": "cow",
                "happy": True}, {"name": "Tom", "age": 5, "pet": "cat"}, {"name": "", "age": 5, "pet": "cat",
                "happy": True}, {"name": "Tom", "age": 5, "pet": "cat", "happy": True, "x": 1}):
        assert not conforms(bad, PERSON)


def test_generate_writes_json_that_conforms(stories_path):
    model = llamapy.load_model(stories_path)
    for seed in range(3):
        done = llamapy.generate(model, "Once upon a time", 200, json_schema=PERSON, temperature=0.8, seed=seed,
                                details=True)
        assert done.finish_reason == "stop" and conforms(json.loads(done.text), PERSON), done.text
    text = llamapy.generate(model, "Once upon a time", 200, json_schema=json.dumps(PERSON), temperature=0)
    assert conforms(json.loads(text), PERSON)


def test_json_object_is_the_grammar_of_any_object():
    grammar = any_json_object_grammar()
    assert grammar == json_schema_to_grammar({"type": "object"}) and grammar.startswith("array ::= ")
    assert "root ::= object" in grammar


# ---- llamapy-server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(stories_path):
    from test_server import ServerProcess
    srv = ServerProcess("-m", str(stories_path), "-np", "4", "-c", "1024", "-t", "2")
    yield srv
    srv.stop()


@pytest.mark.slow
def test_a_hundred_requests_with_response_format_get_conforming_json(server):
    """response_format json_schema through the openai client, 8 clients at once on 4 slots:
    every answer is JSON that conforms to the schema, ended by the grammar (not by length)."""
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def ask(i: int):
        reply = client.chat.completions.create(model="stories", messages=[{"role": "user", "content": f"Person {i}"}],
                                               max_tokens=200, temperature=0.8, seed=i, response_format=fmt)
        return reply.choices[0].finish_reason, reply.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(100)))
    assert len(answers) == 100
    for finish, text in answers:
        assert finish == "stop" and conforms(json.loads(text), PERSON), text


def test_server_grammar_fields(server):
    status, reply = server.request("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 40, "seed": 1,
                                                               "response_format": {"type": "json_object"}})
    assert status == 200 and isinstance(json.loads(reply["choices"][0]["text"]), dict)
    status, reply = server.request("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 8, "temperature": 0,
                                                               "grammar": 'root ::= " yes" | " no"'})
    assert status == 200 and reply["choices"][0]["text"] in (" yes", " no")
    status, reply = server.request("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 60, "seed": 2,
                                                               "json_schema": {"type": "array", "items":
                                                                               {"type": "integer"}, "maxItems": 3}})
    assert status == 200 and len(json.loads(reply["choices"][0]["text"])) <= 3
    status, reply = server.request("POST", "/completion", {"prompt": "Once", "n_predict": 60, "seed": 3,  # native
                                                           "json_schema": {"type": "boolean"}})
    assert status == 200 and json.loads(reply["content"]) in (True, False) and reply["stop_type"] == "eos"
    status, reply = server.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                                    "max_tokens": 60, "seed": 4,
                                                                    "response_format": {"type": "json_object"}})
    assert status == 200 and isinstance(json.loads(reply["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize("body, fragment", [
    ({"grammar": 'root ::= "a" ('}, "grammar: expecting ')'"),
    ({"json_schema": {"type": "integer", "maximum": "9"}}, "json_schema: JSON schema error at #: maximum must be a number"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}}, "unrecognized type foo"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"grammar": 'root ::= "a"', "json_schema": {}}, "not both"),
])
def test_server_bad_grammars_and_schemas_are_400s(server, body, fragment):
    status, reply = server.request("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 4, **body})
    assert status == 400 and fragment in reply["error"]["message"], reply
