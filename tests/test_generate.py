"""llamapy.generate: the library's generation loop and the calls over it.

Fast (stories260K): llama-completion's greedy text from `llamapy.generate` and from
`llamapy.chat_completion` (through a template that writes the message as it is), streaming
equal to the whole, stop strings (dropped, and held back only while they could still
begin), max_tokens, the KV cache prefix kept between calls (llama_perf's counters),
LoRA adapters (as attached by hand and as merged into the weights; a change of adapters
is not served from the cache), several prompts at once, and one-line errors.

Slow (Gemma 3 270M Q4_K_M): the same greedy texts as llama-completion's
(tests/data/llama_cpp_gemma3_greedy.json), by generate() and by the chat call.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import llamapy
from conftest import REPO_ROOT, shared_path
from ggmlpy import GGMLType
from llamapy.errors import InputError
from llamapy.generate import Generator, TextRun, cached_generator, default_n_ctx, forget, generate_batch, token_text
from llamapy.lora import LoraAdapter, merge_adapters
from llamapy.sampling import Greedy, SamplerChain

PROMPT = "Once upon a time"
VERBATIM = "{% for message in messages %}{{ message['content'] }}{% endfor %}"  # a template that adds nothing


@pytest.fixture(scope="module")
def model(stories_path):
    return llamapy.load_model(stories_path)


@pytest.fixture(scope="module")
def golden(model) -> str:
    """llama-completion's 64 greedy tokens after PROMPT: the golden file without its echo of the prompt."""
    text = shared_path("golden", "greedy_stories260K.txt").read_text(encoding="utf-8").rstrip("\n")
    echo = token_text(model.vocab, model.vocab.tokenize(PROMPT, add_special=True))
    assert text.startswith(echo)
    return text[len(echo):]


@pytest.fixture
def verbatim(tmp_path):
    path = tmp_path / "verbatim.jinja"
    path.write_text(VERBATIM)
    return path


def greedy(model, prompt=PROMPT, **kw):
    return llamapy.generate(model, prompt, kw.pop("max_tokens", 64), temperature=0, **kw)


# ---- llama.cpp's text ---------------------------------------------------------------------------
def test_generate_gives_llama_completions_greedy_text(model, stories_path, golden):
    assert greedy(model) == golden
    assert greedy(stories_path) == golden  # a path works too (loaded once, kept while it is the last one)
    assert cached_generator(stories_path).ctx.n_ctx == default_n_ctx(model) == min(model.hparams.n_ctx_train, 4096)


def test_chat_completion_gives_the_same_text(model, golden, verbatim):
    messages = [{"role": "user", "content": PROMPT}]
    answer = llamapy.chat_completion(model, messages, 64, temperature=0, chat_template=verbatim)
    assert answer == {"role": "assistant", "content": golden}


def test_chat_completion_is_generation_over_the_rendered_conversation(model):
    from llamapy.chat import ChatTemplate
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A cat?"}]
    tokens, _ = ChatTemplate.for_model(model)[0].tokenize(model.vocab, messages, add_generation_prompt=True)
    expected = greedy(model, tokens, max_tokens=12)
    assert llamapy.chat_completion(model, messages, 12, temperature=0)["content"] == expected
    deltas = list(llamapy.chat_completion(model, messages, 12, temperature=0, stream=True))
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(set(d) == {"content"} and d["content"] for d in deltas[1:])
    assert "".join(d["content"] for d in deltas) == expected


def test_streaming_gives_the_same_text(model, golden):
    stream = greedy(model, stream=True)
    assert stream.finish_reason is None
    pieces = list(stream)
    assert len(pieces) > 32 and "".join(pieces) == golden
    assert stream.finish_reason == "length"


def test_sampled_generation_is_reproducible_for_a_seed(model):
    a = llamapy.generate(model, PROMPT, 24, seed=7, temperature=0.9, top_k=20)
    assert a == llamapy.generate(model, PROMPT, 24, seed=7, temp=0.9, top_k=20)
    assert a != llamapy.generate(model, PROMPT, 24, seed=8, temp=0.9, top_k=20)
    chain = SamplerChain([Greedy()])
    assert llamapy.generate(model, PROMPT, 24, sampler=chain) == greedy(model, max_tokens=24)
    # the chain in the graph (-bs) samples the same tokens
    assert llamapy.generate(model, PROMPT, 24, seed=7, temp=0.9, top_k=20, backend_sampling=True) == a


