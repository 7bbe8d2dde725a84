"""Record llama-server's answers to the requests tests/test_server_native.py and
tests/test_embeddings.py send, for them to compare llamapy-server's and llamapy's with.

    python tests/record_llama_server.py LLAMA_CPP_BIN_DIR

Three llama-server runs, each on a free port, stopped after its requests:

- "fim": stories260K with FIM tokens named in its metadata (`fim_model`: '<', '>' and '|' as
  the prefix, suffix and middle tokens, none of them an end of generation), `-np 2 -c 512
  --embedding --pooling mean`: /completion in its shapes (greedy, streamed, n_probs, stop
  words, an end of generation, mixed and several prompts, a sampler order and a seed),
  /infill, /apply-template, /embedding(s), /v1/embeddings, /v1/completions, /props, /slots;
- "none": stories260K with `--embedding --pooling none`: per-token /embedding;
- "gemma3": Gemma 3 270M Q4_K_M, `--embedding` (pooling none, its own): per-token
  /embedding.

All with `-fa off` (RUNS: why).

Everything goes to tests/data/llama_server_answers.json: per run, per request name, the
method, path, body, status and answer (a stream as its list of events).
"""
from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))  # the repository's llamapy, installed or not

DATA = Path(__file__).parent / "data"
OUT = DATA / "llama_server_answers.json"
FIM_IDS = {"tokenizer.ggml.fim_pre_token_id": 504, "tokenizer.ggml.fim_suf_token_id": 505,
           "tokenizer.ggml.fim_mid_token_id": 506}  # '<', '>', '|': rare, normal tokens of stories260K
PROMPT = "Once upon a time"
CHAT = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell me about Lily."}]

# run -> (model, flags). Flash attention off: llamapy's flash-attention kernels round as ggml's
# tiled kernel does for every ubatch (ggmlpy/backend/cpu/attention/small_head_attention.py), so with it on
# hidden states differ from llama.cpp's by ~1e-3 (stories260K) to ~1 (Gemma 3's large
# activations); without it both sides agree to 1e-4 (Gemma 3: bit for bit).
RUNS = {
    "fim": ("fim", ["-np", "2", "-c", "512", "--embedding", "--pooling", "mean", "-fa", "off"]),
    "none": ("stories260K", ["-np", "1", "-c", "256", "--embedding", "--pooling", "none", "-fa", "off"]),
    "gemma3": ("gemma3", ["-np", "1", "-c", "512", "--embedding", "-fa", "off"]),
}

