"""What a grammar costs per token: generation with and without one, alternated, and the parts.

    python bench/grammar_overhead.py [--repeat 3] [--tokens 128] [--threads 2] [--llama-cpp /tmp/llama-build/bin]

Measures, on stories260K (generation) and Gemma 3 270M's 262,144-token vocabulary (the parts):
  gen        llamapy.generate, 128 tokens at temperature 0.8, without a grammar and with
             llama.cpp's grammars/json.gbnf (and a JSON schema), alternated A, B, A, B: tokens/s
  llama.cpp  the same with llama-completion (--grammar-file), when --llama-cpp is given: its
             eval tokens/s (llama_perf's line), alternated likewise
  table      making a vocabulary's token table (pieces decoded, the trie), once per vocabulary
  mask       one whole-vocabulary mask in a state not seen before (the rejected-token path),
             and again from the cache; one sampled-token check (the path taken when the token fits)
Prints every run and the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

import llamapy
from llamapy.sampling.grammar import Grammar
from llamapy.sampling.grammar_vocab import TokenTable

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("LLAMAPY_SHARED", ROOT.parent / "shared"))
STORIES = SHARED / "models" / "stories260K.gguf"
GEMMA = Path.home() / ".cache" / "llamapy" / "gemma-3-270m-q4_k_m.gguf"
JSON_GBNF = ROOT / "tests" / "data" / "llama_cpp_grammars.json"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"]}


def llamapy_run(model, tokens: int, seed: int, threads: int, **constraint) -> float:
    t0 = time.perf_counter()
    done = llamapy.generate(model, "Once upon a time", tokens, temperature=0.8, seed=seed, details=True, n_threads=threads,
                            **constraint)
    return len(done.tokens) / (time.perf_counter() - t0)


def llama_cpp_run(bin_dir: Path, tokens: int, seed: int, threads: int, grammar_file: Path | None) -> float | None:
    args = [str(bin_dir / "llama-completion"), "-m", str(STORIES), "-p", "Once upon a time", "-n", str(tokens),
            "--temp", "0.8", "-s", str(seed), "-t", str(threads), "-no-cnv"]
    args += ["--grammar-file", str(grammar_file)] if grammar_file else ["--ignore-eos"]
    err = subprocess.run(args, capture_output=True, text=True, check=True).stderr
    found = re.search(r"prompt eval time.*?\n.*?eval time =.*?([\d.]+) tokens per second", err)
    return float(found.group(1)) if found else None  # its log thread sometimes exits before the perf lines


def parts(vocab_model: Path, grammar_text: str) -> None:
    vocab = llamapy.load_model(vocab_model).vocab
    t0 = time.perf_counter()
    TokenTable(vocab)
    print(f"table  {vocab_model.name}: {vocab.n_tokens} tokens in {time.perf_counter() - t0:.2f} s")
    grammar = Grammar(grammar_text, vocab)
    matcher = grammar.matcher()
    rng = np.random.default_rng(0)
    cold, warm, check = [], [], []
    for _ in range(8):
        t0 = time.perf_counter()
        mask = matcher.allowed()
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        matcher.allowed()
        warm.append(time.perf_counter() - t0)
        choices = [int(t) for t in np.flatnonzero(mask) if not vocab.is_eog(int(t))]
        if not choices:  # the grammar is done: start again
            matcher.reset()
            continue
        token = choices[rng.integers(len(choices))]
        t0 = time.perf_counter()
        matcher.allows(token)
        check.append(time.perf_counter() - t0)
        matcher.accept(token)
    print(f"mask   new state {statistics.median(cold) * 1e3:.1f} ms, cached {statistics.median(warm) * 1e3:.2f} ms; "
          f"one-token check {statistics.median(check) * 1e6:.0f} us (medians of 8)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-cpp", type=Path, default=None, help="the folder of llama-completion")
    args = ap.parse_args()
    grammar = json.loads(JSON_GBNF.read_text())["grammars"]["json.gbnf"]
    model = llamapy.load_model(STORIES)
    t = args.threads
    llamapy_run(model, 16, 0, t)  # warm-up (compilation)
    llamapy_run(model, 16, 0, t, grammar=grammar)
    results: dict[str, list[float]] = {}
    with Path(os.environ.get("TMPDIR", "/tmp"), "llamapy-bench-json.gbnf").open("w") as f:
        f.write(grammar)
        grammar_file = Path(f.name)
    for r in range(args.repeat):
        runs = {"llamapy, no grammar": lambda: llamapy_run(model, args.tokens, r, t),
                "llamapy, json.gbnf": lambda: llamapy_run(model, args.tokens, r, t, grammar=grammar),
                "llamapy, JSON schema": lambda: llamapy_run(model, args.tokens, r, t, json_schema=SCHEMA)}
        if args.llama_cpp:
            runs["llama.cpp, no grammar"] = lambda: llama_cpp_run(args.llama_cpp, args.tokens, r, t, None)
            runs["llama.cpp, json.gbnf"] = lambda: llama_cpp_run(args.llama_cpp, args.tokens, r, t, grammar_file)
        for name, run in runs.items():
            speed = run()
            if speed is None:
                print(f"gen    {name}: no timing printed")
                continue
            results.setdefault(name, []).append(speed)
            print(f"gen    {name}: {speed:,.0f} tokens/s")
    for name, speeds in results.items():
        print(f"median {name}: {statistics.median(speeds):,.0f} tokens/s")
    parts(STORIES, grammar)
    if GEMMA.exists():
        parts(GEMMA, grammar)


if __name__ == "__main__":
    main()
