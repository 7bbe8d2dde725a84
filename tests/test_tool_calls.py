"""Tool calls (llamapy/tool_calls): each shipped template that declares tools is matched to its
call syntax; conversations with tools, calls and results render as llama-server renders them
(tests/data/llama_server_tool_templates.json, recorded by tests/record_tool_templates.py);
a reply's calls are parsed back; and llamapy-server answers a request with two tools with a
call (forced by the calls' grammar: stories260K knows no tools), whole and streamed."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llamapy.chat import ChatTemplate
from llamapy.errors import InputError
from llamapy.sampling.grammar import Grammar
from llamapy.tool_calls import CallStream, SYNTAXES, Tool, ToolUse, syntax_for, template_messages
from llamapy.tool_calls.messages import writes_object_arguments

from conftest import shared_path

RECORDED = json.loads((Path(__file__).parent / "data" / "llama_server_tool_templates.json").read_text("utf-8"))
TOOLS = RECORDED["tools"]
SYNTAX_OF = {"qwen2.5": "hermes", "qwen3": "hermes", "llama3.2": "llama3-json", "mistral-nemo": "mistral"}
WITHOUT_TOOLS = ["HuggingFaceTB-SmolLM3-3B.jinja", "microsoft-Phi-3.5-mini-instruct.jinja", "google-gemma-2-2b-it.jinja"]
DATE = re.compile(r"Today Date: \d\d \w{3} \d{4}")  # Llama 3.2's template writes the day it renders


def template(name: str, vocab=None) -> ChatTemplate:
    return ChatTemplate.from_file(shared_path("data", "chat_templates", RECORDED["templates"][name]["template"]), vocab)


@pytest.mark.parametrize("name", list(SYNTAX_OF))
def test_each_tool_template_has_its_syntax(name):
    assert syntax_for(template(name).source).name == SYNTAX_OF[name]


@pytest.mark.parametrize("file", WITHOUT_TOOLS)
def test_templates_without_tools_have_none(file):
    assert syntax_for(shared_path("data", "chat_templates", file).read_text()) is None


@pytest.mark.parametrize("name", list(SYNTAX_OF))
def test_conversations_with_tools_render_as_llama_server_renders_them(name, stories):
    """Every recorded conversation (a question, calls with OpenAI's string arguments, results,
    the turn after): the same prompt, or a refusal where llama-server refused."""
    from llamapy.server.prompts import rendered_chat
    tpl = template(name, stories.vocab)
    assert writes_object_arguments(tpl)
    for messages, want in zip(RECORDED["conversations"], RECORDED["templates"][name]["renderings"]):
        normalised = template_messages(messages, writes_object_arguments(tpl))
        if "prompt" in want:
            got = rendered_chat(tpl, stories.vocab, normalised, TOOLS)
            assert DATE.sub("", got) == DATE.sub("", want["prompt"])
        else:
            with pytest.raises(InputError, match="only supports single tool-calls"):
                rendered_chat(tpl, stories.vocab, normalised, TOOLS)


@pytest.fixture(scope="module")
def stories(stories_path):
    import llamapy
    return llamapy.load_model(stories_path)


def tools() -> list[Tool]:
    return [Tool.model_validate(t) for t in TOOLS]


# ---- parsing -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SYNTAX_OF))
def test_the_calls_a_template_writes_parse_back_and_fit_the_grammar(name, stories):
    """The assistant turn llama-server rendered for a call, cut from the recorded prompt, parses
    to that call, and the calls' grammar accepts it."""
    syntax = syntax_for(template(name).source)
    prompt = RECORDED["templates"][name]["renderings"][2]["prompt"]
    turn = prompt[prompt.index(syntax.opener, prompt.index(RECORDED["conversations"][0][0]["content"])):]
    turn = turn[:min(i for i in (turn.find(e) for e in ("<|im_end|>", "<|eot_id|>", "</s>")) if i >= 0)]
    reply = syntax.parse(turn)
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [("get_weather", {"city": "Paris"})]
    assert reply.content.strip() == ""
    if name == "mistral-nemo":
        assert reply.calls[0].id == "Call00001"
    grammar = Grammar(syntax.grammar(tools(), syntax.parallel), stories.vocab)
    assert grammar.matcher().accepts_text(turn)
    assert not grammar.matcher().accepts_text(turn.replace("get_weather", "get_wether"))


