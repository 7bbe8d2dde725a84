"""GBNF grammars as llama.cpp applies them: llama.cpp's own grammars (grammars/*.gbnf, recorded
in tests/data/llama_cpp_grammars.json by tests/record_llama_cpp_grammars.py) parse, texts
sampled under them are texts of the grammar (checked by parsers written here, independently
of llamapy's matcher), greedy texts are llama-completion's, and the rules a user meets one
by one (repetitions, classes, split UTF-8 characters, tokens, lazy triggers, errors) hold.
"""
from __future__ import annotations

import codecs
import json
import string
from pathlib import Path

import numpy as np
import pytest

import llamapy
from llamapy.cli.completion import tool as cli_tool
from llamapy.sampling import Dist, Greedy, MinP, Sampler, SamplerChain, Temp, TopK, TopP
from llamapy.sampling.grammar import Grammar, GrammarError, compile_grammar
from llamapy.sampling.grammar_sampler import GrammarChain, GrammarConstraint, GrammarTrigger

DATA = json.loads((Path(__file__).parent / "data" / "llama_cpp_grammars.json").read_text(encoding="utf-8"))
GRAMMARS: dict[str, str] = DATA["grammars"]


@pytest.fixture(scope="module")
def model(stories_path):
    return llamapy.load_model(stories_path)


# ---- independent checkers: each grammar written again as set-of-positions parsers ---------------
class Match:
    """One text under a parser: every parser gives the positions where it can end; running out
    of text in the middle of a parse is remembered (the text is then a prefix of the grammar's)."""

    def __init__(self, text: str) -> None:
        self.text, self.out_of_text, self.memo = text, False, {}

    def run(self, parser, i: int) -> frozenset:
        key = (id(parser), i)
        if key not in self.memo:
            self.memo[key] = frozenset()
            self.memo[key] = frozenset(parser(self, i))
        return self.memo[key]


def lit(text: str):
    def parse(m: Match, i: int):
        for k, c in enumerate(text):
            if i + k == len(m.text):
                m.out_of_text = True
                return ()
            if m.text[i + k] != c:
                return ()
        return (i + len(text),)
    return parse


def char(test):
    def parse(m: Match, i: int):
        if i == len(m.text):
            m.out_of_text = True
            return ()
        return (i + 1,) if test(m.text[i]) else ()
    return parse


def seq(*parsers):
    def parse(m: Match, i: int):
        ends = {i}
        for p in parsers:
            ends = {e for j in ends for e in m.run(p, j)}
        return ends
    return parse


def alt(*parsers):
    return lambda m, i: {e for p in parsers for e in m.run(p, i)}


def rep(p, lo: int = 0, hi: int | None = None):
    def parse(m: Match, i: int):
        out, frontier, n = set(), {i}, 0
        while frontier:
            if n >= lo:
                out |= frontier
            if hi is not None and n >= hi:
                break
            frontier = {e for j in frontier for e in m.run(p, j) if e > j}
            n += 1
        return out
    return parse


def opt(p):
    return rep(p, 0, 1)


def one_of(chars: str):
    return char(lambda c: c in chars)


def between(lo: str, hi: str):
    return char(lambda c: lo <= c <= hi)


DIGIT, LOWER = between("0", "9"), between("a", "z")


def forward(rules: dict, name: str):
    return lambda m, i: m.run(rules[name], i)


def arithmetic():
    r: dict = {}
    ws = rep(one_of(" \t\n"))
    term = alt(seq(LOWER, rep(char(lambda c: c.isascii() and (c.islower() or c.isdigit() or c == "_"))), ws),
               seq(rep(DIGIT, 1), ws), seq(lit("("), ws, forward(r, "expr"), lit(")"), ws))
    r["expr"] = seq(term, rep(seq(one_of("-+*/"), term)))
    return rep(seq(r["expr"], lit("="), ws, term, lit("\n")), 1)


