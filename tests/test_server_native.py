"""llamapy-server's llama-server endpoints (/completion, /infill, /apply-template, /embedding,
/v1/embeddings, /props, /slots) against llama-server's own answers to the same requests on
the same model (tests/data/llama_server_answers.json, recorded by tests/record_llama_server.py
from stories260K with FIM tokens named in its metadata): texts, token ids, log-probabilities,
embeddings (to 1e-4) and the fields a client reads."""
from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import numpy as np
import pytest

from record_llama_server import REQUESTS, RUNS, fim_model
from test_server import ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

ANSWERS = json.loads((Path(__file__).parent / "data" / "llama_server_answers.json").read_text())
FIM = ANSWERS["fim"]
# what llamapy-server reports of llama-server's: its answers' fields, less those of features it has not
# (multimodal prompts, the web UI, the CORS proxy, speculative decoding, tool-call grammars)
NOT_HERE = {"media_marker", "ui", "ui_settings", "chat_template_caps", "model_ftype", "cors_proxy_enabled",
            "chat_format", "reasoning_format", "reasoning_in_content", "generation_prompt", "speculative.types"}


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    model = fim_model(stories_path, tmp_path_factory.mktemp("fim") / "stories260K-fim.gguf")
    srv = ServerProcess("-m", str(model), *RUNS["fim"][1], "-t", "2")
    yield srv
    srv.stop()


def ask(server: ServerProcess, name: str):
    """Our answer to the request llama-server answered as `name` (a stream as its events)."""
    method, path, body = REQUESTS["fim"][name]
    if body is not None and body.get("stream"):
        return 200, stream(server, path, body)
    return server.request(method, path, body)


def stream(server: ServerProcess, path: str, body: dict) -> list[dict]:
    import http.client
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    conn.request("POST", path, body=json.dumps(body))
    text = conn.getresponse().read().decode()
    conn.close()
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]


def keys(answer: dict) -> set[str]:
    return set(answer) - NOT_HERE


# log-probabilities: the logits' rounding (F16 attention products) moves an unlikely
# alternative's by up to ~3e-4
LOGPROB_TOLERANCE = 1e-3


