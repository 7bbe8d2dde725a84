r'''Extract llama.cpp's JSON-schema-to-grammar test cases into tests/data/llama_cpp_json_schemas.json.

llama.cpp's tests/test-json-schema-to-grammar.cpp lists its cases as
`test({ SUCCESS|FAILURE, "name", R"""(schema)""", R"""(grammar)""" });` (C++ raw strings); this reads them as
written (names, schemas and expected grammars, raw strings taken verbatim) so that
tests/test_json_schema.py checks llamapy's converter against the same expectations without
the C++ tree. Run from the repository root:

    python tests/record_json_schema_cases.py /path/to/llama.cpp
'''
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"
SOURCE = "tests/test-json-schema-to-grammar.cpp"

RAW = r'R"""\((.*?)\)"""'
STRING = r'"((?:[^"\\]|\\.)*)"'  # a C string literal (no escapes beyond JSON's in these files)
CASE = re.compile(r"test\(\{\s*(SUCCESS|FAILURE),\s*" + STRING + r",\s*(?:" + RAW + "|" + STRING + r"),\s*(?:" + RAW
                  + "|" + STRING + r")\s*\}\);", re.DOTALL)


def extract(text: str) -> list[dict]:
    cases = []
    for status, name, raw_schema, str_schema, raw_grammar, str_grammar in CASE.findall(text):
        schema = raw_schema or json.loads(f'"{str_schema}"')
        grammar = raw_grammar or json.loads(f'"{str_grammar}"')
        cases.append({"name": json.loads(f'"{name}"'), "ok": status == "SUCCESS", "schema": schema,
                      "grammar": grammar if status == "SUCCESS" else None})
    return cases


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    source = Path(sys.argv[1]) / SOURCE
    text = source.read_text()
    cases = extract(text)
    n_calls = len(re.findall(r"^\s*test\(\{", text, re.MULTILINE))
    if len(cases) != n_calls:
        sys.exit(f"error: read {len(cases)} of the {n_calls} test cases of {source}: the format changed")
    (DATA / "llama_cpp_json_schemas.json").write_text(json.dumps(
        {"source": f"llama.cpp {SOURCE}", "cases": cases}, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(cases)} cases ({sum(not c['ok'] for c in cases)} expected to fail)")


if __name__ == "__main__":
    main()