def c_language():
    r: dict = {}
    ws = rep(one_of(" \t\n"), 1)
    data_type = alt(*(seq(lit(t), ws) for t in ("int", "float", "char")))
    ident = seq(char(lambda c: c.isascii() and (c.isalpha() or c == "_")),
                rep(char(lambda c: c.isascii() and (c.isalnum() or c == "_"))))
    expression = forward(r, "expression")
    arg_list = seq(expression, rep(seq(lit(","), ws, expression)))
    factor = forward(r, "factor")
    r["factor"] = alt(ident, rep(DIGIT, 1), seq(lit("-"), factor), seq(ident, lit("("), opt(arg_list), lit(")")),
                      seq(lit("("), ws, expression, ws, lit(")")))
    term = seq(factor, rep(seq(one_of("*/"), factor)))
    r["expression"] = seq(term, rep(seq(one_of("+-"), term)))
    condition = seq(expression, alt(*(lit(op) for op in ("<=", "<", "==", "!=", ">=", ">"))), expression)
    assign = seq(ident, ws, lit("="), ws, expression)
    block = seq(lit("{"), rep(forward(r, "statement")), lit("}"))
    r["statement"] = alt(
        seq(data_type, assign, lit(";")), seq(assign, lit(";")), seq(ident, ws, lit("("), opt(arg_list), lit(")"), lit(";")),
        seq(lit("return"), ws, expression, lit(";")), seq(lit("while"), lit("("), condition, lit(")"), block),
        seq(lit("for"), lit("("), alt(seq(data_type, assign), assign), lit(";"), ws, condition, lit(";"), ws, assign,
            lit(")"), block),
        seq(lit("if"), lit("("), condition, lit(")"), block, opt(seq(lit("else"), block))),
        seq(lit("//"), rep(char(lambda c: c != "\n")), lit("\n")),
        seq(lit("/*"), rep(alt(char(lambda c: c != "*"), seq(lit("*"), char(lambda c: c != "/")))), lit("*/")))
    return rep(seq(data_type, ident, lit("("), opt(seq(data_type, ident)), lit(")"), block))


def chess():
    file, rank, piece = between("a", "h"), between("1", "8"), one_of("NBKQR")
    pawn = seq(opt(seq(file, lit("x"))), file, rank, opt(seq(lit("="), piece)))
    nonpawn = seq(piece, opt(file), opt(rank), opt(lit("x")), file, rank)
    move = seq(alt(pawn, nonpawn, seq(lit("O-O"), opt(lit("-O")))), opt(one_of("+#")))
    line = seq(move, lit(" "), move, lit("\n"))
    return seq(lit("1. "), line, rep(seq(between("1", "9"), opt(DIGIT), lit(". "), line), 1))


def words(is_char):
    return seq(rep(char(is_char), 1), rep(seq(one_of(" \t\n"), rep(char(is_char), 1))))


def json_grammar(array_root: bool):
    r: dict = {}
    ws = alt(lit(""), lit(" "), seq(lit("\n"), rep(one_of(" \t"), 0, 20)))
    hexdigit = one_of("0123456789abcdefABCDEF")
    plain = char(lambda c: c not in '"\\' and c != "\x7f" and c >= " ")
    string_ = seq(lit('"'), rep(alt(plain, seq(lit("\\"), alt(one_of('"\\bfnrt'), seq(lit("u"), rep(hexdigit, 4, 4)))))),
                  lit('"'), ws)
    exponent = (seq(between("1", "9"), rep(DIGIT, 0, 15)) if array_root else seq(DIGIT, rep(between("1", "9"), 0, 15)))
    number = seq(opt(lit("-")), alt(DIGIT, seq(between("1", "9"), rep(DIGIT, 0, 15))), opt(seq(lit("."), rep(DIGIT, 1))),
                 opt(seq(one_of("eE"), opt(one_of("-+")), exponent)), ws)
    value = forward(r, "value")
    r["object"] = seq(lit("{"), ws, opt(seq(string_, lit(":"), ws, value, rep(seq(lit(","), ws, string_, lit(":"), ws,
                                                                              value)))), lit("}"), ws)
    r["array"] = seq(lit("["), ws, opt(seq(value, rep(seq(lit(","), ws, value)))), lit("]"), ws)
    r["value"] = alt(r["object"], r["array"], string_, number, seq(alt(lit("true"), lit("false"), lit("null")), ws))
    if array_root:
        return seq(lit("[\n"), ws, opt(seq(value, rep(seq(lit(",\n"), ws, value)))), lit("]"))
    return r["object"]


def japanese(c: str) -> bool:
    o = ord(c)
    return 0x3041 <= o <= 0x309F or 0x30A1 <= o <= 0x30FF or 0x3001 <= o <= 0x303E or 0x4E00 <= o <= 0x9FFF


