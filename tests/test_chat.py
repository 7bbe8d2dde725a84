"""llamapy.chat: chat templates rendered and tokenized as llama.cpp does, and the loss mask.

Token ids of 25 conversations are checked against llama.cpp's, recorded by
record_chat_templates.py (llama-server's /apply-template, then llama_tokenize with special
tokens parsed): Gemma 3's own template with Gemma 3 270M's vocabulary, and each of
llama.cpp's built-in templates written here (chatml, llama3, gemma, phi3, mistral-v7,
mistral-v7-tekken) with a vocabulary that has its special tokens.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from conftest import shared_path
from record_chat_templates import assistant, system, user
from llamapy.chat import NAMED_TEMPLATES, ChatTemplate
from llamapy.errors import InputError
from llamapy.gguf_file import GGUFFile, MetaValue, ValueType
from llamapy.model import load_model
from llamapy.vocab import Vocab

DATA = Path(__file__).parent / "data"
GEMMA3_TEMPLATE = DATA / "gemma3-chat-template.jinja"
REFERENCE = json.loads((DATA / "llama_cpp_chat_templates.json").read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def load_vocab(path: Path) -> Vocab:
    return Vocab.from_gguf(GGUFFile(path))


def shared_vocab(name: str) -> Vocab:
    return load_vocab(shared_path("data", "vocab", f"ggml-vocab-{name}.gguf"))


@pytest.fixture(scope="module")
def gemma_vocab(gemma3_path: Path) -> Vocab:
    return load_vocab(gemma3_path)


# Recorded template -> the shared vocabulary its ids use (None: Gemma 3 270M's).
VOCAB_OF = {"gemma3": None, "chatml": "qwen2", "llama3": "llama-bpe", "gemma": None, "phi3": "phi-3",
            "mistral-v7": "llama-spm", "mistral-v7-tekken": "llama-spm"}
# An assistant turn as the template writes it: text before the content (after the header),
# whether the content is trimmed, and the end-of-turn token.
TURN = {"gemma3": ("", True, "<end_of_turn>"), "chatml": ("", False, "<|im_end|>"), "llama3": ("", True, "<|eot_id|>"),
        "gemma": ("", True, "<end_of_turn>"), "phi3": ("", False, "<|end|>"), "mistral-v7": (" ", False, "</s>"),
        "mistral-v7-tekken": ("", False, "</s>")}


def template_and_vocab(name: str, request: pytest.FixtureRequest) -> tuple[ChatTemplate, Vocab]:
    vocab = request.getfixturevalue("gemma_vocab") if VOCAB_OF[name] is None else shared_vocab(VOCAB_OF[name])
    if name == "gemma3":
        return ChatTemplate.from_file(GEMMA3_TEMPLATE, vocab), vocab
    return ChatTemplate.named(name, vocab), vocab


def learned(vocab: Vocab, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The text of each run of masked tokens, special tokens written out."""
    runs, run = [], []
    for token, on in zip(ids.tolist(), mask.tolist()):
        if on:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return [vocab.detokenize(r, unparse_special=True) for r in runs]


# -- llama.cpp's ids -------------------------------------------------------------------


def test_reference_covers_the_required_cases() -> None:
    conversations = REFERENCE["conversations"]
    assert len(conversations) >= 20
    roles = [[m["role"] for m in c["messages"]] for c in conversations]
    assert any(r[0] == "system" for r in roles)
    assert any(r.count("assistant") >= 2 for r in roles)
    assert any(r[-1] == "user" and c["add_generation_prompt"] for r, c in zip(roles, conversations))
    assert any(m["content"] == "" for c in conversations for m in c["messages"])
    assert any(any(ord(ch) > 0x3000 for ch in m["content"]) for c in conversations for m in c["messages"])
    assert set(REFERENCE["templates"]) == set(VOCAB_OF) == {"gemma3", *NAMED_TEMPLATES}