def same_probabilities(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert (a["id"], a["token"], a["bytes"]) == (b["id"], b["token"], b["bytes"])
        assert a["logprob"] == pytest.approx(b["logprob"], abs=LOGPROB_TOLERANCE)
        assert [(t["id"], t["token"], t["bytes"]) for t in a["top_logprobs"]] == \
               [(t["id"], t["token"], t["bytes"]) for t in b["top_logprobs"]]
        assert [t["logprob"] for t in a["top_logprobs"]] == pytest.approx([t["logprob"] for t in b["top_logprobs"]],
                                                                          abs=LOGPROB_TOLERANCE)


# fields whose values are llama-server's too (timings and ids of tasks are the run's own)
SAME = ("content", "tokens", "stop", "tokens_predicted", "tokens_evaluated", "prompt", "has_new_line", "truncated",
        "stop_type", "stopping_word", "tokens_cached", "index")


def same_result(ours: dict, theirs: dict) -> None:
    assert keys(ours) == keys(theirs)
    assert {k: ours[k] for k in SAME if k in theirs} == {k: theirs[k] for k in SAME if k in theirs}
    assert set(ours["timings"]) == set(theirs["timings"])
    settings, want = ours["generation_settings"], theirs["generation_settings"]
    assert keys(settings) == keys(want)
    assert {k: settings[k] for k in keys(want) if k != "seed"} == {k: want[k] for k in keys(want) if k != "seed"}
    if "completion_probabilities" in theirs:
        same_probabilities(ours["completion_probabilities"], theirs["completion_probabilities"])


@pytest.mark.parametrize("name", ["greedy", "stop_word", "end_of_generation", "token_ids", "mixed", "infill"])
def test_completions_are_llama_servers(server, name):
    status, ours = ask(server, name)
    theirs = FIM[name]["answer"]
    assert status == FIM[name]["status"] == 200, ours
    same_result(ours, theirs)


def test_several_prompts_and_sampler_orders(server):
    status, ours = ask(server, "several")
    assert status == 200 and len(ours) == len(FIM["several"]["answer"]) == 2
    for a, b in zip(ours, FIM["several"]["answer"]):
        same_result(a, b)
    for name in ("sampler_order", "sampler_chars"):  # seeded draws through the order asked for
        status, ours = ask(server, name)
        assert status == 200 and ours["content"] == FIM[name]["answer"]["content"]
        assert ours["generation_settings"]["samplers"] == FIM[name]["answer"]["generation_settings"]["samplers"]


def test_the_stream_is_llama_servers(server):
    ours, theirs = ask(server, "streamed")[1], FIM["streamed"]["answer"]
    assert len(ours) == len(theirs)
    for a, b in zip(ours[:-1], theirs[:-1]):
        assert keys(a) == keys(b) and {k: a[k] for k in SAME if k in b} == {k: b[k] for k in SAME if k in b}
        same_probabilities(a["completion_probabilities"], b["completion_probabilities"])
    same_result(ours[-1], theirs[-1])


def test_response_fields_and_slot_choice(server):
    status, ours = ask(server, "fields")
    assert status == 200 and ours == FIM["fields"]["answer"]
    slots = server.request("GET", "/slots")[1]
    assert slots[1]["params"]["n_predict"] == 4 and slots[1]["next_token"][0]["n_decoded"] == 4
    assert {k for s in slots for k in s} >= {k for s in FIM["slots"]["answer"] for k in s}


def test_settings_beyond_a_c_floats_range_are_null_as_llama_server_writes_them(server):
    """A temperature of 1e39 is inf as the C float llama-server keeps: its JSON is null, and /slots
    still answers (found by the server fuzzer: a 500 with a traceback)."""
    status, answer = server.request("POST", "/completion", {"prompt": "Once", "n_predict": 1, "id_slot": 0,
                                                            "temperature": 1e39})
    assert status == 200 and answer["generation_settings"]["temperature"] is None
    status, slots = server.request("GET", "/slots")
    assert status == 200 and slots[0]["params"]["temperature"] is None


def test_apply_template_props_and_the_refusals(server):
    assert ask(server, "apply_template") == (200, FIM["apply_template"]["answer"])
    status, props = server.request("GET", "/props")
    theirs = FIM["props"]["answer"]
    assert status == 200 and keys(props) == keys(theirs)
    same = ("total_slots", "bos_token", "eos_token", "modalities", "endpoint_slots", "endpoint_props",
            "endpoint_metrics", "is_sleeping")
    assert {k: props[k] for k in same} == {k: theirs[k] for k in same}
    assert props["model_path"].endswith(".gguf") and "im_start" in props["chat_template"]
    ours, want = props["default_generation_settings"], theirs["default_generation_settings"]
    assert ours["n_ctx"] == want["n_ctx"] and keys(ours["params"]) == keys(want["params"])
    assert {k: ours["params"][k] for k in keys(want["params"])} == {k: want["params"][k] for k in keys(want["params"])}
    status, refused = server.request("POST", "/completion", {"prompt": "x", "mirostat": 2})
    assert status == 400 and "mirostat is not supported" in refused["error"]["message"]
    status, refused = server.request("POST", "/completion", {"prompt": "x", "samplers": ["top_k", "tfs_z"]})
    assert status == 400 and "'tfs_z'" in refused["error"]["message"]


def test_embeddings_are_llama_servers(server):
    for name in ("embedding", "embeddings_list", "embedding_raw"):
        status, ours = ask(server, name)
        theirs = FIM[name]["answer"]
        assert status == 200 and [a["index"] for a in ours] == [b["index"] for b in theirs]
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-4)
    status, ours = ask(server, "v1_embeddings")
    theirs = FIM["v1_embeddings"]["answer"]
    assert status == 200 and {k: ours[k] for k in ("model", "object", "usage")} == \
           {k: theirs[k] for k in ("model", "object", "usage")}
    for a, b in zip(ours["data"], theirs["data"]):
        assert keys(a) == keys(b) and a["index"] == b["index"]
        np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-4)
    status, ours = ask(server, "v1_embeddings_base64")
    theirs = FIM["v1_embeddings_base64"]["answer"]["data"][0]
    assert status == 200 and ours["data"][0]["encoding_format"] == "base64"
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(ours["data"][0]["embedding"]), "<f4"),
                               np.frombuffer(base64.b64decode(theirs["embedding"]), "<f4"), atol=1e-4)