CHECKERS = {
    "arithmetic.gbnf": arithmetic(),
    "c.gbnf": c_language(),
    "chess.gbnf": chess(),
    "english.gbnf": words(lambda c: c.isascii() and (c.isalnum() or c in string.punctuation)),
    "japanese.gbnf": words(japanese),
    "json.gbnf": json_grammar(array_root=False),
    "json_arr.gbnf": json_grammar(array_root=True),
    "list.gbnf": rep(seq(lit("- "), rep(char(lambda c: c not in "\r\n\x0b\x0c\x85\u2028\u2029"), 1), lit("\n")), 1),
}

SAMPLES = {  # a text each grammar accepts and one it does not (the checkers are checked too)
    "arithmetic.gbnf": ("x*2 = (a+12*b)\n", "x = a+\n"),
    "c.gbnf": ("int main(){return 0;}", "int main(){return 0}"),
    "chess.gbnf": ("1. e4 e5\n2. Nf3 Nc6\n", "1. e4 e5\n"),
    "english.gbnf": ("Hello, world!", "Hello  world"),
    "japanese.gbnf": ("こんにちは 世界", "こんにちは world"),
    "json.gbnf": ('{"a": [1, 2.5e3, "x\\n"], "b": {"c": null}}', '{"a": 01}'),
    "json_arr.gbnf": ('[\n{"a": true},\n"b"]', "[1]"),
    "list.gbnf": ("- one\n- two\n", "- one\n-two\n"),
}


def status(name: str, text: str) -> str:
    m = Match(text)
    ends = m.run(CHECKERS[name], 0)
    return "complete" if len(text) in ends else "prefix" if m.out_of_text else "invalid"


def test_the_recording_holds_llama_cpps_grammars():
    assert set(GRAMMARS) == set(CHECKERS) and len(GRAMMARS) == 8


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_every_llama_cpp_grammar_parses_and_agrees_with_its_checker(model, name):
    grammar = Grammar(GRAMMARS[name], model.vocab)
    good, bad = SAMPLES[name]
    assert status(name, good) == "complete" and status(name, bad) != "complete"
    matcher = grammar.matcher()
    assert matcher.accepts_text(good) and not matcher.accepts_text(bad)
    assert grammar.describe().startswith("root ::= ") or "root ::= " in grammar.describe()


class Finisher(Sampler):
    """Steers a run to an end after `after` tokens: +80 on the end of generation, +50 on the
    tokens of the current stage (the next stage once one of them is taken; the last stays). The grammar still
    decides which of them may come; the test only makes the texts end within a few dozen tokens."""
    name = "finisher"

    def __init__(self, stages: list[set[int]], eog: set[int], after: int) -> None:
        self.stages, self.eog, self.after, self.n, self.stage = stages, eog, after, 0, 0

    def apply(self, cur) -> None:
        if self.n >= self.after:
            stage = list(self.stages[self.stage]) if self.stages else []
            boost = np.where(np.isin(cur.ids, list(self.eog)), 80, np.where(np.isin(cur.ids, stage), 50, 0))
            cur.logits = (cur.logits + boost).astype(np.float32)
            cur.sorted = False

    def accept(self, token: int) -> None:
        if self.n >= self.after and self.stage < len(self.stages) - 1 and token in self.stages[self.stage]:
            self.stage += 1
        self.n += 1


FINISH = {"arithmetic.gbnf": ["=", "1", "\n"], "c.gbnf": ["( ) { } ;"], "chess.gbnf": ["\n"], "english.gbnf": [],
          "japanese.gbnf": [], "json.gbnf": ['" } ]'], "json_arr.gbnf": ['" } ]'], "list.gbnf": ["\n"]}