@pytest.mark.parametrize("name", list(VOCAB_OF))
def test_token_ids_equal_llama_cpp(name: str, request: pytest.FixtureRequest) -> None:
    template, vocab = template_and_vocab(name, request)
    record = REFERENCE["templates"][name]
    for i, (conv, prompt, expected) in enumerate(zip(REFERENCE["conversations"], record["prompts"], record["ids"])):
        ids, mask = template.tokenize(vocab, conv["messages"], conv["add_generation_prompt"])
        text = template.render(conv["messages"], conv["add_generation_prompt"])
        assert ids.dtype == np.int32 and mask.dtype == bool and mask.shape == ids.shape
        assert " ".join(map(str, ids.tolist())) == expected, f"{name} conversation {i}: {text!r} vs {prompt!r}"


@pytest.mark.parametrize("name", list(VOCAB_OF))
def test_masks_of_the_reference_conversations(name: str, request: pytest.FixtureRequest) -> None:
    """Each assistant turn is learned as its content (trimmed where the template trims it) and
    its end-of-turn token. Only its first token may hold more: the end of the header it
    merges with (mistral's "[/INST]" + "```" gives "]```" in the Llama 2 vocabulary), a
    space prefix, or less: whitespace a special token strips (Phi-3's <|assistant|>)."""
    template, vocab = template_and_vocab(name, request)
    before, trims, marker = TURN[name]
    for i, conv in enumerate(REFERENCE["conversations"]):
        ids, mask = template.tokenize(vocab, conv["messages"], conv["add_generation_prompt"])
        runs = np.split(ids, np.flatnonzero(np.diff(mask.astype(np.int8))) + 1)[int(not mask[0])::2]
        turns = [m["content"] for m in conv["messages"] if m["role"] == "assistant"]
        assert len(runs) == len(turns), f"{name} conversation {i}"
        for run, content in zip(runs, turns):
            pieces = [vocab.token_to_piece(t, special=True) for t in run.tolist()]
            got = b"".join(pieces).decode()
            expected = before + (content.strip(" \t\n\v\f\r") if trims else content) + marker
            if not got.endswith(expected):
                expected = expected.lstrip(" \t\n\v\f\r")
            assert got.endswith(expected) and len(got) - len(expected) < len(pieces[0]), \
                f"{name} conversation {i}: {got!r} for {expected!r}"


def test_bos_is_not_doubled(gemma_vocab: Vocab) -> None:
    """Gemma 3's template writes <bos> and the vocabulary adds BOS: one BOS, as in llama.cpp."""
    template = ChatTemplate.from_file(GEMMA3_TEMPLATE, gemma_vocab)
    assert template.render([user("Hi")]).startswith("<bos><start_of_turn>user\n")
    ids, _ = template.tokenize(gemma_vocab, [user("Hi")])
    assert ids[0] == gemma_vocab.bos_id and ids[1] != gemma_vocab.bos_id
    # A template without <bos> gets the one the vocabulary adds.
    ids, _ = ChatTemplate.named("gemma", gemma_vocab).tokenize(gemma_vocab, [user("Hi")])
    assert ids[0] == gemma_vocab.bos_id and gemma_vocab.detokenize(ids[1:3].tolist(), unparse_special=True) == \
        "<start_of_turn>user"


def test_from_model_reads_the_gguf_template(gemma3_path: Path) -> None:
    model = load_model(gemma3_path)
    with pytest.raises(InputError, match="has no chat template .*chatml, llama3, gemma, phi3, mistral-v7") as err:
        ChatTemplate.from_model(model)
    assert "\n" not in str(err.value)
    source = GEMMA3_TEMPLATE.read_text(encoding="utf-8")
    model.file.metadata["tokenizer.chat_template"] = MetaValue(ValueType.STRING, None, source)
    template = ChatTemplate.from_model(model)
    assert (template.bos_token, template.eos_token) == ("<bos>", "<eos>")
    messages = [system("Be brief."), user("Hi"), assistant("Hello!")]
    assert template.render(messages) == ChatTemplate.from_file(GEMMA3_TEMPLATE, model.vocab).render(messages) == \
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"


# -- the loss mask ------------------------------------------------------------------------


def test_mask_chatml() -> None:
    vocab = shared_vocab("qwen2")
    template = ChatTemplate.named("chatml", vocab)
    ids, mask = template.tokenize(vocab, [system("Be brief."), user("Hi"), assistant("Hello!"), user("Bye"),
                                          assistant("")])
    assert learned(vocab, ids, mask) == ["Hello!<|im_end|>", "<|im_end|>"]
    # The header and the newline after <|im_end|> are not learned.
    text = vocab.detokenize(ids.tolist(), unparse_special=True)
    assert text.endswith("<|im_start|>assistant\n<|im_end|>\n")
    assert not mask[-1] and mask[-2] and not mask[-3]