# ---- stop strings and limits ------------------------------------------------------------------------
def test_a_stop_string_ends_generation_and_is_not_returned(model, golden):
    assert greedy(model, stop="ball") == golden[:golden.index("ball")]
    assert cached_generator(model).finish_reason == "stop"
    # the first of several, wherever it starts: "little girl" spans tokens
    assert greedy(model, stop=["She wanted", "little girl"]) == golden[:golden.index("little girl")]


def test_text_that_could_begin_a_stop_string_is_held_back_only_until_it_cannot(model, golden):
    gen = Generator(model, temperature=0)
    gen.feed(gen.tokenize(PROMPT))
    pieces = list(gen.stream(64, stop=["girl named Bob"]))  # begins at "girl named L..." but never matches
    assert "".join(p.text for p in pieces) == golden and gen.finish_reason == "length"
    released, n_tokens = "", 0
    for p in pieces:  # after each piece, what is not released yet is a start of the stop string
        released, n_tokens = released + p.text, n_tokens + (p.token is not None)
        so_far = token_text(model.vocab, gen.tokens[:n_tokens])
        assert so_far.startswith(released)
        held = so_far[len(released):]
        assert held == "" or "girl named Bob".startswith(held), (released, held)
    assert any(p.text == "" for p in pieces)  # " named" waited for " Lily"