def _check_run(model, name: str, done) -> str:
    pieces = b"".join(model.vocab.token_to_piece(t, True) for t in done.tokens)
    text = codecs.getincrementaldecoder("utf-8")().decode(pieces, final=done.finish_reason == "stop")  # a cut run
    verdict = status(name, text)  # may end inside a character
    if done.finish_reason == "stop":
        assert verdict == "complete", text
        if name.startswith("json"):
            json.loads(text)
    else:
        assert verdict in ("prefix", "complete"), text
    return verdict


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_sampled_texts_are_texts_of_the_grammar(model, name):
    """Seeded sampling at temperature 0.9 from stories260K: a run cut at 40 tokens is the start
    of a text of the grammar; a run steered to an end after 16 tokens is a whole text of it."""
    vocab = model.vocab
    for seed in (1, 2):
        free = llamapy.generate(model, "Once upon a time", 40, grammar=GRAMMARS[name], temperature=0.9, seed=seed,
                                details=True)
        assert len(free.tokens) > 8
        _check_run(model, name, free)
        stages = [{vocab.tokenize(w, add_special=False, space_prefix=False)[-1] for w in stage.split(" ")}
                  for stage in FINISH[name]]
        chain = SamplerChain([Finisher(stages, set(vocab.eog_ids), 16), TopK(40), TopP(0.95), MinP(0.05), Temp(0.9),
                              Dist(seed)])
        steered = llamapy.generate(model, "Once upon a time", 64, grammar=GRAMMARS[name], sampler=chain, details=True)
        assert steered.finish_reason == "stop" and _check_run(model, name, steered) == "complete"


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_greedy_text_is_llama_completions(model, name):
    text = llamapy.generate(model, DATA["prompt"], DATA["n_predict"], grammar=GRAMMARS[name], temperature=0)
    assert text == DATA["greedy"][name]


def test_json_schema_greedy_text_is_llama_completions(model):
    text = llamapy.generate(model, DATA["prompt"], DATA["n_predict"], json_schema=DATA["schema"], temperature=0)
    assert text == DATA["schema_greedy"]


@pytest.mark.parametrize("name", ["json.gbnf", "c.gbnf", "japanese.gbnf", "arithmetic.gbnf"])
def test_the_vocabulary_mask_is_the_token_by_token_check(model, name):
    """The mask over the vocabulary (a trie walked level by level) allows exactly the tokens
    the one-token check allows, along a random walk through the grammar."""
    grammar = compile_grammar(GRAMMARS[name], model.vocab)
    matcher = grammar.matcher()
    rng = np.random.default_rng(0)
    for _ in range(12):
        mask = matcher.allowed()
        one_by_one = np.array([matcher.allows(t) for t in range(model.vocab.n_tokens)])
        assert np.array_equal(mask, one_by_one)
        choices = [t for t in np.flatnonzero(mask) if not model.vocab.is_eog(int(t))]
        if not choices:
            break
        matcher.accept(int(rng.choice(choices)))


@pytest.mark.slow
def test_the_mask_on_gemmas_vocabulary(gemma3_path):
    """262k tokens with multi-byte pieces: the mask agrees with the one-token check on a sample
    of the tokens it allows and of the others."""
    vocab = llamapy.load_model(gemma3_path).vocab
    grammar = Grammar(GRAMMARS["japanese.gbnf"], vocab)
    matcher = grammar.matcher()
    rng = np.random.default_rng(1)
    for _ in range(3):
        mask = matcher.allowed()
        allowed = np.flatnonzero(mask)
        sample = np.union1d(rng.choice(allowed, min(len(allowed), 2000), replace=False),
                            rng.choice(vocab.n_tokens, 2000, replace=False))
        assert all(mask[t] == matcher.allows(int(t)) for t in sample)
        matcher.accept(int(rng.choice([t for t in np.flatnonzero(mask) if not vocab.is_eog(int(t))])))


# ---- the rules, one by one ----------------------------------------------------------------------
@pytest.mark.parametrize("gbnf, accepted, rejected", [
    ('root ::= "a"{2,3} "b"{2}', ["aabb", "aaabb"], ["abb", "aaaabb", "aab"]),
    ('root ::= [a-c]{1,} "."?', ["a", "abc.", "cc"], ["", "d", "a.."]),
    ('root ::= [^a-c\\n]+', ["xyz", "é"], ["xaz", "x\ny"]),
    ('root ::= . "!"', ["a!", "日!"], ["!", "ab!"]),
    ('root ::= "\\u00e9" [\\x41-\\x42] "\\U0001F600"', ["éA😀", "éB😀"], ["eA😀", "éC😀"]),
    ('root ::= x | y\nx ::= "a" x?\ny ::= ("b" | "c")*', ["a", "aaa", "", "bcb"], ["ab", "d"]),
    ('root ::= [ab]{0,2} # a comment\n', ["", "ab", "bb"], ["aba"]),
])
def test_repetitions_classes_and_escapes(model, gbnf, accepted, rejected):
    matcher = Grammar(gbnf, model.vocab).matcher()
    assert [matcher.accepts_text(t) for t in accepted] == [True] * len(accepted)
    assert [matcher.accepts_text(t) for t in rejected] == [False] * len(rejected)


