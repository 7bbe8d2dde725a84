"""Record llama.cpp's rendering and token ids of chat conversations, for test_chat.

    python tests/record_chat_templates.py LLAMA_CPP_BIN [GEMMA3_GGUF]

LLAMA_CPP_BIN holds llama-server and libllama.so (cmake --build BUILD --target llama-server).
Three templates, each rendered by a llama-server run on Gemma 3 270M through /apply-template:
- gemma3: Gemma 3's own Jinja template (tests/data/gemma3-chat-template.jinja; the GGUF
  file, converted from the base model, carries none), given with --chat-template-file;
- chatml, llama3, gemma, phi3, mistral-v7, mistral-v7-tekken: llama.cpp's built-in
  templates (--no-jinja --chat-template NAME).
Every prompt is then tokenized by libllama (ctypes, vocab only) as llama-server tokenizes a
prompt: llama_tokenize(add_special=true, parse_special=true), with Gemma 3's vocabulary for
gemma3 and gemma (cross-checked against the server's own /tokenize), Qwen2's for chatml,
Llama 3's for llama3, Phi-3's for phi3, Llama 2's for the mistral ones (its </s> ends a turn).
The result goes to tests/data/llama_cpp_chat_templates.json.
"""
from __future__ import annotations

import ctypes as C
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from record_llama_cpp_pre import load_library  # noqa: E402  (llama_model_params as ctypes)

DATA = Path(__file__).parent / "data"
OUT = DATA / "llama_cpp_chat_templates.json"
GEMMA3_TEMPLATE = DATA / "gemma3-chat-template.jinja"
SHARED_VOCAB = Path(__file__).resolve().parents[2] / "shared" / "data" / "vocab"


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


def system(content: str) -> dict:
    return {"role": "system", "content": content}


# (messages, add_generation_prompt); roles alternate so Gemma 3's template accepts them all.
CONVERSATIONS: list[tuple[list[dict], bool]] = [
    ([user("Hello!")], True),
    ([user("What is 2+2?"), assistant("4.")], False),
    ([system("You are a helpful assistant."), user("Name a prime number."), assistant("7 is prime.")], False),
    ([user("Hi"), assistant("Hello! How can I help?"), user("Tell me a joke."),
      assistant("Why did the chicken cross the road? To get to the other side.")], False),
    ([system("Answer in one word."), user("Capital of France?"), assistant("Paris"), user("Of Italy?"), assistant("Rome"),
      user("Of Spain?"), assistant("Madrid")], False),
    ([user("Translate 'cat' to German."), assistant("Katze"), user("And to French?")], True),
    ([system("Réponds en français."), user("Ça va ? Où est la crème brûlée ?"),
      assistant("Très bien, merci ! Elle est au café.")], False),
    ([user("日本語で挨拶してください。"), assistant("こんにちは！お元気ですか？")], False),
    ([user("Emoji test 🎉👍🏽"), assistant("🙂 👨‍👩‍👧 ❤️")], False),
    ([user("مرحبا، كيف حالك؟"), assistant("Привет! Γειά σου! 你好!")], False),
    ([user("Say nothing."), assistant("")], False),
    ([user(""), assistant("You sent an empty message.")], False),
    ([system(""), user("Hello"), assistant("Hi")], False),
    ([user("  padded question  \n"), assistant("\n padded answer \t ")], False),
    ([user("Line one\nLine two\n\nParagraph two."), assistant("First line.\n\nSecond paragraph\nwith a break.")], False),
    ([user("Write code"), assistant("```python\ndef f(x):\n\treturn x * 2\n```")], False),
    ([user("Is <end_of_turn> or <|im_end|> or <|eot_id|> special?"), assistant("It is <|im_end|> text.")], False),
    ([user("Braces {{ not jinja }} {% raw %} and 'quotes' \"double\""), assistant("{\"json\": [1, 2.5, null, true]}")], False),
    ([system("Be terse."), user("Count to five.")], True),
    ([user(" leading space"), assistant(" Sure, with a leading space.")], False),
    ([user("Windows\r\nline endings\r\n"), assistant("OK\r\n")], False),
    ([user("1234567890 3.14159 -42 1e10 $100 50% #tag @user")], True),
    ([user("A long one: " + "the quick brown fox jumps over the lazy dog. " * 20), assistant("Indeed, " + "very long. " * 15)],
     False),
    ([user("Non-breaking\u00a0space inside"), assistant("Ideographic\u3000space inside")], False),
    ([user("\u00a0edge nbsp\u00a0"), assistant("\u3000edge ideographic\u3000")], False),
]

