"""Hostile clients of llamapy-server, and out-of-range scales on every command line.

No request can break the server for the others: each bad one gets a 400 (413 for a body past
--max-body, 409 past --lora-max) in OpenAI's error shape naming what is wrong, nothing is
logged as a traceback, and afterwards every client still gets the same greedy text. The same
LoRA-scale bound holds on llamapy-cli, llamapy-perplexity, llamapy-export-lora and the server's
own command line: one `error:` line, before the model is read, and no file written.
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import llamapy
from llamapy.lora import LoraAdapter
from test_hostile_cli import files, one_error, run_tool  # noqa: F401 -- `files` is a fixture
from test_server import GOLDEN_PROMPT, ServerProcess

MAX_BODY = 2_000_000
SCALE_RULE = "a LoRA scale must be a finite number from -100 to 100"


@pytest.fixture(scope="module")
def model(stories_path):
    return llamapy.load_model(stories_path)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, model) -> Path:
    """Four adapters for stories260K (random B, so they change the text)."""
    folder = tmp_path_factory.mktemp("hostile-adapters")
    for seed in (1, 2, 3, 4):
        adapter = LoraAdapter.new(model, rank=2, seed=seed)
        for _, b in adapter.tensors.values():
            b.array()[...] = np.random.default_rng(seed).standard_normal(b.array().shape) * 0.2
        adapter.save(folder / f"a{seed}.gguf")
    return folder


@pytest.fixture(scope="module")
def server(stories_path, adapter_dir):
    srv = ServerProcess("-m", str(stories_path), "-np", "2", "-c", "512", "-t", "1", "--lora-dir", str(adapter_dir),
                        "--lora-scaled", f"{adapter_dir / 'a1.gguf'}:0", "--lora-max", "3",
                        "--max-body", str(MAX_BODY))
    yield srv
    srv.stop()
    assert "Traceback" not in "".join(srv.log), "".join(srv.log)


def refused(srv: ServerProcess, method: str, path: str, body=None, raw: bytes | None = None, code: int = 400) -> str:
    """The message of the error the request gets (it must get `code` in OpenAI's shape)."""
    status, reply = srv.request(method, path, body, raw=raw)
    assert status == code, (status, reply)
    assert set(reply["error"]) == {"code", "message", "type"} and reply["error"]["code"] == code, reply
    return reply["error"]["message"]


def greedy(srv: ServerProcess, prompt: str = GOLDEN_PROMPT, n: int = 12, **extra) -> str:
    status, reply = srv.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                            **extra})
    assert status == 200, reply
    return reply["choices"][0]["text"]


# ---- LoRA scales ---------------------------------------------------------------------------------
def test_out_of_range_lora_scales_are_refused_and_every_client_is_still_served(server):
    before_text, (_, before_adapters) = greedy(server), server.request("GET", "/lora-adapters")
    for method, path, body, raw in [
        ("POST", "/lora-adapters", [{"id": 0, "scale": 1e308}], None),
        ("POST", "/lora-adapters", [{"id": 0, "scale": -100.5}], None),
        ("POST", "/lora-adapters", None, b'[{"id": 0, "scale": NaN}]'),
        ("POST", "/lora-adapters", None, b'[{"id": 0, "scale": Infinity}]'),
        ("POST", "/lora-adapters/load", {"path": "a1.gguf", "scale": 1e38}, None),
        ("POST", "/v1/completions", {"prompt": GOLDEN_PROMPT, "max_tokens": 2,
                                     "lora": [{"id": 0, "scale": 1e38}]}, None),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                          "lora": [{"id": 0, "scale": -1e308}]}, None),
    ]:
        message = refused(server, method, path, body, raw)
        assert "scale" in message, message
        assert SCALE_RULE in message or "finite number" in message, message
    assert server.request("GET", "/lora-adapters") == (200, before_adapters)
    assert greedy(server) == before_text
    # the bound itself is a scale a client may use
    assert greedy(server, lora=[{"id": 0, "scale": 100}]) != before_text
    status, reply = server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 4, "temperature": 0,
        "logprobs": True, "top_logprobs": 2})
    assert status == 200 and all(np.isfinite(t["logprob"]) for t in reply["choices"][0]["logprobs"]["content"])