def test_hermes_words_then_two_calls():
    hermes = next(s for s in SYNTAXES if s.name == "hermes")
    reply = hermes.parse('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                         '</tool_call>\n<tool_call>{"name":"get_time","arguments":{"city":"Rome"}}</tool_call>')
    assert reply.content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [("get_weather", {"city": "Paris"}),
                                                                        ("get_time", {"city": "Rome"})]
    assert len({c.id for c in reply.calls}) == 2 and all(len(c.id) == 32 for c in reply.calls)


@pytest.mark.parametrize("text", ["no call at all", "<tool_call>\n{not json}\n</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>"])
def test_what_is_not_a_call_stays_words(text):
    hermes = next(s for s in SYNTAXES if s.name == "hermes")
    assert hermes.parse(text).calls == [] and hermes.parse(text).content == text


def test_llama3_and_mistral_replies():
    llama3, mistral = (next(s for s in SYNTAXES if s.name == n) for n in ("llama3-json", "mistral"))
    assert llama3.parse(' {"name": "get_time", "parameters": {"city": "Oslo"}}').calls[0].arguments == '{"city": "Oslo"}'
    assert llama3.parse('The answer is {"name": "x"}').calls == []
    reply = mistral.parse('[TOOL_CALLS][{"name": "get_time", "arguments": {"city": "Oslo"}, "id": "abcDEF123"}]')
    assert [(c.name, c.id) for c in reply.calls] == [("get_time", "abcDEF123")]


def test_a_stream_sends_words_at_once_and_holds_a_call():
    hermes = next(s for s in SYNTAXES if s.name == "hermes")
    stream = CallStream(hermes)
    pieces = ["Sure", ". <to", "ol_c", 'all>\n{"name": "get_time", "arguments": {"city": "Rome"}}', "\n</tool_call>"]
    assert [stream.feed(p) for p in pieces] == ["Sure", ". ", "", "", ""]
    end = stream.finish()
    assert end.content == "" and [c.name for c in end.calls] == ["get_time"]
    words = CallStream(hermes)
    assert "".join(words.feed(p) for p in ["a <", "b> <tool", " c"]) + words.finish().content == "a <b> <tool c"


def test_tool_choice_and_tools_are_checked():
    hermes = SYNTAXES[0]
    with pytest.raises(InputError, match="not one of the tools"):
        ToolUse.of(tools(), {"type": "function", "function": {"name": "nope"}}, None, hermes, "t")
    with pytest.raises(InputError, match="does not take tools"):
        ToolUse.of(tools(), "auto", None, None, "chat template x")
    with pytest.raises(InputError, match="same name"):
        ToolUse.of(tools() + tools()[:1], "auto", None, hermes, "t")
    named = ToolUse.of(tools(), {"type": "function", "function": {"name": "get_time"}}, None, hermes, "t")
    assert named.mode == "required" and [t.name for t in named.tools] == ["get_time"]
    assert ToolUse.of(tools(), "auto", None, hermes, "t").constraint()["grammar_lazy"] is True
    assert ToolUse.of(tools(), "none", None, hermes, "t").constraint() == {}


# ---- the server ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(stories):
    import llamapy
    from llamapy.server.engine import Engine
    engine = Engine(llamapy.Context(stories, n_ctx=2048, n_seq_max=1))
    engine.start()
    yield engine
    engine.stop()


def client_for(engine, name: str):
    from starlette.testclient import TestClient

    from llamapy.server.adapters import Adapters
    from llamapy.server.app import Server, create_app
    server = Server(engine, template(name, engine.vocab), "stories", Adapters(engine, [], None))
    return TestClient(create_app(server))


def streamed(client, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        return [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]


def check_call(call: dict, names: set[str]) -> dict:
    assert call["type"] == "function" and call["function"]["name"] in names and call["id"]
    arguments = json.loads(call["function"]["arguments"])
    assert isinstance(arguments, dict) and isinstance(arguments["city"], str)
    return arguments


@pytest.mark.parametrize("name", list(SYNTAX_OF))
def test_the_server_answers_with_a_call_whole_and_streamed(engine, name):
    """Two tools, a call required (the grammar writes it), greedy: a parsed call with valid
    arguments, finish_reason tool_calls; the stream's deltas add up to the same call; the
    next turn, with the call and its result, renders as llama-server renders it."""
    body = {"messages": [RECORDED["conversations"][0][0]], "tools": TOOLS, "tool_choice": "required",
            "temperature": 0, "max_tokens": 120}
    with client_for(engine, name) as client:
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        call = choice["message"]["tool_calls"][0]
        arguments = check_call(call, {"get_weather", "get_time"})

        chunks = streamed(client, body)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
        assert calls[0]["index"] == 0 and calls[0]["function"] == call["function"]
        assert "".join(d.get("content") or "" for d in deltas) == ""

        named = client.post("/v1/chat/completions", json={**body, "tool_choice": {
            "type": "function", "function": {"name": "get_time"}}}).json()["choices"][0]["message"]
        check_call(named["tool_calls"][0], {"get_time"})

        fixed = {**call, "id": "Call00001", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
        turn = RECORDED["conversations"][2]
        rendered = client.post("/apply-template", json={"messages": [turn[0], {"role": "assistant", "tool_calls": [fixed]},
                                                                       turn[2]], "tools": TOOLS}).json()["prompt"]
        assert DATE.sub("", rendered) == DATE.sub("", RECORDED["templates"][name]["renderings"][2]["prompt"])
        assert arguments is not None


def test_bad_tool_requests_are_400s(engine):
    with client_for(engine, "qwen2.5") as client:
        ask = lambda **extra: client.post("/v1/chat/completions", json={  # noqa: E731
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra})
        assert "not one of the tools" in ask(tools=TOOLS, tool_choice={"type": "function", "function": {
            "name": "nope"}}).json()["error"]["message"]
        assert "not both" in ask(tools=TOOLS, grammar='root ::= "a"').json()["error"]["message"]
        assert ask(tools=[{"type": "function", "function": {"name": "bad name!"}}]).status_code == 400
        assert "tool_choice needs tools" in ask(tool_choice="required").json()["error"]["message"]
        assert ask(tools=TOOLS, tool_choice="none").status_code == 200
    from llamapy.server.engine import Engine  # noqa: F401  (a template without tools refuses them)
    from starlette.testclient import TestClient

    from llamapy.server.adapters import Adapters
    from llamapy.server.app import Server, create_app
    server = Server(engine, ChatTemplate.named("chatml", engine.vocab), "stories", Adapters(engine, [], None))
    with TestClient(create_app(server)) as client:
        reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
        assert reply.status_code == 400 and "does not take tools" in reply.json()["error"]["message"]
