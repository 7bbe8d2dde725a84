"""What the render limits of chat templates cost: every real template in the repository
(shared data/chat_templates, tests/data/gemma3-chat-template.jinja, llama.cpp's built-in
ones) renders each conversation of tests/data/llama_cpp_chat_templates.json in the limited
environment and in the plain sandbox; the outputs must be identical, and the time per
render of each is printed (best of several rounds, as other processes share the machine).

    python bench/chat_template_limits.py [ROUNDS]
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from conftest import shared_path

from llamapy.chat import NAMED_TEMPLATES
from llamapy.chat_sandbox import DEFAULT_LIMITS, PlainEnvironment, TemplateEnvironment, render


def templates() -> dict[str, str]:
    files = sorted(shared_path("data", "chat_templates").glob("*.jinja")) + [REPO / "tests/data/gemma3-chat-template.jinja"]
    return {**{p.stem: p.read_text(encoding="utf-8") for p in files}, **NAMED_TEMPLATES}


def renderer(source: str, limited: bool, conversations: list[dict]) -> Callable[[], list[str]]:
    """A function rendering every conversation with `source` compiled once (limited or not)."""
    template = (TemplateEnvironment() if limited else PlainEnvironment()).from_string(source)
    cases = [{"messages": c["messages"], "add_generation_prompt": c["add_generation_prompt"], "bos_token": "<s>",
              "eos_token": "</s>", "tools": None} for c in conversations]

    def render_all() -> list[str]:
        out = []
        for variables in cases:
            try:
                out.append(render(template, DEFAULT_LIMITS, variables) if limited else template.render(variables))
            except Exception as e:  # noqa: BLE001 - a template refusing a conversation must refuse it in both
                out.append(f"{type(e).__name__}: {e}")
        return out
    return render_all


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    conversations = json.loads((REPO / "tests/data/llama_cpp_chat_templates.json").read_text())["conversations"]
    total = {False: 0.0, True: 0.0}
    print(f"{'template':40s} {'plain µs':>9s} {'limited µs':>10s} {'overhead':>8s}")
    for name, source in templates().items():
        run = {limited: renderer(source, limited, conversations) for limited in (False, True)}
        assert run[True]() == run[False](), name
        best = {}
        for limited in (False, True):
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                run[limited]()
                times.append(time.perf_counter() - t0)
            best[limited] = min(times) / len(conversations)
            total[limited] += best[limited]
        print(f"{name:40s} {best[False] * 1e6:9.1f} {best[True] * 1e6:10.1f} {best[True] / best[False] - 1:8.1%}")
    print(f"{'all (sum of the per-render times)':40s} {total[False] * 1e6:9.1f} {total[True] * 1e6:10.1f} "
          f"{total[True] / total[False] - 1:8.1%}")


if __name__ == "__main__":
    main()
