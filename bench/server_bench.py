"""llamapy-server against llama.cpp's llama-server, side by side: concurrent streaming clients.

    python bench/server_bench.py --llama-server /path/to/llama-server [--model GGUF]
                                 [--clients 1 4 16] [--tokens 128] [--rounds 2] [-np 4] [-t 2]
    python bench/server_bench.py --base /tmp/base ...   # this checkout against another (A/B)

Both servers are started the same way (`-m MODEL -np 4 -c 4096 -t 2`), one at a time, in
alternating rounds (A B A B ...) so that a change in the machine's load hits both. For each
number of clients, each client streams one /v1/completions request of `--tokens` tokens
(`ignore_eos`, greedy, a different short prompt each) and all start together; reported:
aggregate generated tokens per second (all tokens / wall time of the batch of requests) and
the median time to first token. A warm-up request runs first on each server start.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAMES = ("Lily", "Tom", "Ben", "Sue", "Max", "Amy", "Tim", "Sam", "Anna", "Jack", "Mia", "Leo", "Zoe", "Sara", "Bob",
         "Kim", "Ada", "Eve", "Ian", "Joy")


class Running:
    """A server process on a port, stopped at the end."""

    def __init__(self, argv: list[str], port: int, ready: str, cwd: Path | None = None) -> None:
        self.port = port
        env = None if cwd is None else {**os.environ, "PYTHONPATH": str(cwd)}
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd,
                                     env=env)
        self.log: list[str] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("server exited:\n" + "".join(self.log[-30:]))
            self.log.append(line)
            if re.search(ready, line):
                break
        threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stderr], daemon=True).start()
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        for _ in range(600):
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server never healthy")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def stream_one(port: int, prompt: str, tokens: int) -> tuple[float, int, float]:
    """(time to first token, tokens received, end time) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    first, n = None, 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices", []):
            if choice.get("text"):
                n += 1  # one streamed piece per generated token (both servers stream per token)
                if first is None:
                    first = time.perf_counter() - t0
    conn.close()
    return first or float("nan"), n, time.perf_counter()


def scenario(port: int, clients: int, tokens: int) -> tuple[float, float]:
    """(aggregate tokens/s, median TTFT in ms) of `clients` concurrent streams."""
    prompts = [f"Once upon a time, {NAMES[i % len(NAMES)]} went to the market and" for i in range(clients)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: stream_one(port, p, tokens), prompts))
    wall = max(end for _, _, end in results) - t0
    total = sum(n for _, n, _ in results)
    return total / wall, 1e3 * statistics.median(ttft for ttft, _, _ in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    other = ap.add_mutually_exclusive_group(required=True)
    other.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    other.add_argument("--base", type=Path, help="another llamapy checkout (an earlier commit's worktree)")
    ap.add_argument("--model", help="GGUF model (default: Gemma 3 270M Q4_K_M from its package)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-np", type=int, default=4)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-c", type=int, default=4096)
    args = ap.parse_args()
    if args.model is None:
        from llamapy.defaults import default_model_path
        args.model = str(default_model_path(lambda _: None))
    common = ["-m", args.model, "-np", str(args.np), "-c", str(args.c), "-t", str(args.t)]
    ours = [sys.executable, "-m", "llamapy.cli.server", *common]
    other = "base" if args.base else "llama.cpp"
    servers = {
        "llamapy": lambda port: Running([*ours, "--port", str(port)], port, r"listening on", cwd=REPO),
        other: (lambda port: Running([*ours, "--port", str(port)], port, r"listening on", cwd=args.base.resolve()))
        if args.base else
        (lambda port: Running([args.llama_server, *common, "--port", str(port), "--no-webui"], port,
                              r"server is listening|listening on")),
    }
    flags = " ".join(sorted({f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")
                             if f in Path("/proc/cpuinfo").read_text()}))
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {flags}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {Path(args.model).name}, {' '.join(common[2:])}")
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    port = 8731
    for rnd in range(args.rounds):
        order = list(servers) if rnd % 2 == 0 else list(reversed(servers))
        for name in order:
            port += 1
            server = servers[name](port)
            try:
                stream_one(port, "Warm up", 8)
                for clients in args.clients:
                    tps, ttft = scenario(port, clients, args.tokens)
                    results.setdefault((name, clients), []).append((tps, ttft))
                    print(f"round {rnd + 1} {name:9} {clients:3} clients: {tps:8.1f} tokens/s, TTFT median {ttft:7.1f} ms",
                          flush=True)
            finally:
                server.stop()
    print(f"\n| clients | {other} tokens/s | llamapy tokens/s | ratio | {other} TTFT ms | llamapy TTFT ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for clients in args.clients:
        a = [r for r in results[(other, clients)]]
        b = [r for r in results[("llamapy", clients)]]
        a_tps, b_tps = max(x for x, _ in a), max(x for x, _ in b)
        a_ttft, b_ttft = min(y for _, y in a), min(y for _, y in b)
        print(f"| {clients} | {a_tps:.1f} | {b_tps:.1f} | {b_tps / a_tps:.2f}x | {a_ttft:.0f} | {b_ttft:.0f} |")


if __name__ == "__main__":
    main()