# ---- sampling fields -----------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, fragment", [
    ("temperature", "NaN", "finite number"),
    ("top_p", 1.5, "less than or equal to 1"),
    ("min_p", -0.1, "greater than or equal to 0"),
    ("typical_p", 2, "less than or equal to 1"),
    ("presence_penalty", 1e308, "less than or equal to 2"),
    ("frequency_penalty", -3, "greater than or equal to -2"),
    ("repeat_penalty", 0, "greater than 0"),
    ("repeat_penalty", "Infinity", "finite number"),
    ("dynatemp_range", 1e308, "less than or equal to 100"),
    ("dynatemp_exponent", -1, "greater than or equal to 0"),
    ("n_probs", 101, "less than or equal to 100"),
    ("logprobs", 6, "less than or equal to 5"),
    ("max_tokens", 2**40, "less than or equal to 2147483647"),
    ("seed", 2**70, "less than or equal to"),
    ("top_k", -1, "greater than or equal to 0"),
    ("stop", ["x"] * 65, "at most 64 stop strings"),
    ("stop", "x" * 1025, "at most 1024 characters"),
])
def test_sampling_fields_out_of_range_are_400s_naming_the_field(server, field, value, fragment):
    body = json.dumps({"prompt": GOLDEN_PROMPT, "max_tokens": 2, field: value})
    if value in ("NaN", "Infinity"):  # JSON has no such numbers, Python's parser takes them: refused all the same
        body = body.replace(f'"{value}"', value)
    message = refused(server, "POST", "/v1/completions", raw=body.encode())
    assert message.startswith(f"{field}") and fragment in message, message


def test_chat_top_logprobs_past_twenty_is_refused(server):
    message = refused(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                               "logprobs": True, "top_logprobs": 21})
    assert message.startswith("top_logprobs") and "less than or equal to 20" in message


def test_max_tokens_past_a_slots_context_is_refused(server):
    status, reply = server.request("POST", "/v1/completions", {"prompt": GOLDEN_PROMPT, "max_tokens": 257})
    assert status == 400 and reply["error"]["type"] == "exceed_context_size_error", reply
    assert "max_tokens 257 is more than a slot's context (256 tokens)" in reply["error"]["message"]


def test_a_negative_temperature_is_greedy_as_in_llama_cpp(server):
    status, reply = server.request("POST", "/v1/completions", {"prompt": GOLDEN_PROMPT, "max_tokens": 12,
                                                               "temperature": -1})
    assert status == 200 and reply["choices"][0]["text"] == greedy(server)


def test_repeat_last_n_minus_one_is_the_whole_context(server):
    """llama.cpp's -1: penalties over the slot's context (it used to fail every client's job)."""
    text = greedy(server, n=60, repeat_last_n=-1, repeat_penalty=1.5)
    assert text == greedy(server, n=60, repeat_last_n=256, repeat_penalty=1.5)
    assert text != greedy(server, n=60)


# ---- logit_bias ----------------------------------------------------------------------------------
def _best_tokens(model, prompt: str) -> list[int]:
    """The model's tokens after `prompt`, most likely first."""
    ctx = llamapy.Context(model, n_ctx=64)
    ctx.decode(llamapy.Batch.from_tokens(model.vocab.tokenize(prompt, add_special=True)))
    return [int(t) for t in np.argsort(-ctx.get_logits_ith(-1), kind="stable")]


def test_logit_bias_takes_llama_servers_forms(server, model):
    prompt = "Once upon a time, there was a little"
    first, second = _best_tokens(model, prompt)[:2]
    piece = lambda t: model.vocab.token_to_piece(t).decode()  # noqa: E731
    word = piece(second).strip()
    assert model.vocab.tokenize(word, add_special=False) == [second]  # the text form names that one token
    assert greedy(server, prompt, 1) == piece(first)
    for ban in ({str(first): False}, [[first, False]], {str(first): -100}, [[first, -100.0]]):
        assert greedy(server, prompt, 1, logit_bias=ban) == piece(second), ban
    for push in ({str(second): 100}, [[second, 100]], {word: 100}, [[word, 100]]):
        assert greedy(server, prompt, 1, logit_bias=push) == piece(second), push


