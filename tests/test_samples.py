"""Reading training examples: JSONL in three formats, plain text cut at a sample start, and
one clear line naming file and line for every kind of bad input."""
from __future__ import annotations

import json

import pytest

from llamapy.errors import InputError
from llamapy.samples import read_jsonl, split_text, unescape


def write(tmp_path, lines, name="train.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x, ensure_ascii=False) for x in lines) + "\n",
                    encoding="utf-8")
    return path


def test_three_formats_are_detected(tmp_path):
    samples, fmt = read_jsonl(write(tmp_path, [{"text": "Once upon a time"}, "", {"text": "Über alles 🦙"}]))
    assert fmt == "text" and [s.text for s in samples] == ["Once upon a time", "Über alles 🦙"]
    samples, fmt = read_jsonl(write(tmp_path, [{"prompt": "2+2?", "completion": "4"}]))
    assert fmt == "completions" and samples[0].messages == [{"role": "user", "content": "2+2?"},
                                                            {"role": "assistant", "content": "4"}]
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello."}]}
    samples, fmt = read_jsonl(write(tmp_path, [chat]))
    assert fmt == "chat" and samples[0].is_chat and samples[0].messages == chat["messages"]
    assert samples[0].where.endswith("train.jsonl:1")


@pytest.mark.parametrize("lines, fmt, message", [
    (['{"text": "a"}', '{"text": "b",}'], None, r"train\.jsonl:2: invalid JSON: "),
    ([{"prompt": "a"}], None, r"train\.jsonl:1: a sample needs \{\"text\"\} or \{\"prompt\", \"completion\"\} or "
                              r"\{\"messages\"\}; this one has keys \['prompt'\]"),
    ([{"text": "a"}, {"prompt": "p", "completion": "c"}], None,
     r"train\.jsonl:2: a 'completions' sample in a file of 'text' samples \(one format per file\)"),
    ([{"messages": [{"role": "wizard", "content": "x"}]}], None,
     r"train\.jsonl:1: message 0 has an unknown role 'wizard' \(known: system, user, assistant, tool\)"),
    ([{"messages": [{"role": "user"}]}], None, r"train\.jsonl:1: message 0 needs \"role\" and \"content\""),
    ([{"messages": [{"role": "user", "content": "hi"}]}], None, r"train\.jsonl:1: the conversation has no assistant"),
    ([{"text": 5}], None, r"train\.jsonl:1: \"text\" must be a string, got int"),
    ([[1, 2]], None, r"train\.jsonl:1: a sample must be a JSON object, got list"),
    ([{"text": "a"}], "chat", r"train\.jsonl:1: a 'text' sample in a file of 'chat' samples"),
    ([{"text": "a"}], "xml", r"unknown data format 'xml' \(known: text, completions, chat\)"),
    ([""], None, r"train\.jsonl: no samples \(the file is empty\)"),
])
def test_bad_files_give_one_line_with_file_and_line(tmp_path, lines, fmt, message):
    with pytest.raises(InputError, match=message):
        read_jsonl(write(tmp_path, lines), fmt)


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(InputError, match="dataset file not found"):
        read_jsonl(tmp_path / "nope.jsonl")
    bad = tmp_path / "bin.jsonl"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(InputError, match="not UTF-8 text"):
        read_jsonl(bad)


def test_sample_start_splits_as_llama_cpps_finetune():
    text = "preamble<s>first story<s>second story"
    assert [s.text for s in split_text(text, "<s>", "t.txt")] == ["first story", "second story"]
    assert [s.text for s in split_text(text, "<s>", "t.txt", include_sample_start=True)] == ["<s>first story",
                                                                                              "<s>second story"]
    assert [s.text for s in split_text(text, None, "t.txt")] == [text]
    with pytest.raises(InputError, match=r"t\.txt: the sample start '<e>' does not occur in the text"):
        split_text(text, "<e>", "t.txt")
    assert unescape(r"\n\t\\x\"") == "\n\t\\x\""


def test_load_samples_tokenizes_masks_and_packs(stories_path, tmp_path):
    import numpy as np

    import llamapy
    from llamapy.chat import ChatTemplate
    from llamapy.dataset import IGNORE, load_samples

    model = llamapy.load_model(stories_path)
    path = write(tmp_path, [{"prompt": "What is two and two?", "completion": "Four."},
                            {"prompt": "Name a color.", "completion": "Blue."}])
    template = ChatTemplate.named("chatml", model.vocab)
    ds = load_samples(path, model.vocab, 128, chat_template=template)
    assert ds.ndata == 1  # both conversations fit one window, as two sequences
    counted = ds.labels[0] != IGNORE
    expected = []
    for messages in ([{"role": "user", "content": "What is two and two?"}, {"role": "assistant", "content": "Four."}],
                     [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}]):
        tokens, mask = template.tokenize(model.vocab, messages)
        expected += list(np.asarray(tokens)[np.asarray(mask)])
    assert list(ds.labels[0][counted]) == expected  # exactly the assistant tokens are learned
    unmasked = load_samples(path, model.vocab, 128, chat_template=template, mask_prompt=False)
    assert (unmasked.labels[0] != IGNORE).sum() > counted.sum()
    with pytest.raises(InputError, match=r"train\.jsonl:1: a conversation needs a chat template"):
        load_samples(path, model.vocab, 128)
    text = tmp_path / "stories.txt"
    text.write_text("junk<s>Once upon a time there was a cat.<s>The dog ran home.")
    ds = load_samples(text, model.vocab, 64, sample_start="<s>")
    assert ds.seq[0].max() >= 1 and (ds.labels != IGNORE).sum() > 10