def test_mask_gemma3(gemma_vocab: Vocab) -> None:
    template = ChatTemplate.from_file(GEMMA3_TEMPLATE, gemma_vocab)
    messages = [system("One word."), user("Capital of France?"), assistant("Paris"), user("Of Italy?"),
                assistant(" Rome \n")]
    ids, mask = template.tokenize(gemma_vocab, messages)
    assert learned(gemma_vocab, ids, mask) == ["Paris<end_of_turn>", "Rome<end_of_turn>"]
    assert not mask[0]  # BOS


def test_mask_llama3() -> None:
    vocab = shared_vocab("llama-bpe")
    ids, mask = ChatTemplate.named("llama3", vocab).tokenize(vocab, [user("What is 2+2?"), assistant("4.")])
    assert learned(vocab, ids, mask) == ["4.<|eot_id|>"]
    assert vocab.detokenize(ids[~mask].tolist(), unparse_special=True) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_mask_spm_space_prefix_and_no_header() -> None:
    """mistral-v7-tekken has no assistant header; the Llama 2 vocabulary adds a space before
    the text after </s>, which the text does not have: offsets still line up."""
    vocab = shared_vocab("llama-spm")
    template = ChatTemplate.named("mistral-v7-tekken", vocab)
    ids, mask = template.tokenize(vocab, [user("Hi"), assistant("Hello!"), user("Bye"), assistant("Ciao")])
    assert learned(vocab, ids, mask) == ["Hello!</s>", "Ciao</s>"]


def test_prompt_only_and_pairs() -> None:
    vocab = shared_vocab("qwen2")
    template = ChatTemplate.named("chatml", vocab)
    ids, mask = template.tokenize(vocab, [user("Hi")], add_generation_prompt=True)
    assert len(ids) and not mask.any()
    pair = template.tokenize_pair(vocab, "Hi", "Hello!")
    full = template.tokenize(vocab, [user("Hi"), assistant("Hello!")])
    assert all(np.array_equal(a, b) for a, b in zip(pair, full))
    assert learned(vocab, *pair) == ["Hello!<|im_end|>"]


def test_mask_when_the_template_closes_the_conversation() -> None:
    """Phi-3.5 writes EOS after the last message only: earlier turns end at their <|end|>.
    The Phi-3 vocabulary's special tokens also strip the newline after them (RSTRIP)."""
    vocab = shared_vocab("phi-3")
    template = ChatTemplate.from_file(shared_path("data", "chat_templates", "microsoft-Phi-3.5-mini-instruct.jinja"),
                                      vocab)
    ids, mask = template.tokenize(vocab, [user("Capital of France?"), assistant("Paris."), user("Of Italy?"),
                                          assistant("Rome.")])
    assert learned(vocab, ids, mask) == ["Paris.<|end|>", "Rome.<|end|><|endoftext|>"]


# -- the Jinja environment ---------------------------------------------------------------


def render(source: str, messages: list[dict] | None = None, **kwargs) -> str:
    return ChatTemplate(source, "test template", **kwargs).render(messages or [], add_generation_prompt=True)


def test_environment_matches_transformers() -> None:
    assert render("{{ {'a': '<é>', 'b': [1, none]} | tojson }}") == '{"a": "<é>", "b": [1, null]}'
    assert render("{{ [1] | tojson(indent=2) }}") == "[\n  1\n]"
    assert render("{{ strftime_now('%Y') }}") == datetime.now().strftime("%Y")
    assert render("{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% break %}"
                  "{% endfor %}", [user("a"), user("b"), user("c")]) == "b"
    assert render("{% if add_generation_prompt %}\n  X{% endif %}\n{{ tools is none }}") == "  XTrue"
    assert render("  {% if true %}\nY\n{% endif %}") == "Y\n"  # lstrip_blocks and trim_blocks
    assert render("{{ bos_token }}|{{ eos_token }}", bos_token="<s>", eos_token="</s>") == "<s>|</s>"