@pytest.mark.parametrize("bias", [
    {"407": True}, {"407": "1"}, {"407": None}, {"407": 1e308}, [[407]], [407], [[407, 1, 2]], [[1.5, 1]],
    [[True, 1]], [[407, True]], 5, "407",
])
def test_logit_bias_of_the_wrong_type_is_refused(server, bias):
    message = refused(server, "POST", "/v1/completions", {"prompt": GOLDEN_PROMPT, "max_tokens": 2, "logit_bias": bias})
    assert message.startswith("logit_bias") and "TOKEN_ID or text" in message, message


# ---- malformed strings ---------------------------------------------------------------------------
@pytest.mark.parametrize("path, raw, fragment", [
    ("/tokenize", b'{"content": "\\ud800"}', "not valid JSON"),
    ("/tokenize", b'{"content": "a\\udc80b"}', "not valid JSON"),
    ("/tokenize", b'{"content": "\xff\xfe"}', "not valid JSON"),
    ("/tokenize", b'{"content": ' + b"[" * 5000 + b"]" * 5000 + b"}", "not valid JSON"),
    ("/tokenize", b"", "no body"),
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "not valid JSON"),
    ("/v1/completions", b'{"prompt": "x", "model": "\\udfff", "max_tokens": 2}', "not valid JSON"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "not valid JSON"),
    ("/lora-adapters/load", b'{"path": "\\ud800.gguf"}', "not valid JSON"),
    ("/lora-adapters/load", b'{"path": "a1.gguf\\u0000x"}', "path: a path cannot hold a NUL byte"),
    ("/lora-adapters/load", b'{"path": "' + b"x" * 300 + b'.gguf"}', "path: a name in the path is longer than 255"),
    ("/lora-adapters/load", b'{"path": "' + b"x/" * 3000 + b'a.gguf"}', "path: the path is longer than 4096"),
    ("/lora-adapters/load", b'{"path": ""}', "path: the path is empty"),
])
def test_malformed_strings_are_400s_never_500s(server, path, raw, fragment):
    assert fragment in refused(server, "POST", path, raw=raw)
    assert server.request("GET", "/health") == (200, {"status": "ok"})


def test_a_nul_byte_in_text_is_text(server, model):
    """As llama-server: NUL is a character a tokenizer takes (only paths refuse it)."""
    status, reply = server.request("POST", "/tokenize", {"content": "a\u0000b"})
    assert status == 200 and reply["tokens"] == model.vocab.tokenize("a\u0000b", add_special=False)