# run -> request name -> (method, path, body)
REQUESTS: dict[str, dict[str, tuple[str, str, dict | None]]] = {
    "fim": {
        "greedy": ("POST", "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "n_probs": 3,
                                           "return_tokens": True}),
        "streamed": ("POST", "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "stream": True,
                                             "n_probs": 2}),
        "stop_word": ("POST", "/completion", {"prompt": PROMPT, "n_predict": 32, "temperature": 0, "n_probs": 2,
                                              "stop": [" girl", "zzz"]}),
        "end_of_generation": ("POST", "/completion", {"prompt": PROMPT, "n_predict": 60, "temperature": 0,
                                                      "logit_bias": [[2, 20.0]], "return_tokens": True}),
        "token_ids": ("POST", "/completion", {"prompt": [1, 403, 407, 261, 378], "n_predict": 8, "temperature": 0}),
        "mixed": ("POST", "/completion", {"prompt": ["Once upon", 261, " time"], "n_predict": 8, "temperature": 0,
                                          "cache_prompt": False}),
        "several": ("POST", "/completion", {"prompt": ["Lily went to the", "Tom saw a"], "n_predict": 6,
                                            "temperature": 0}),
        "sampler_order": ("POST", "/completion", {"prompt": PROMPT, "n_predict": 24, "temperature": 0.9,
                                                  "seed": 42, "samplers": ["top_k", "min_p", "temperature"],
                                                  "top_k": 20, "min_p": 0.1}),
        "sampler_chars": ("POST", "/completion", {"prompt": PROMPT, "n_predict": 24, "temperature": 0.9, "seed": 7,
                                                  "samplers": "kpt", "top_p": 0.8}),
        "fields": ("POST", "/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "id_slot": 1,
                                           "response_fields": ["content", "generation_settings/n_predict",
                                                               "stop_type", "nowhere"]}),
        "infill": ("POST", "/infill", {"input_prefix": "Lily went to the", "input_suffix": " and was happy.",
                                       "input_extra": [{"filename": "story.txt", "text": "Tom had a red ball."}],
                                       "prompt": " big", "n_predict": 12, "temperature": 0}),
        "apply_template": ("POST", "/apply-template", {"messages": CHAT}),
        "embedding": ("POST", "/embedding", {"content": "Lily had a cat."}),
        "embeddings_list": ("POST", "/embeddings", {"content": ["Lily had a cat.", "Tom saw a dog"]}),
        "embedding_raw": ("POST", "/embedding", {"content": "Lily had a cat.", "embd_normalize": -1}),
        "v1_embeddings": ("POST", "/v1/embeddings", {"input": ["Lily had a cat.", "Tom saw a dog"],
                                                     "model": "stories"}),
        "v1_embeddings_base64": ("POST", "/v1/embeddings", {"input": "Lily had a cat.",
                                                            "encoding_format": "base64"}),
        "v1_completion_eos": ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 60, "temperature": 0,
                                                          "logit_bias": {"2": 20.0}}),
        "props": ("GET", "/props", None),
        "slots": ("GET", "/slots", None),
    },
    "none": {
        "embedding": ("POST", "/embedding", {"content": "Lily had a cat."}),
        "infill_refused": ("POST", "/infill", {"input_prefix": "a", "input_suffix": "b"}),
        "v1_embeddings_refused": ("POST", "/v1/embeddings", {"input": "Lily had a cat."}),
    },
    "gemma3": {
        "embedding": ("POST", "/embedding", {"content": "The capital of France is"}),
    },
}


def fim_model(stories: Path, out: Path) -> Path:
    """stories260K with FIM_IDS set: a model /infill serves (its texts otherwise unchanged)."""
    import gguf_craft
    meta, tensors = gguf_craft.parts(stories)
    for key, token in FIM_IDS.items():
        meta[key] = gguf_craft.u32(token)
    return gguf_craft.write(out, meta, tensors)


def model_path(name: str, work: Path) -> Path:
    from conftest import shared_path
    if name == "gemma3":
        from llamapy.defaults import default_model_path
        return Path(default_model_path(print))
    stories = shared_path("models", "stories260K.gguf")
    return fim_model(stories, work / "stories260K-fim.gguf") if name == "fim" else stories


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port: int, method: str, path: str, body: dict | None) -> tuple[int, object]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    if body is not None and body.get("stream"):
        return response.status, [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
    return response.status, json.loads(text)


def serve(bin_dir: Path, model: Path, flags: list[str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(model), *flags, "-t", "2", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if request(port, "GET", "/health", None)[0] == 200:
                return proc, port
        except (OSError, json.JSONDecodeError, http.client.HTTPException):
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"llama-server on {model} did not start")


def main(bin_dir: Path) -> None:
    answers: dict = {"flags": {run: flags for run, (_, flags) in RUNS.items()}}
    with tempfile.TemporaryDirectory() as work:
        for run, (model_name, flags) in RUNS.items():
            proc, port = serve(bin_dir, model_path(model_name, Path(work)), flags)
            try:
                answers[run] = {}
                for name, (method, path, body) in REQUESTS[run].items():
                    status, answer = request(port, method, path, body)
                    answers[run][name] = {"method": method, "path": path, "body": body, "status": status,
                                          "answer": answer}
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    OUT.write_text(json.dumps(answers, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/record_llama_server.py LLAMA_CPP_BIN_DIR")
    main(Path(sys.argv[1]))