class FakeVocab:
    """Tokens whose pieces are given bytes; token 0 ends generation."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def is_eog(self, token: int) -> bool:
        return token == 0

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        return self.pieces[token]


def run(pieces: list[bytes], tokens: list[int], stops=(), max_tokens=-1) -> tuple[list[str], str | None]:
    r = TextRun(FakeVocab(pieces), max_tokens, tuple(stops))
    out = []
    for t in tokens:
        out.append(r.push(t))
        if r.finish_reason:
            break
    else:
        out.append(r.end("length"))
    return out, r.finish_reason


def test_run_rules_on_split_characters_and_stop_strings():
    euro = "€".encode()  # 3 bytes, split over two tokens
    pieces = [b"", b"ab", b"c" + euro[:2], euro[2:] + b" d", b"END", b"x"]
    assert run(pieces, [1, 2, 3, 5]) == (["ab", "c", "€ d", "x", ""], "length")  # the character waits for its last byte
    assert run(pieces, [1, 2, 3, 0]) == (["ab", "c", "€ d", ""], "stop")  # end-of-generation: not returned
    assert run(pieces, [1, 2, 3, 5], max_tokens=2) == (["ab", "c\ufffd"], "length")  # cut inside a character
    assert run(pieces, [1, 2, 3], stops=["c€"]) == (["ab", "", ""], "stop")  # stop across tokens, inside a character
    assert run(pieces, [1, 2, 3, 4, 5], stops=["€ dX"]) == (["ab", "c", "", "€ dEND", "x", ""], "length")
    assert run(pieces, [1, 4, 5], stops=["bEN"]) == (["a", ""], "stop")
    assert run(pieces, [1, 1, 0], stops=["bz"]) == (["a", "ba", "b"], "stop")  # held text is released at the end


def test_split_character_at_the_limit_is_not_lost():
    euro = "€".encode()
    out, reason = run([b"", euro[:2], euro[2:]], [1], max_tokens=1)
    assert reason == "length" and out == ["\ufffd"]  # an incomplete character shows as U+FFFD


def test_max_tokens(model, golden):
    five = greedy(model, max_tokens=5)
    gen = cached_generator(model)
    assert len(gen.tokens) == 5 and gen.finish_reason == "length" and golden.startswith(five)
    assert greedy(model, max_tokens=0) == "" and gen.finish_reason == "length"


def test_a_full_context_ends_generation(model, golden):
    gen = Generator(llamapy.Context(model, n_ctx=16), temperature=0)
    assert gen(PROMPT) == token_text(model.vocab, gen.tokens)
    assert gen.finish_reason == "length" and gen.context_full
    assert len(gen.cached) == 16 and len(gen.tokens) == 16 - 5 + 1  # the last one sampled, not decoded
    assert golden.startswith(token_text(model.vocab, gen.tokens))


# ---- the KV cache between calls --------------------------------------------------------------------------
def test_a_second_call_decodes_only_what_the_cache_does_not_hold(model):
    forget(model)
    first = greedy(model, max_tokens=16)
    gen = cached_generator(model)
    held = list(gen.cached)
    n_prompt, ctx = gen.n_prompt, gen.ctx
    longer = model.vocab.tokenize(PROMPT + first + " The end.", add_special=True)
    common = next(i for i, (a, b) in enumerate(zip(longer, held + [-1])) if a != b)
    assert common >= len(held) - 2
    second = greedy(model, longer, max_tokens=16)
    assert cached_generator(model) is gen and gen.ctx is ctx  # the same Context
    assert gen.n_prompt - n_prompt == len(longer) - common  # only the new tokens were decoded
    fresh = Generator(llamapy.Context(model, n_ctx=256), temperature=0)
    assert fresh(longer, 16) == second
    # the same prompt again: one token decoded, for its logits
    n_prompt = gen.n_prompt
    assert greedy(model, longer, max_tokens=16) == second and gen.n_prompt - n_prompt == 1
    # a call needing a larger context gets a new one
    greedy(model, max_tokens=4, n_ctx=gen.ctx.n_ctx * 2)
    assert cached_generator(model) is not gen


def test_a_chats_next_turn_decodes_only_its_new_tokens(model):
    from llamapy.chat import ChatTemplate
    forget(model)
    messages = [{"role": "user", "content": "Tell me about a cat."}]
    answer = llamapy.chat_completion(model, messages, 12, temperature=0)
    gen = cached_generator(model)
    n_prompt = gen.n_prompt
    messages += [answer, {"role": "user", "content": "And then?"}]
    llamapy.chat_completion(model, messages, 12, temperature=0)
    whole, _ = ChatTemplate.for_model(model)[0].tokenize(model.vocab, messages, add_generation_prompt=True)
    assert 0 < gen.n_prompt - n_prompt < len(whole) // 2


def test_an_open_stream_ends_when_its_generator_is_fed_again(model):
    stream = greedy(model, stream=True)
    next(stream)
    greedy(model, "The dog", max_tokens=4)
    with pytest.raises(InputError, match="abandoned"):
        list(stream)


# ---- LoRA ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapter_file(model, tmp_path_factory):
    adapter = LoraAdapter.new(model, rank=4, seed=2)
    rng = np.random.default_rng(1)
    for _, b in adapter.tensors.values():
        b.array()[...] = rng.standard_normal(b.array().shape) * 0.3
    return adapter.save(tmp_path_factory.mktemp("lora") / "adapter.gguf")


def test_lora_changes_the_text_as_attaching_or_merging_it_does(model, stories_path, adapter_file):
    base = greedy(model, max_tokens=24)
    adapted = greedy(model, max_tokens=24, lora=[adapter_file])
    assert adapted != base
    # by hand: the adapter attached to a context of one's own
    ctx = llamapy.Context(model, n_ctx=256)
    ctx.attach_lora(LoraAdapter.load(adapter_file, model), 1.0)
    assert Generator(ctx, temperature=0)(PROMPT, 24) == adapted
    # merged into the weights (F32: no rounding to the file's types)
    merged = llamapy.load_model(stories_path)
    merge_adapters(merged, [(LoraAdapter.load(adapter_file, merged), 1.0)], GGMLType.F32)
    assert greedy(merged, max_tokens=24) == adapted
    # a scale, and back to no adapter: the cache of the adapted run is not reused
    assert greedy(model, max_tokens=24, lora=[(adapter_file, 0.0)]) == base
    assert greedy(model, max_tokens=24) == base
    assert greedy(model, max_tokens=24, lora=[adapter_file]) == adapted


def test_a_change_of_adapters_drops_the_cached_tokens(model, adapter_file):
    gen = Generator(model, temperature=0)
    gen(PROMPT, 4)
    gen.set_lora([adapter_file])
    n = gen.n_prompt
    gen(PROMPT, 4)
    assert gen.n_prompt - n == len(gen.tokenize(PROMPT))  # all decoded again
    n = gen.n_prompt
    gen.set_lora([adapter_file])  # the same file, already loaded: nothing changes
    gen(PROMPT, 4)
    assert gen.n_prompt - n == 1


# ---- several prompts at once ------------------------------------------------------------------------------
def test_generate_batch_equals_one_at_a_time(model, adapter_file):
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the", "One day", "Tim"]
    alone = [greedy(model, p, max_tokens=12, stop=".") for p in prompts]
    assert generate_batch(model, prompts, 12, n_seq=2, stop=".", temperature=0) == alone
    with_lora = [greedy(model, p, max_tokens=8, lora=[adapter_file]) for p in prompts[:2]]
    assert generate_batch(model, prompts[:2], 8, lora=[adapter_file], temperature=0) == with_lora


# ---- errors -------------------------------------------------------------------------------------------------
def test_bad_input_is_one_clear_error(model, stories_path):
    with pytest.raises(InputError, match="the prompt is empty and the model adds no BOS"):
        llamapy.generate(model, [])
    no_bos = llamapy.load_model(stories_path)
    no_bos.vocab.add_bos = False
    with pytest.raises(InputError, match="the prompt is empty and the model adds no BOS"):
        llamapy.generate(no_bos, "")
    long = "Once upon a time there was a cat. " * 20
    forget(no_bos)
    with pytest.raises(InputError, match=r"the prompt is \d+ tokens and the context holds 64 \(n_ctx, -c\)"):
        llamapy.generate(no_bos, long, n_ctx=64)  # a context of 64 (after forget(): the first of this model)
    with pytest.raises(InputError, match=r"the prompt is \d+ tokens and the context holds 64"):
        Generator(llamapy.Context(model, n_ctx=64))(long)
    with pytest.raises(InputError, match="feed"):
        next(Generator(model).stream(4))
    with pytest.raises(TypeError, match="unknown sampling option"):
        llamapy.generate(model, PROMPT, 4, temprature=0.5)
    with pytest.raises(TypeError, match="not both"):
        llamapy.generate(model, PROMPT, 4, sampler=SamplerChain([Greedy()]), top_k=3)
    with pytest.raises(InputError, match="no such file"):
        llamapy.generate(model, PROMPT, 4, lora=["missing.gguf"])


# ---- Gemma 3 270M (slow) ------------------------------------------------------------------------------------
GREEDY = json.loads((REPO_ROOT / "tests" / "data" / "llama_cpp_gemma3_greedy.json").read_text(encoding="utf-8"))


@pytest.mark.slow
def test_gemma3_greedy_text_matches_llama_cpp(gemma3_path, tmp_path):
    """The first recorded prompt, 64 tokens by generate() and 16 by the chat call (a template
    writing the message as it is): both continue it with llama-completion's text."""
    run0 = GREEDY["runs"][0]
    expected = run0["text"][len(run0["prompt"]):]
    model = llamapy.load_model(gemma3_path)
    assert llamapy.generate(model, run0["prompt"], GREEDY["n_predict"], temperature=0) == expected
    forget(model)  # decode the prompt anew (a one-token step rounds like a batch here, but keep it independent)
    template = tmp_path / "verbatim.jinja"
    template.write_text(VERBATIM)
    answer = llamapy.chat_completion(model, [{"role": "user", "content": run0["prompt"]}], 16, temperature=0,
                                     chat_template=template)
    assert len(answer["content"]) > 16 and expected.startswith(answer["content"])


@pytest.mark.slow
def test_gemma3_chat_answer_streams_and_stops_at_end_of_turn(gemma3_path):
    model = llamapy.load_model(gemma3_path)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    answer = llamapy.chat_completion(model, messages, 12, temperature=0)
    stream = llamapy.chat_completion(model, messages, 12, temperature=0, stream=True)
    assert "".join(d.get("content", "") for d in stream) == answer["content"]
    assert "<end_of_turn>" not in answer["content"] and stream.finish_reason in ("stop", "length")
