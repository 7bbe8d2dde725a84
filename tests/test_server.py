"""llamapy-server, driven as its users drive it: the official `openai` client and raw HTTP.

Each server is a real process (`python -m llamapy.cli.server ... --port 0`), so the tests
see what a client sees: texts equal to llamapy.generate's and llama-completion's, streams,
slots shared by concurrent clients, disconnects, a bounded queue, keys, adapters, and one
OpenAI error object for every bad request.
"""
from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import llamapy
from conftest import REPO_ROOT, shared_path, tool_process
from llamapy.lora import LoraAdapter

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")  # the server extra
pytest.importorskip("uvicorn")

GOLDEN_PROMPT = "Once upon a time"


class ServerProcess:
    """llamapy-server in a child process, on a free port, stopped at the end."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "llamapy.cli.server", *args, "--port", "0"], cwd=REPO_ROOT,
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.log: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("the server exited:\n" + "".join(self.log))
            self.log.append(line)
            found = re.search(r"listening on http://([\d.]+):(\d+)", line)
            if found:
                self.host, self.port = found.group(1), int(found.group(2))
                break
        else:
            raise RuntimeError("the server did not start:\n" + "".join(self.log))
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)

    def client(self, api_key: str = "none", **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"http://{self.host}:{self.port}/v1", api_key=api_key, max_retries=0, **kw)

    def request(self, method: str, path: str, body=None, headers: dict | None = None, raw: bytes | None = None):
        """(status, parsed JSON or text) of one raw HTTP request."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers=headers or {})
        response = conn.getresponse()
        text = response.read().decode()
        conn.close()
        try:
            return response.status, json.loads(text)
        except json.JSONDecodeError:
            return response.status, text

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory, stories_path) -> Path:
    """Two adapters for stories260K with random B (so they change the output)."""
    folder = tmp_path_factory.mktemp("adapters")
    model = llamapy.load_model(stories_path)
    for seed in (1, 2):
        adapter = LoraAdapter.new(model, rank=4, seed=seed)
        rng = np.random.default_rng(seed)
        for _, b in adapter.tensors.values():
            b.array()[...] = rng.standard_normal(b.array().shape) * 0.2
        adapter.save(folder / f"adapter{seed}.gguf")
    return folder


@pytest.fixture(scope="module")
def server(stories_path, lora_dir):
    srv = ServerProcess("-m", str(stories_path), "-np", "4", "-c", "1024", "-t", "2", "--metrics",
                        "--lora-scaled", f"{lora_dir / 'adapter1.gguf'}:0", "--lora-dir", str(lora_dir))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model(stories_path):
    return llamapy.load_model(stories_path)


def golden_continuation() -> str:
    """llama-completion's greedy 64 tokens after the prompt (its file echoes the prompt)."""
    text = shared_path("golden", "greedy_stories260K.txt").read_text()
    return text[text.index(GOLDEN_PROMPT) + len(GOLDEN_PROMPT):].rstrip("\n")