def test_openai_clients_embeddings_create(server):
    """The openai client asks for base64 and decodes it: the vectors llama-server gives."""
    reply = server.client().embeddings.create(model="stories", input=["Lily had a cat.", "Tom saw a dog"])
    theirs = FIM["v1_embeddings"]["answer"]
    assert reply.usage.prompt_tokens == theirs["usage"]["prompt_tokens"]
    for a, b in zip(reply.data, theirs["data"]):
        np.testing.assert_allclose(a.embedding, b["embedding"], atol=1e-4)


def test_openai_usage_counts_as_llama_server(server):
    status, ours = ask(server, "v1_completion_eos")
    theirs = FIM["v1_completion_eos"]["answer"]
    assert status == 200 and ours["choices"][0]["text"] == theirs["choices"][0]["text"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (the cached ones depend on the slots' past)
    assert {k: ours["usage"][k] for k in counts} == {k: theirs["usage"][k] for k in counts}
    assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"] == "stop"


def test_each_request_has_a_log_line(server):
    server.request("POST", "/completion", {"prompt": "Once upon a time", "n_predict": 3, "temperature": 0})
    server.request("GET", "/health")
    deadline = time.monotonic() + 5  # the line is written once the answer is sent
    while time.monotonic() < deadline and not any(line.startswith("request: GET /health") for line in server.log):
        time.sleep(0.05)
    lines = [line for line in server.log if line.startswith("request: ")]
    assert any(line.startswith("request: POST /completion 127.0.0.1 200: 5 prompt tokens") and
               ", 3 generated, " in line for line in lines), lines
    assert any(line.startswith("request: GET /health 127.0.0.1 200, ") for line in lines)


def test_without_fim_tokens_or_pooling_llama_servers_refusals(stories_path):
    """On plain stories260K with pooling none (an in-process app): /infill and /v1/embeddings
    are refused with llama-server's words, /embedding gives each token's vector."""
    from starlette.testclient import TestClient

    import llamapy
    from llamapy.chat import ChatTemplate
    from llamapy.server.adapters import Adapters
    from llamapy.server.app import Server, create_app
    from llamapy.server.engine import Engine
    model = llamapy.load_model(stories_path)
    engine = Engine(llamapy.Context(model, n_ctx=256, pooling_type="none", flash_attn=False))
    server = Server(engine, ChatTemplate.named("chatml", model.vocab), "stories", Adapters(engine, [], None),
                    embedding=True)
    engine.start()
    try:
        with TestClient(create_app(server)) as client:
            none = ANSWERS["none"]
            for name in ("infill_refused", "v1_embeddings_refused"):
                _, path, body = REQUESTS["none"][name]
                reply = client.post(path, json=body)
                assert reply.status_code == none[name]["status"] and reply.json() == none[name]["answer"]
            reply = client.post("/embedding", json=REQUESTS["none"]["embedding"][2])
            np.testing.assert_allclose(reply.json()[0]["embedding"], none["embedding"]["answer"][0]["embedding"],
                                       atol=1e-4)
    finally:
        engine.stop()