def test_whitespace_is_stripped_as_llama_cpp_strips_it() -> None:
    """ASCII whitespace only; Python (and so transformers) would also strip U+00A0 and U+3000."""
    source = ("{% set t = messages[0].content %}{{ t | trim }}|{{ t.strip() }}|{{ t.lstrip() }}|{{ t.rstrip() }}|"
              "{{ t.strip('\u00a0\\n') }}")
    inner = "\u00a0 x\t\u3000"
    assert render(source, [user(inner + "\n")]) == "|".join([inner, inner, inner + "\n", inner, " x\t\u3000"])


# -- failures -----------------------------------------------------------------------------


def one_line_error(fn, match: str) -> str:
    with pytest.raises(InputError, match=match) as err:
        fn()
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_template_raising_is_one_line(gemma_vocab: Vocab) -> None:
    template = ChatTemplate.from_file(GEMMA3_TEMPLATE, gemma_vocab)
    message = one_line_error(lambda: template.render([user("a"), user("b")]),
                             "Conversation roles must alternate user/assistant/user/assistant/...")
    assert message.startswith(f"chat template {GEMMA3_TEMPLATE}: ")
    one_line_error(lambda: template.tokenize(gemma_vocab, [assistant("a")]), "Conversation roles must alternate")


def test_undefined_misuse_syntax_and_sandbox_errors() -> None:
    one_line_error(lambda: render("{{ foo.bar }}"),
                   "test template failed to render: UndefinedError: 'foo' is undefined")
    one_line_error(lambda: render("{{ messages[0]['content'] + 1 }}", [user("x")]), "failed to render: TypeError")
    one_line_error(lambda: render("{% for m in messages %}"), r"test template is not a valid Jinja template \(line 1\)")
    one_line_error(lambda: render("{{ messages.append(1) }}"), "SecurityError")
    assert render("{{ undefined_name }}") == ""  # as in transformers: printing an undefined name is no error


def test_unknown_name_lists_the_built_in_templates() -> None:
    message = one_line_error(lambda: ChatTemplate.named("chatml2"), "unknown chat template 'chatml2'")
    assert all(name in message for name in NAMED_TEMPLATES)
    assert {"chatml", "llama3", "gemma", "phi3", "mistral-v7", "mistral-v7-tekken"} <= set(NAMED_TEMPLATES)


def test_missing_template_file(tmp_path: Path) -> None:
    one_line_error(lambda: ChatTemplate.from_file(tmp_path / "none.jinja"), "cannot read chat template .*none.jinja")


def test_non_incremental_template_cannot_be_masked() -> None:
    """A template that renders earlier turns differently once later ones exist gives no mask."""
    vocab = shared_vocab("qwen2")
    source = ("{% for m in messages %}{% if loop.last %}[{{ m.content }}]{% else %}{{ m.content }}{% endif %}"
              "{% endfor %}")
    one_line_error(lambda: ChatTemplate(source, "t").tokenize(vocab, [user("a"), assistant("b"), user("c")]),
                   "assistant message 2 cannot be located for the loss mask")


def test_qwen3_masks_one_turn_and_refuses_several() -> None:
    """Qwen3 writes an empty <think> block only in turns after the last user message."""
    vocab = shared_vocab("qwen2")
    template = ChatTemplate.from_file(shared_path("data", "chat_templates", "Qwen-Qwen3-0.6B.jinja"), vocab)
    ids, mask = template.tokenize(vocab, [user("Hi"), assistant("Hello!")])
    assert learned(vocab, ids, mask) == ["<think>\n\n</think>\n\nHello!<|im_end|>"]
    one_line_error(lambda: template.tokenize(vocab, [user("Hi"), assistant("Hello!"), user("Bye"), assistant("Ciao")]),
                   "assistant message 2 cannot be located")


# -- real templates -------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(shared_path("data", "chat_templates").glob("*.jinja")), ids=lambda p: p.stem)
def test_real_templates_render(path: Path) -> None:
    template = ChatTemplate.from_file(path)
    template.bos_token, template.eos_token = "<BOS>", "<EOS>"
    messages = [user("What is the capital of France?"), assistant("Paris."), user("And of Italy?")]
    text = template.render(messages, add_generation_prompt=True)
    positions = [text.find(m["content"]) for m in messages]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), text