def test_a_character_split_across_byte_tokens(model):
    """é as two byte tokens (stories260K's byte fallback): the first is allowed as the start
    of a character the grammar accepts, the second completes it; é's own token is allowed too."""
    vocab = model.vocab
    byte = {vocab.token_to_piece(t, True): t for t in range(vocab.n_tokens) if vocab.token_type(t) == 6}
    lead, tail = byte[b"\xc3"], byte[b"\xa9"]
    whole = vocab.tokenize("é", add_special=False, space_prefix=False)[-1]
    matcher = Grammar('root ::= "é" "!"', vocab).matcher()
    assert matcher.allows(lead) and matcher.allows(whole) and not matcher.allows(tail)
    matcher.accept(lead)
    assert matcher.partial != (0, 0) and np.flatnonzero(matcher.allowed()).tolist() == [tail]
    matcher.accept(tail)
    assert matcher.allows(vocab.tokenize("!", add_special=False, space_prefix=False)[-1]) and not matcher.complete
    other = Grammar('root ::= "ü"', vocab).matcher()  # ü starts with the same byte, then another
    other.accept(lead)
    assert not other.allows(tail) and other.allows(byte[b"\xbc"])


def test_token_elements_and_the_end_of_generation(model):
    vocab = model.vocab
    eos = vocab.eos_id
    the = vocab.tokenize(" the", add_special=False, space_prefix=False)[0]
    matcher = Grammar(f'root ::= <[{the}]> !<[{the}]>', vocab).matcher()
    assert np.flatnonzero(matcher.allowed()).tolist() == [the] and not matcher.allows(eos)
    matcher.accept(the)
    allowed = matcher.allowed()
    assert not allowed[the] and allowed.sum() > 300 and not allowed[eos]
    matcher.accept(the + 1)
    assert matcher.complete and np.flatnonzero(matcher.allowed()).tolist() == sorted(vocab.eog_ids)
    named = Grammar("root ::= <s> \"x\"", vocab).matcher()  # a token by its text
    assert np.flatnonzero(named.allowed()).tolist() == [vocab.bos_id]


@pytest.mark.parametrize("gbnf, message", [
    ('root ::= "a" (', "line 1, column 15"),
    ('root ::= "a"\nx ::= [a-', "line 2, column 10"),
    ('root ::= x', "'x' is used but never defined"),
    ('start ::= "a"', "no rule named 'root'"),
    ('root ::= root "a" | "b"', "left recursion in rule 'root'"),
    ('root ::= "a"{5,3}', "maximum below its minimum"),
    ('root ::= "a"{3001}', "more than 2000"),
    ('root ::= ("a" "b"){100}{100}', "more than 2000 rules"),
    ('root ::= "\\q"', "unknown escape at line 1, column 11"),
    ('root ::= <[99999]>', "outside the vocabulary"),
    ("", "empty"),
])
def test_bad_grammars_are_one_line_naming_the_place(model, gbnf, message):
    with pytest.raises(GrammarError) as bad:
        Grammar(gbnf, model.vocab)
    assert message in str(bad.value) and "\n" not in str(bad.value)


# ---- sampling ----------------------------------------------------------------------------------
def test_the_sampled_token_is_checked_first_and_the_mask_made_only_if_it_fails(model):
    vocab = model.vocab
    the, was = (vocab.tokenize(w, add_special=False, space_prefix=False)[0] for w in (" the", " was"))
    chain = GrammarChain(SamplerChain([Greedy()]), GrammarConstraint(Grammar('root ::= " the" | " was"', vocab)))
    logits = np.zeros(vocab.n_tokens, np.float32)
    logits[the] = 5.0
    assert chain.sample_logits(logits) == the and chain.n_resampled == 0
    chain.reset()
    logits[[the, was, 7]] = [1.0, 2.0, 9.0]
    assert chain.sample_logits(logits) == was and chain.n_resampled == 1
    assert chain.constraint.matcher.complete