def wait_idle(server: ServerProcess, seconds: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + seconds
    while True:
        _, slots = server.request("GET", "/slots")
        if not any(s["is_processing"] for s in slots) or time.monotonic() > deadline:
            return slots
        time.sleep(0.05)


# ---- the texts ----------------------------------------------------------------------------------
def test_greedy_completion_is_llama_completions_and_generates(server, model):
    client = server.client()
    reply = client.completions.create(model="stories", prompt=GOLDEN_PROMPT, max_tokens=64, temperature=0)
    choice = reply.choices[0]
    assert choice.text.rstrip("\n") == golden_continuation()
    assert choice.text == llamapy.generate(model, GOLDEN_PROMPT, 64, temperature=0)
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 64 and reply.usage.prompt_tokens == 5
    streamed = client.completions.create(model="stories", prompt=GOLDEN_PROMPT, max_tokens=64, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text


def test_greedy_chat_is_chat_completions(server, model):
    client = server.client()
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell me about Lily."}]
    want = llamapy.chat_completion(model, messages, 40, temperature=0, chat_template="chatml")["content"]
    reply = client.chat.completions.create(model="stories", messages=messages, max_tokens=40, temperature=0)
    assert reply.choices[0].message.content == want and reply.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="stories", messages=messages, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    # the next turn of the conversation decodes only its new tokens
    turn = messages + [{"role": "assistant", "content": want}, {"role": "user", "content": "And then?"}]
    again = client.chat.completions.create(model="stories", messages=turn, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens


def test_stop_strings_max_tokens_and_seeds(server, model):
    client = server.client()
    full = llamapy.generate(model, GOLDEN_PROMPT, 64, temperature=0)
    reply = client.completions.create(model="s", prompt=GOLDEN_PROMPT, max_tokens=64, temperature=0, stop=["Lily", "xyz"])
    assert reply.choices[0].text == full[:full.index("Lily")] and reply.choices[0].finish_reason == "stop"
    short = client.completions.create(model="s", prompt=GOLDEN_PROMPT, max_tokens=5, temperature=0)
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"
    sampled = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05)
    one = client.completions.create(model="s", prompt=GOLDEN_PROMPT, max_tokens=32, seed=42, **_extra(sampled))
    two = client.completions.create(model="s", prompt=GOLDEN_PROMPT, max_tokens=32, seed=42, **_extra(sampled))
    assert one.choices[0].text == two.choices[0].text
    assert one.choices[0].text == llamapy.generate(model, GOLDEN_PROMPT, 32, seed=42, **sampled)
    other = client.completions.create(model="s", prompt=GOLDEN_PROMPT, max_tokens=32, seed=7, **_extra(sampled))
    assert other.choices[0].text != one.choices[0].text


def _extra(sampling: dict) -> dict:
    """Sampling fields the openai client does not know go in extra_body (llama-server's)."""
    known = {k: v for k, v in sampling.items() if k in ("temperature", "top_p")}
    return {**known, "extra_body": {k: v for k, v in sampling.items() if k not in known}}


def test_logprobs_are_the_models(server, model):
    reply = server.client().completions.create(model="s", prompt=GOLDEN_PROMPT, max_tokens=3, temperature=0, logprobs=2)
    ctx = llamapy.Context(model, n_ctx=64)
    tokens = model.vocab.tokenize(GOLDEN_PROMPT, add_special=True)
    ctx.decode(llamapy.Batch.from_tokens(tokens))
    logits = ctx.get_logits_ith(-1).astype(np.float64)
    logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    first = reply.choices[0].logprobs
    assert first.token_logprobs[0] == pytest.approx(logp.max(), abs=1e-5)
    assert len(first.top_logprobs[0]) == 2 and first.tokens[0] == ","


# ---- several clients ----------------------------------------------------------------------------
def test_sixteen_streaming_clients_on_four_slots(server, model):
    """Acceptance 2: every response correct and complete; no cell of the KV cache left in use
    beyond what the slots' caches hold."""
    prompts = [f"{name} went to the" for name in ("Lily", "Tom", "Ben", "Sue", "Max", "Amy", "Tim", "Sam",
                                                  "Anna", "Jack", "Mia", "Leo", "Zoe", "Sara", "Bob", "Kim")]
    want = [llamapy.generate(model, p, 40, temperature=0) for p in prompts]

    def stream(prompt: str) -> str:
        chunks = server.client().completions.create(model="s", prompt=prompt, max_tokens=40, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(stream, prompts))
    assert got == want
    slots = wait_idle(server)
    assert all(not s["is_processing"] and s["n_cells"] == s["n_cached"] for s in slots), slots
    status, metrics = server.request("GET", "/metrics")
    busy = float(re.search(r"^llamacpp:n_busy_slots_per_decode (\S+)$", metrics, re.M).group(1))
    assert status == 200 and busy > 1.0  # the slots decoded together


def test_a_client_gone_mid_stream_frees_its_slot(server):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    body = {"prompt": GOLDEN_PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    _, slots = server.request("GET", "/slots")
    assert any(s["is_processing"] for s in slots)
    conn.sock.close()  # gone, mid-stream
    conn.close()
    slots = wait_idle(server, 5.0)
    assert not any(s["is_processing"] for s in slots), slots
    assert all(s["n_cells"] == s["n_cached"] for s in slots)


def test_a_full_queue_answers_503_and_the_rest_complete(stories_path):
    srv = ServerProcess("-m", str(stories_path), "-np", "1", "-c", "2048", "--queue-size", "1")
    try:
        body = {"prompt": GOLDEN_PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: srv.request("POST", "/v1/completions", body), range(4)))
        codes = sorted(code for code, _ in results)
        assert codes.count(200) >= 2 and 503 in codes, codes
        busy = next(reply for code, reply in results if code == 503)
        assert busy["error"]["type"] == "unavailable_error"
        # a client waiting for a whole (not streamed) answer that goes away frees the slot too
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(body))
        time.sleep(0.3)
        conn.sock.close()
        slots = wait_idle(srv, 2.0)
        assert not slots[0]["is_processing"] and slots[0]["n_cached"] < 1500, slots
    finally:
        srv.stop()


# ---- bad requests -------------------------------------------------------------------------------
@pytest.mark.parametrize("body, raw, fragment", [
    (None, b"{not json", "the body is not valid JSON"),
    ({"prompt": GOLDEN_PROMPT, "max_tokens": "many"}, None, "max_tokens"),
    ({"prompt": GOLDEN_PROMPT, "temperature": "hot"}, None, "temperature"),
    ({"prompt": GOLDEN_PROMPT, "lora": [{"id": 9, "scale": 1.0}]}, None, "no adapter has id 9"),
    ({"prompt": GOLDEN_PROMPT, "n": 3}, None, "n:"),
    ({"prompt": "word " * 400}, None, "exceeds the available context size"),
    ({"prompt": [1, 99999]}, None, "token ids must be in"),
    ({"prompt": GOLDEN_PROMPT, "logit_bias": {"999999": 1}}, None, "not in the vocabulary"),
])
def test_bad_requests_get_an_openai_error_and_the_server_goes_on(server, body, raw, fragment):
    status, reply = server.request("POST", "/v1/completions", body, raw=raw)
    assert status == 400, reply
    assert set(reply["error"]) == {"code", "message", "type"} and reply["error"]["code"] == 400
    assert fragment in reply["error"]["message"], reply
    ok, again = server.request("POST", "/v1/completions", {"prompt": GOLDEN_PROMPT, "max_tokens": 2, "temperature": 0})
    assert ok == 200 and again["usage"]["completion_tokens"] == 2


def test_the_openai_client_sees_its_own_error_types(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="s", messages=[], max_tokens=2)
    assert bad.value.status_code == 400


def test_api_key_and_sampling_defaults_from_the_command_line(stories_path, model):
    srv = ServerProcess("-m", str(stories_path), "--api-key", "sesame", "--temp", "0", "-n", "12")
    try:
        assert srv.request("GET", "/health") == (200, {"status": "ok"})
        for path in ("/v1/models", "/slots", "/lora-adapters"):
            status, reply = srv.request("GET", path)
            assert status == 401 and reply["error"]["type"] == "authentication_error"
        status, _ = srv.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert status == 401
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        assert srv.client(api_key="sesame").models.list().data[0].id == "stories260K.gguf"
        reply = srv.client(api_key="sesame").completions.create(model="s", prompt=GOLDEN_PROMPT, max_tokens=3,
                                                                temperature=0)
        assert reply.usage.completion_tokens == 3
        status, reply = srv.request("POST", "/v1/completions", {"prompt": GOLDEN_PROMPT},
                                    headers={"X-Api-Key": "sesame"})  # greedy, 12 tokens: the server's defaults
        assert status == 200 and reply["choices"][0]["text"] == llamapy.generate(model, GOLDEN_PROMPT, 12, temperature=0)
    finally:
        srv.stop()


# ---- adapters -----------------------------------------------------------------------------------
def test_adapters_per_request_and_loaded_while_serving(server, model, lora_dir):
    client = server.client()
    base = llamapy.generate(model, GOLDEN_PROMPT, 24, temperature=0)
    with_one = llamapy.generate(model, GOLDEN_PROMPT, 24, temperature=0, lora=[(str(lora_dir / "adapter1.gguf"), 1.0)])
    assert with_one != base
    status, adapters = server.request("GET", "/lora-adapters")
    assert status == 200 and adapters == [{"id": 0, "path": str(lora_dir / "adapter1.gguf"), "scale": 0.0}]

    def complete(**extra) -> str:
        reply = client.completions.create(model="s", prompt=GOLDEN_PROMPT, max_tokens=24, temperature=0,
                                          extra_body=extra)
        return reply.choices[0].text

    assert complete() == base  # loaded at scale 0
    assert complete(lora=[{"id": 0, "scale": 1.0}]) == with_one
    status, _ = server.request("POST", "/lora-adapters", [{"id": 0, "scale": 1.0}])
    assert status == 200 and complete() == with_one
    server.request("POST", "/lora-adapters", [{"id": 0, "scale": 0.0}])
    # a new adapter, from under --lora-dir, while serving
    status, loaded = server.request("POST", "/lora-adapters/load", {"path": "adapter2.gguf"})
    assert status == 200 and loaded["id"] == 1 and loaded["scale"] == 0.0
    with_two = llamapy.generate(model, GOLDEN_PROMPT, 24, temperature=0, lora=[(str(lora_dir / "adapter2.gguf"), 1.0)])
    assert complete(lora=[{"id": 1, "scale": 1.0}]) == with_two != with_one
    assert complete() == base
    for path in ("../../etc/passwd", "/etc/hostname", str(lora_dir / ".." / "x.gguf")):
        status, reply = server.request("POST", "/lora-adapters/load", {"path": path})
        assert status == 403 and "not under the --lora-dir" in reply["error"]["message"], reply
    status, reply = server.request("POST", "/lora-adapters/load", {"path": "missing.gguf"})
    assert status == 404


def test_tokenize_detokenize_models_health(server, model):
    status, reply = server.request("POST", "/tokenize", {"content": GOLDEN_PROMPT})
    assert status == 200 and reply["tokens"] == model.vocab.tokenize(GOLDEN_PROMPT, add_special=False)
    status, back = server.request("POST", "/detokenize", {"tokens": reply["tokens"]})
    assert back["content"].strip() == GOLDEN_PROMPT
    status, pieces = server.request("POST", "/tokenize", {"content": "Once", "with_pieces": True})
    assert pieces["tokens"][0]["piece"].strip() == "Once"
    assert server.request("GET", "/health") == (200, {"status": "ok"})
    status, models = server.request("GET", "/v1/models")
    assert models["data"][0]["meta"]["n_ctx_slot"] == 256 and models["data"][0]["meta"]["n_slots"] == 4
    status, props = server.request("GET", "/props")
    assert status == 200 and props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 256
    assert props["model_path"].endswith("stories260K.gguf") and "im_start" in props["chat_template"]


def test_command_line_errors_are_one_line(stories_path, tmp_path, monkeypatch):
    """In this process (the other tests here start the server as a child process): a bad
    command line that got as far as serving fails the test instead of serving for ever."""
    import uvicorn

    def served(self, *a, **kw):
        raise AssertionError("the server started serving")
    monkeypatch.setattr(uvicorn.Server, "run", served)
    run = lambda *a: tool_process("server", *a)  # noqa: E731
    for args, message in [(["-m", str(tmp_path / "none.gguf")], "none.gguf"),
                          (["-m", str(stories_path), "-np", "0"], "-np must be >= 1"),
                          (["-m", str(stories_path), "--lora-dir", str(tmp_path / "nowhere")], "not a directory"),
                          (["-m", str(stories_path), "-c", "4", "-np", "4"], "no room")]:
        proc = run(*args)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        assert message in proc.stderr.strip().splitlines()[-1], proc.stderr


@pytest.mark.slow
def test_gemma3_greedy_is_llama_completions_and_generates(gemma3_path):
    """Acceptance 1 on the real model: each recorded llama-completion greedy text (prompt echoed)
    starts with the server's first 24 tokens, from 2 slots at once, and one streamed (the first
    prompt's whole 64 tokens: generate()'s test in test_generate.py); a chat answer equals
    chat_completion's."""
    golden = json.loads((REPO_ROOT / "tests" / "data" / "llama_cpp_gemma3_greedy.json").read_text(encoding="utf-8"))
    model = llamapy.load_model(gemma3_path)
    srv = ServerProcess("-m", str(gemma3_path), "-np", "2", "-c", "2048", "-t", "2")
    try:
        client = srv.client()

        def complete(run: dict, stream: bool, n: int) -> str:
            kw = dict(model="g", prompt=run["prompt"], max_tokens=n, temperature=0)
            if stream:
                return run["prompt"] + "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                                               if c.choices)
            return run["prompt"] + client.completions.create(**kw).choices[0].text

        # every prompt once, the first one streamed too: four requests on two slots
        runs = golden["runs"]
        asked = [(run, False, 24) for run in runs] + [(runs[0], True, 24)]
        with ThreadPoolExecutor(2) as pool:
            for (run, _, n), text in zip(asked, pool.map(lambda a: complete(*a), asked)):
                assert len(text) > len(run["prompt"]) + 40 and run["text"].startswith(text)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        want = llamapy.chat_completion(model, messages, 24, temperature=0)["content"]
        reply = client.chat.completions.create(model="g", messages=messages, max_tokens=24, temperature=0)
        assert reply.choices[0].message.content == want and len(want) > 20
    finally:
        srv.stop()
