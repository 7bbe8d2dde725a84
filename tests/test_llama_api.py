"""llama-cpp-python's `Llama` over llamapy: the examples of llama-cpp-python's README run with
`from llamapy import Llama` and give, greedy, the texts llamapy's own API gives, in
llama-cpp-python's dict shapes."""
from __future__ import annotations

import json

import pytest

import llamapy
from llamapy import Llama
from llamapy.generate import forget

PROMPT = "Q: Name the planets in the solar system? A: "


@pytest.fixture(scope="module")
def llm(stories_path):
    return Llama(model_path=str(stories_path), n_ctx=256, seed=1337, verbose=False)


def test_the_public_api_is_listed():
    names = dir(llamapy)
    for name in ("Llama", "generate", "chat_completion", "Context", "save_model_to_file", "load_model", "new_model"):
        assert name in names
    assert "importlib" not in names and "sys" not in names


def test_readme_completion_example(llm, stories_path):
    # llama-cpp-python README, "High-level API": the call with max_tokens, stop and echo
    output = llm(PROMPT, max_tokens=32, stop=["Q:", "\n"], echo=True, temperature=0)
    assert output["object"] == "text_completion" and output["id"].startswith("cmpl-")
    assert output["model"] == str(stories_path)
    choice = output["choices"][0]
    own = llamapy.generate(llm._model, PROMPT, 32, stop=["Q:", "\n"], temperature=0)
    forget(llm._model)
    assert choice["text"] == PROMPT + own
    assert choice["index"] == 0 and choice["logprobs"] is None and choice["finish_reason"] in ("stop", "length")
    usage = output["usage"]
    assert usage["prompt_tokens"] == len(llm.tokenize(PROMPT.encode(), special=True))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 < usage["completion_tokens"] <= 32