# ---- bodies --------------------------------------------------------------------------------------
def test_a_body_past_max_body_is_413_and_one_under_it_is_read(server):
    big = json.dumps({"content": "x" * MAX_BODY}).encode()
    message = refused(server, "POST", "/tokenize", raw=big, code=413)
    assert f"limit of {MAX_BODY} bytes (--max-body)" in message
    # chunked: no Content-Length to check first, refused once the count passes the limit
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        try:
            for _ in range(MAX_BODY // len(chunk) + 8):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            pass  # the server may have answered and closed already
        assert sock.recv(64).startswith(b"HTTP/1.1 413 ")
    fits = json.dumps({"content": "Once upon a time " * ((MAX_BODY - 100) // 17)}).encode()
    assert len(fits) <= MAX_BODY
    status, reply = server.request("POST", "/tokenize", raw=fits)
    assert status == 200 and len(reply["tokens"]) > 100_000
    assert server.request("GET", "/health") == (200, {"status": "ok"})


# ---- adapters ------------------------------------------------------------------------------------
def test_adapter_loads_are_bounded_and_a_file_is_loaded_once(server, adapter_dir):
    again = [server.request("POST", "/lora-adapters/load", {"path": "a2.gguf"}) for _ in range(5)]
    assert {status for status, _ in again} == {200} and len({reply["id"] for _, reply in again}) == 1
    status, reply = server.request("POST", "/lora-adapters/load", {"path": str(adapter_dir / "a1.gguf"), "scale": 0.5})
    assert status == 200 and reply["id"] == 0 and reply["scale"] == 0.5  # the command line's, reused
    status, third = server.request("POST", "/lora-adapters/load", {"path": "a3.gguf"})
    assert status == 200
    message = refused(server, "POST", "/lora-adapters/load", {"path": "a4.gguf"}, code=409)
    assert "--lora-max 3" in message, message
    status, listed = server.request("GET", "/lora-adapters")
    assert status == 200 and len(listed) == 3 and listed[third["id"]]["path"].endswith("a3.gguf")
    server.request("POST", "/lora-adapters", [{"id": 0, "scale": 0.0}])


# ---- the event loop ------------------------------------------------------------------------------
@pytest.mark.slow
def test_large_bodies_never_keep_health_waiting(stories_path, wiki_path):
    """A near-16-MiB /tokenize (seconds of tokenizing and of JSON) and a prompt far past the
    context: /health keeps answering while they run."""
    srv = ServerProcess("-m", str(stories_path), "-np", "2", "-c", "512", "-t", "1")
    try:
        text = wiki_path.read_text(encoding="utf-8")
        big = (text * (8_000_000 // len(text) + 1))[:8_000_000]
        bodies = [("/tokenize", json.dumps({"content": big}).encode()),
                  ("/v1/completions", json.dumps({"prompt": big, "max_tokens": 2}).encode())]
        for path, body in bodies:
            status = []

            def send(path=path, body=body) -> None:
                conn = http.client.HTTPConnection(srv.host, srv.port, timeout=300)
                conn.request("POST", path, body=body)
                response = conn.getresponse()
                while response.read(1 << 16):  # read, not parsed: this process's GIL stays free
                    pass
                status.append(response.status)

            worker = threading.Thread(target=send)
            t0 = time.monotonic()
            worker.start()
            slowest = 0.0
            while worker.is_alive():
                t1 = time.monotonic()
                assert srv.request("GET", "/health") == (200, {"status": "ok"})
                slowest = max(slowest, time.monotonic() - t1)
            took = time.monotonic() - t0
            assert status == [200 if path == "/tokenize" else 400]
            assert slowest < 2.0, (path, slowest, took)
            if path == "/tokenize":
                assert took > 3 * slowest  # long enough that a blocked loop would have shown
    finally:
        srv.stop()
    assert "Traceback" not in "".join(srv.log)


# ---- command lines -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapter_file(adapter_dir) -> Path:
    return adapter_dir / "a1.gguf"


@pytest.mark.parametrize("tool, extra", [
    ("cli", ["-p", "Once", "-n", "2"]),
    ("perplexity", ["-f", "{t}"]),
    ("export-lora", ["-o", "{d}/merged.gguf"]),
    ("server", []),
])
@pytest.mark.parametrize("scale", ["1e38", "-101", "nan", "inf"])
def test_lora_scale_flags_out_of_range_are_one_error(files, capsys, adapter_file, tool, extra, scale):
    model, text = files
    fill = {"t": text, "d": model.parent}
    code, err = run_tool(tool, "-m", model, "--lora-scaled", f"{adapter_file}:{scale}",
                         *[a.format(**fill) for a in extra], capsys=capsys)
    line = one_error(err)
    assert code != 0 and f"--lora-scaled {adapter_file}:{scale}: expected FNAME:SCALE with a finite SCALE from -100 " \
                         "to 100" in line, line
    assert not (model.parent / "merged.gguf").exists()
    assert "model:" not in err and "lora:" not in err  # refused before the model or the adapter was read


@pytest.mark.parametrize("flags, fragment", [
    (["--temp", "nan"], "--temp must be a finite number"),
    (["--presence-penalty", "3"], "--presence-penalty 3.0: Input should be less than or equal to 2"),
    (["--dynatemp-exp", "-1"], "--dynatemp-exp -1.0: Input should be greater than or equal to 0"),
    (["-l", "5+1000"], "-l 5+1000: a bias must be from -100 to 100, or -inf"),
    (["-c", "256", "-np", "2", "-n", "200"], "-n 200 is more than a slot's context (128 tokens)"),
])
def test_server_defaults_keep_the_ranges_of_requests(files, capsys, flags, fragment):
    model, _ = files
    code, err = run_tool("server", "-m", model, *flags, capsys=capsys)
    assert code != 0 and fragment in one_error(err)


# ---- the engine ----------------------------------------------------------------------------------
def _run_jobs(engine, jobs: list, seconds: float = 60.0) -> list[list]:
    """Each job's events, once every job has ended (Done or Failed)."""
    from llamapy.server.engine import Done, Failed
    events: list[list] = [[] for _ in jobs]
    for job, got in zip(jobs, events):
        job.emit = got.append
        engine.submit(job)
    deadline = time.monotonic() + seconds
    while not all(got and isinstance(got[-1], (Done, Failed)) for got in events):
        assert time.monotonic() < deadline, events
        time.sleep(0.01)
    return events


def test_a_request_its_sampler_cannot_serve_fails_alone(model):
    """The decode loop serves every slot: a sampler that raises ends its own job, and the job
    beside it (same step) still gets its whole greedy text."""
    from llamapy.generate import sampler_chain
    from llamapy.server.engine import Done, Engine, Failed, Job

    class Broken:
        def sample(self, ctx, row):
            raise ZeroDivisionError("0.0 cannot be raised to a negative power")

    engine = Engine(llamapy.Context(model, n_ctx=256, n_seq_max=2, n_threads=1))
    engine.start()
    try:
        tokens = model.vocab.tokenize(GOLDEN_PROMPT, add_special=True)
        greedy_chain = sampler_chain(model.vocab.n_tokens, temperature=0)
        broken, fine = (Job(tokens=list(tokens), max_tokens=8, stop=(), chain=chain, lora=(), emit=None)
                        for chain in (Broken(), greedy_chain))
        failed, done = _run_jobs(engine, [broken, fine])
    finally:
        engine.stop()
    assert isinstance(failed[-1], Failed) and "ZeroDivisionError" in failed[-1].message
    assert isinstance(done[-1], Done) and done[-1].finish_reason == "length"
    assert "".join(e.text for e in done[:-1]) == llamapy.generate(model, GOLDEN_PROMPT, 8, temperature=0)


def test_logprobs_of_logits_that_overflow_are_still_json(model, adapter_dir):
    """An adapter whose weights overflow (scales are bounded, a file's values are not) makes
    the logits NaN: the log-probabilities become float32's lowest (llama-server's value for
    a probability of 0), never a NaN that no JSON can carry."""
    from llamapy.generate import sampler_chain
    from llamapy.server.engine import LOWEST_LOGPROB, Engine, Job, TokenOut
    adapter = LoraAdapter.load(adapter_dir / "a1.gguf", model)
    for _, b in adapter.tensors.values():
        b.array()[...] = 1e38
    engine = Engine(llamapy.Context(model, n_ctx=64, n_threads=1), [adapter], [1.0])
    engine.start()
    try:
        job = Job(tokens=model.vocab.tokenize(GOLDEN_PROMPT, add_special=True), max_tokens=2, stop=(),
                  chain=sampler_chain(model.vocab.n_tokens, temperature=0), lora=(1.0,), emit=None, n_probs=3)
        (events,) = _run_jobs(engine, [job])
    finally:
        engine.stop()
    outs = [e for e in events if isinstance(e, TokenOut)]
    assert outs and all(e.logprob == LOWEST_LOGPROB and len(e.top) == 3 for e in outs), outs
    json.dumps([(e.logprob, e.top) for e in outs], allow_nan=False)
