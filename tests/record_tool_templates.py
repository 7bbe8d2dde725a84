"""Record llama.cpp's rendering of conversations with tools, for test_tool_calls.

    python tests/record_tool_templates.py LLAMA_CPP_BIN

Each tool-capable chat template in ../shared/data/chat_templates (Qwen 2.5, Qwen 3, Llama 3.2,
Mistral Nemo) is given to a llama-server run on stories260K (--chat-template-file), which
renders the conversations below through /apply-template with OpenAI's `tools`: a first
question, the assistant's tool calls (OpenAI's shape: arguments as a JSON string) and the
tools' results, the turn after them. A conversation a template refuses (Llama 3.2 takes one
call per message) is recorded with llama-server's status and message. The result goes to
tests/data/llama_server_tool_templates.json.
"""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from record_chat_templates import post, start_server  # noqa: E402

DATA = Path(__file__).parent / "data"
OUT = DATA / "llama_server_tool_templates.json"
SHARED = Path(__file__).resolve().parents[2] / "shared"
TEMPLATES = {
    "qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "llama3.2": "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "mistral-nemo": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city's name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]


def call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
WEATHER_CALL = {"role": "assistant", "content": "", "tool_calls": [call("Call00001", "get_weather", {"city": "Paris"})]}
WEATHER_RESULT = {"role": "tool", "tool_call_id": "Call00001", "content": '{"temperature": 21, "sky": "clear"}'}
BOTH_CALLS = {"role": "assistant", "content": "", "tool_calls": [
    call("Call00001", "get_weather", {"city": "Paris", "unit": "celsius"}), call("Call00002", "get_time", {"city": "Paris"})]}
TIME_RESULT = {"role": "tool", "tool_call_id": "Call00002", "content": '{"time": "14:05"}'}

CONVERSATIONS: list[list[dict]] = [
    [QUESTION],
    [{"role": "system", "content": "You are a helpful assistant."}, QUESTION],
    [QUESTION, WEATHER_CALL, WEATHER_RESULT],
    [QUESTION, WEATHER_CALL, WEATHER_RESULT, {"role": "assistant", "content": "It is 21 degrees and clear in Paris."},
     {"role": "user", "content": "And what time is it there?"}],
    [QUESTION, BOTH_CALLS, WEATHER_RESULT, TIME_RESULT],
    [QUESTION, {**WEATHER_CALL, "content": "Let me look that up."}, WEATHER_RESULT],
]


def render(port: int, messages: list[dict]) -> dict:
    try:
        return {"prompt": post(port, "/apply-template", {"messages": messages, "tools": TOOLS})["prompt"]}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": json.loads(e.read())["error"]["message"]}


def main(bin_dir: str) -> None:
    model = SHARED / "models" / "stories260K.gguf"
    out = {}
    for name, file in TEMPLATES.items():
        server, port = start_server(Path(bin_dir), model, ["--chat-template-file",
                                                           str(SHARED / "data" / "chat_templates" / file)])
        try:
            out[name] = {"template": file, "renderings": [render(port, messages) for messages in CONVERSATIONS]}
        finally:
            server.terminate()
            server.wait(timeout=30)
    version = subprocess.run([str(Path(bin_dir) / "llama-server"), "--version"], capture_output=True, text=True)
    source = " ".join((version.stdout + version.stderr).split("\n")[0].split()) or "unknown version"
    OUT.write_text(json.dumps({"source": f"llama.cpp ({source}): llama-server /apply-template with tools",
                               "tools": TOOLS, "conversations": CONVERSATIONS, "templates": out},
                              indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{len(CONVERSATIONS)} conversations x {len(out)} templates -> {OUT}")


if __name__ == "__main__":
    main(sys.argv[1])