def test_streaming_gives_the_same_text_in_chunks(llm):
    whole = llm("Once upon a time", max_tokens=24, temperature=0)["choices"][0]["text"]
    chunks = list(llm("Once upon a time", max_tokens=24, temperature=0, stream=True))
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_chat_completion_example(llm, stories_path):
    # llama-cpp-python README, "Chat Completion" (with chat_format given: stories260K has no template)
    chat = Llama(model_path=str(stories_path), chat_format="chatml", n_ctx=256, verbose=False)
    messages = [{"role": "system", "content": "You are an assistant who perfectly describes images."},
                {"role": "user", "content": "Describe this image in detail please."}]
    response = chat.create_chat_completion(messages=messages, max_tokens=16, temperature=0)
    assert response["object"] == "chat.completion" and response["id"].startswith("chatcmpl-")
    message = response["choices"][0]["message"]
    assert message["role"] == "assistant"
    own = llamapy.chat_completion(chat._model, messages, 16, chat_template="chatml", temperature=0)
    assert message["content"] == own["content"]
    deltas = list(chat.create_chat_completion(messages=messages, max_tokens=16, temperature=0, stream=True))
    assert deltas[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(d["choices"][0]["delta"].get("content", "") for d in deltas) == message["content"]
    assert deltas[-1]["choices"][0]["delta"] == {} and deltas[-1]["choices"][0]["finish_reason"] is not None


def test_tokenize_and_detokenize(llm):
    tokens = llm.tokenize(b"Hello, world!")
    vocab = llm._model.vocab
    assert tokens == vocab.tokenize("Hello, world!", add_special=True)
    assert llm.tokenize(b"Hello, world!", add_bos=False) == tokens[1:]
    assert llm.detokenize(tokens[1:]).decode().strip() == "Hello, world!"
    assert llm.n_vocab() == vocab.n_tokens and llm.token_bos() == vocab.bos_id and llm.n_ctx() == 256


def test_logprobs_match_the_sampled_tokens(llm):
    out = llm("Once upon a time", max_tokens=6, temperature=0, logprobs=3)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert logprob <= 0 and top[token] == logprob
        assert max(top.values()) == logprob  # greedy: the sampled token is the most likely
    assert "".join(lp["tokens"]) == out["choices"][0]["text"]
    assert lp["text_offset"][0] == len("Once upon a time")


def test_echo_with_logprobs_scores_the_prompt(llm):
    lp = llm("Once upon a time", max_tokens=2, temperature=0, logprobs=1, echo=True)["choices"][0]["logprobs"]
    n_prompt = len(llm.tokenize(b"Once upon a time", add_bos=False))
    assert len(lp["tokens"]) == n_prompt + 2
    assert lp["token_logprobs"][0] is None and all(v < 0 for v in lp["token_logprobs"][1:])


def test_a_seed_repeats_a_sampled_completion(stories_path):
    a = Llama(model_path=str(stories_path), n_ctx=128, seed=7, verbose=False)
    b = Llama(model_path=str(stories_path), n_ctx=128, seed=7, verbose=False)
    assert a("Once", max_tokens=12)["choices"][0]["text"] == b("Once", max_tokens=12)["choices"][0]["text"]


@pytest.mark.parametrize("kwargs, message", [
    ({"grammar": object()}, "grammar: give the GBNF text"),
    ({"suffix": "x"}, "fill-in-the-middle"),
    ({"mirostat_mode": 2}, "mirostat"),
])
def test_what_llamapy_lacks_is_refused_by_name(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm("Once", max_tokens=2, **kwargs)


def test_constructor_arguments(stories_path):
    Llama(model_path=str(stories_path), n_ctx=64, n_gpu_layers=-1, use_mmap=True, verbose=False)  # no effect on a CPU
    with pytest.raises(ValueError, match="fill-in-the-middle"):
        Llama(model_path=str(stories_path), spm_infill=True, verbose=False)
    with pytest.raises(TypeError, match="n_ctxx"):
        Llama(model_path=str(stories_path), n_ctxx=64, verbose=False)
    with pytest.raises(ValueError, match="chat_format"):
        Llama(model_path=str(stories_path), chat_format="no-such-format", verbose=False)


def test_generate_returns_usage_and_logprobs(stories_path):
    model = llamapy.load_model(stories_path)
    done = llamapy.generate(model, "Once upon a time", 8, temperature=0, logprobs=2)
    assert done.text == llamapy.generate(model, "Once upon a time", 8, temperature=0)
    assert done.usage == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    assert len(done.logprobs) == 8 and all(len(p.top) == 2 and p.top[0][0] == p.token for p in done.logprobs)


def test_generate_takes_mlx_lms_call_shape(stories_path):
    model = llamapy.load_model(stories_path)
    assert (llamapy.generate(model, model.vocab, "Once upon a time", temperature=0)
            == llamapy.generate(model, "Once upon a time", temperature=0))


def test_a_grammar_and_a_response_format_constrain_the_text(llm):
    """llama-cpp-python's `grammar` (GBNF text here) and `response_format` (JSON by a schema)."""
    out = llm("Once upon a time", max_tokens=8, temperature=0, grammar='root ::= ("yes" | "no") "."')
    assert out["choices"][0]["text"] in ("yes.", "no.")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    reply = llm.create_chat_completion([{"role": "user", "content": "Who are you?"}], max_tokens=80, temperature=0,
                                       response_format={"type": "json_object", "schema": schema})
    answer = json.loads(reply["choices"][0]["message"]["content"])
    assert set(answer) == {"name", "age"} and isinstance(answer["age"], int)
    with pytest.raises(ValueError, match="not both"):
        llm.create_chat_completion([{"role": "user", "content": "x"}], grammar='root ::= "a"',
                                   response_format={"type": "json_object"})


def test_tools_come_back_as_tool_calls(stories_path):
    """A chat with tools on a template that declares them (Qwen 2.5's, given to the Llama as a
    model file would): a required call, whole and streamed, parsed into OpenAI's tool_calls."""
    from llamapy.chat import ChatTemplate
    from conftest import shared_path
    llm = Llama(model_path=str(stories_path), n_ctx=1024, verbose=False)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
    llm._template = ChatTemplate.from_file(shared_path("data", "chat_templates", "Qwen-Qwen2.5-7B-Instruct.jinja"),
                                           llm._model.vocab)
    ask = dict(messages=[{"role": "user", "content": "What time is it in Oslo?"}], tools=tools,
               tool_choice="required", temperature=0, max_tokens=200)
    choice = llm.create_chat_completion(**ask)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_time" and isinstance(json.loads(call["function"]["arguments"])["city"], str)
    chunks = list(llm.create_chat_completion(**ask, stream=True))
    streamed = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert streamed[0]["function"] == call["function"] and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    with pytest.raises(ValueError, match="not one of the tools"):
        llm.create_chat_completion(**{**ask, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