def test_a_grammar_ends_the_text_when_complete(model):
    done = llamapy.generate(model, "Once upon a time", 20, grammar='root ::= " there was" (" a" | " one")',
                            temperature=0.8, seed=5, details=True)
    assert done.text in (" there was a", " there was one") and done.finish_reason == "stop"


def test_a_lazy_grammar_waits_for_its_trigger(model):
    vocab = model.vocab
    grammar = compile_grammar('root ::= " said" [a-z ,.]*', vocab)
    constraint = GrammarConstraint(grammar, lazy=True, triggers=[GrammarTrigger(type="word", value=" said")])
    tokens = vocab.tokenize("Lily was happy. Lily said yes", add_special=False)
    digit = vocab.tokenize("7", add_special=False, space_prefix=False)[-1]
    said = vocab.tokenize(" said", add_special=False, space_prefix=False)[0]
    trigger_at = tokens.index(said)
    for t in tokens[:trigger_at]:
        constraint.accept(t)
        assert constraint.awaiting and constraint.allows(digit)  # nothing is constrained yet
    for t in tokens[trigger_at:]:
        constraint.accept(t)
    assert not constraint.awaiting and not constraint.allows(digit)
    assert constraint.matcher.allows(vocab.tokenize(" and", add_special=False, space_prefix=False)[0])
    # a pattern's first group is where the grammar starts; a token trigger starts it at once
    by_group = GrammarConstraint(compile_grammar('root ::= "said" [a-z ]*', vocab), lazy=True,
                                 triggers=[GrammarTrigger(type="pattern", value="Lily (said)")])
    for t in tokens:
        by_group.accept(t)
    assert not by_group.awaiting and by_group.matcher.complete
    by_token = GrammarConstraint(grammar, lazy=True, triggers=[GrammarTrigger(type="token", token=said)])
    by_token.accept(tokens[0])
    assert by_token.awaiting
    by_token.accept(said)
    assert not by_token.awaiting and by_token.matcher.complete
    with pytest.raises(GrammarError, match="needs at least one trigger"):
        GrammarConstraint(grammar, lazy=True)


def test_a_lazy_grammar_in_generation(model):
    """Free text until the trigger word, the grammar's text from it on."""
    done = llamapy.generate(model, "Once upon a time", 40, grammar='root ::= " was" [a-z ]+ "."', grammar_lazy=True,
                            grammar_triggers=[" was"], temperature=0.8, seed=2, details=True)
    head, _, tail = done.text.partition(" was")
    assert _ and done.finish_reason == "stop" and tail.endswith(".") and all(c.islower() or c == " " for c in tail[:-1])


# ---- llamapy-cli ---------------------------------------------------------------------------------
def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        cli_tool.main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_grammar_and_json_schema_flags(stories_path, tmp_path, capsys):
    grammar = tmp_path / "yes.gbnf"
    grammar.write_text('root ::= " yes" | " no"\n')
    code, out, _ = run_cli(capsys, "-m", str(stories_path), "-p", "Once", "-n", "8", "--temp", "0",
                           "--grammar-file", str(grammar), "--no-display-prompt")
    assert code == 0 and out.strip() in ("yes", "no")
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    code, out, _ = run_cli(capsys, "-m", str(stories_path), "-p", "Once", "-n", "80", "-s", "3", "-j", schema,
                           "--no-display-prompt")
    assert code == 0 and json.loads(out)["ok"] in (True, False)


@pytest.mark.parametrize("argv, message", [
    (["--grammar", 'root ::= "a" ('], "error: --grammar: expecting ')'"),
    (["-j", '{"type": "integer", "minimum": "x"}'], "error: -j: JSON schema error at #: minimum must be a number"),
    (["-j", "{"], "error: -j: JSON schema: not valid JSON"),
    (["--grammar", 'root ::= "a"', "-j", "{}"], "give one grammar or JSON schema, not --grammar and -j"),
])
def test_cli_bad_grammars_and_schemas_are_one_line(stories_path, capsys, argv, message):
    code, _, err = run_cli(capsys, "-m", str(stories_path), "-p", "Once", "-n", "4", *argv)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code != 0 and len(errors) == 1 and message in errors[0] and "Traceback" not in err, err
