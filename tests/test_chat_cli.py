"""llamapy-cli's chats: -cnv reads user messages from stdin (a pipe or a terminal), --chat
answers one; every answer is what the model generates for the whole conversation rendered
through the template, though the cache keeps the earlier turns."""
from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import pytest

import llamapy
from llamapy.chat import ChatTemplate
from llamapy.generate import Generator

from conftest import tool_process
from test_cli_errors import assert_one_clear_line

N = 12
SYSTEM = "You tell short stories."
USER = ["Tell me about a cat.", "And then what happened?"]


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """llamapy-cli in this process, stdin a pipe's text (the terminal's test runs a child process)."""
    return tool_process("cli", *args, stdin=stdin)


def fresh_answer(model, template, messages) -> tuple[str, list[int]]:
    """The greedy answer of a new context to the whole conversation: as the CLI prints it, and its tokens."""
    ctx = llamapy.Context(model, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=1)
    gen = Generator(ctx, temperature=0.0)
    tokens, _ = template.tokenize(model.vocab, messages, add_generation_prompt=True)
    gen.feed(tokens)
    text = "".join(piece.text for piece in gen.stream(N))
    return text, gen.tokens


def test_conversation_answers_equal_fresh_generation_over_the_whole_conversation(stories_path):
    proc = cli("-m", str(stories_path), "-cnv", "-sys", SYSTEM, "-n", str(N), "--temp", "0", "-t", "1", "-c", "512",
               stdin="\n".join(USER) + "\n")
    assert proc.returncode == 0, proc.stderr
    turns = proc.stdout.split("\n> ")
    assert turns[0] == "" and turns[-1] == "" and len(turns) == len(USER) + 2, proc.stdout
    model = llamapy.load_model(stories_path)
    template = ChatTemplate.named("chatml", model.vocab)
    messages = [{"role": "system", "content": SYSTEM}]
    for user, printed in zip(USER, turns[1:-1]):
        messages.append({"role": "user", "content": user})
        expected, reply = fresh_answer(model, template, messages)
        assert printed == expected + "\n"
        messages.append({"role": "assistant", "content": model.vocab.detokenize(reply)})
    # the second turn decoded only what the first left out of the cache
    n_prompt = int(proc.stderr.split("prompt eval time =")[1].split("/")[1].split()[0])
    whole, _ = template.tokenize(model.vocab, messages[:-1], add_generation_prompt=True)
    assert n_prompt < len(whole)


def test_chat_answers_one_message_and_exits(stories_path):
    proc = cli("-m", str(stories_path), "--chat", "-p", USER[0], "-n", str(N), "--temp", "0", "-t", "1", "-c", "512")
    assert proc.returncode == 0, proc.stderr
    model = llamapy.load_model(stories_path)
    expected, _ = fresh_answer(model, ChatTemplate.named("chatml", model.vocab), [{"role": "user", "content": USER[0]}])
    assert proc.stdout == expected + "\n"
    assert "> " not in proc.stdout
    # the warmup planned the graph of a one-token step: every generated token reuses it
    n_eval = int(proc.stderr.split("eval time =")[-1].split("/")[1].split()[0])
    assert f"graphs reused = {n_eval:10d}" in proc.stderr


def _read_until(fd: int, marker: bytes, timeout: float) -> bytes:
    buf, end = b"", time.monotonic() + timeout
    while marker not in buf:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            raise AssertionError(f"no {marker!r} within {timeout} s; got {buf!r}")
        buf += os.read(fd, 4096)
    return buf


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_conversation_in_a_terminal(stories_path):
    """Typed at a terminal: a prompt, an answer, the next prompt, /exit ends it cleanly."""
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "llamapy.cli.completion", "-m", str(stories_path), "-cnv", "-n", "8", "--temp", "0",
                             "-t", "1", "-c", "512"], stdin=slave, stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    try:
        _read_until(master, b"> ", 120)
        os.write(master, (USER[0] + "\n").encode())
        answer = _read_until(master, b"> ", 120)
        os.write(master, b"/exit\n")
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        os.close(master)
    assert proc.returncode == 0, err
    assert USER[0].encode() in answer  # the terminal echoed what was typed
    assert len(answer.split(USER[0].encode())[1].strip()) > 0  # and the model answered
    assert b"llama_perf_context_print" in err


@pytest.mark.parametrize("args, expected", [
    (["-p", "Hi", "-sys", "Be brief."], "-sys and --chat-template are for chats"),
    (["--chat"], "-st answers the -p message"),
    (["--chat", "-p", "Hi", "--chat-template", "nope"], "chat template 'nope' is neither a built-in name"),
])
def test_chat_flag_errors(stories_path, args, expected):
    assert_one_clear_line(cli("-m", str(stories_path), *args), expected)