# name -> (llama-server template arguments, vocabulary used for the ids)
TEMPLATES = {
    "gemma3": (["--chat-template-file", str(GEMMA3_TEMPLATE)], None),
    "chatml": (["--no-jinja", "--chat-template", "chatml"], SHARED_VOCAB / "ggml-vocab-qwen2.gguf"),
    "llama3": (["--no-jinja", "--chat-template", "llama3"], SHARED_VOCAB / "ggml-vocab-llama-bpe.gguf"),
    "gemma": (["--no-jinja", "--chat-template", "gemma"], None),
    "phi3": (["--no-jinja", "--chat-template", "phi3"], SHARED_VOCAB / "ggml-vocab-phi-3.gguf"),
    "mistral-v7": (["--no-jinja", "--chat-template", "mistral-v7"], SHARED_VOCAB / "ggml-vocab-llama-spm.gguf"),
    "mistral-v7-tekken": (["--no-jinja", "--chat-template", "mistral-v7-tekken"],
                          SHARED_VOCAB / "ggml-vocab-llama-spm.gguf"),
}


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(bin_dir: Path, model: Path, args: list[str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    server = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port",
                               str(port), "-c", "512", "-np", "1", "-t", "1", "--no-warmup", "--no-prefill-assistant",
                               *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if response.status == 200:
                    return server, port
        except OSError:
            pass
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited with code {server.returncode} ({args})")
        time.sleep(0.1)
    server.kill()
    raise RuntimeError("llama-server did not start")


class LibVocab:
    """A vocabulary loaded by libllama (vocab only), tokenizing as llama-server does a prompt."""

    def __init__(self, lib: C.CDLL, path: Path) -> None:
        params = lib.llama_model_default_params()
        params.vocab_only = True
        self.lib, self.model = lib, lib.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, f"libllama cannot load {path}"
        self.vocab = lib.llama_model_get_vocab(self.model)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        out = (C.c_int32 * (len(data) + 8))()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), out, len(out), True, True)
        assert n >= 0
        return list(out[:n])


def record(bin_dir: Path, gemma3: Path, lib: C.CDLL) -> dict:
    out = {}
    for name, (args, vocab_path) in TEMPLATES.items():
        vocab = LibVocab(lib, vocab_path or gemma3)
        server, port = start_server(bin_dir, gemma3, args)
        try:
            prompts, ids = [], []
            for messages, add_generation_prompt in CONVERSATIONS:
                prompt = post(port, "/apply-template", {"messages": messages,
                                                        "add_generation_prompt": add_generation_prompt})["prompt"]
                tokens = vocab.tokenize(prompt)
                if vocab_path is None:  # the server's own tokenizer must agree
                    served = post(port, "/tokenize", {"content": prompt, "add_special": True, "parse_special": True})
                    assert served["tokens"] == tokens, (prompt, served["tokens"], tokens)
                prompts.append(prompt)
                ids.append(" ".join(map(str, tokens)))
        finally:
            server.terminate()
            server.wait(timeout=30)
        out[name] = {"server_args": [a if a != str(GEMMA3_TEMPLATE) else GEMMA3_TEMPLATE.name for a in args],
                     "vocab": (vocab_path or gemma3).name, "prompts": prompts, "ids": ids}
    return out


def main(bin_dir: str, gemma3: str = "/tmp/llamapy-models/gemma3-270m-q4_k_m.gguf") -> None:
    bin_path = Path(bin_dir)
    lib = load_library(str(bin_path / "libllama.so"))
    templates = record(bin_path, Path(gemma3), lib)
    version = subprocess.run([str(bin_path / "llama-server"), "--version"], capture_output=True, text=True)
    source = " ".join((version.stdout + version.stderr).split("\n")[0].split()) or "unknown version"
    result = {"source": f"llama.cpp ({source}): llama-server /apply-template, then llama_tokenize(add_special=true, "
                        "parse_special=true)",
              "conversations": [{"messages": m, "add_generation_prompt": g} for m, g in CONVERSATIONS],
              "templates": templates}
    OUT.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{len(CONVERSATIONS)} conversations x {len(templates)} templates -> {OUT}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
