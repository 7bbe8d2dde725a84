"""llamapy-tokenize: tokenize a training corpus once, in parallel, into token shards that
llamapy-finetune and llamapy-train read with `--data DIR` as they train (llamapy.token_shards):
a corpus larger than memory trains with the memory of a small one.

    llamapy-tokenize -m MODEL TEXT|JSONL|DIR [...] -o DATA_DIR

Texts become one token stream (each file as `-f` tokenizes it); JSONL files become samples
with their learn masks (conversations rendered with the chat template, --mask-prompt as in
training). A directory stands for its .txt, .md, .raw and .jsonl files.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamapy.errors import InputError
from llamapy.model import load_model
from llamapy.samples import is_jsonl
from llamapy.token_shards import SHARD_TOKENS, input_files, write_token_shards

from . import flags as F
from .args import DATA, OUTPUT, Tool, flag
from .common import chat_template_for, log, paths, progress_stream, warn

tool = Tool("llamapy-tokenize", llama_cpp=[])

Inputs = Annotated[Optional[list[Path]], typer.Argument(metavar="TEXT|JSONL|DIR...", show_default=False,
                                                        help="the texts, JSONL files or directories to tokenize")]
Output = Annotated[Path, flag("-o", "--output", metavar="DATA_DIR", group=OUTPUT,
                              help="the shard directory to make (it must not exist)")]
Workers = Annotated[Optional[int], flag("-t", "--threads", metavar="N", env="LLAMA_ARG_THREADS", min=1, max=512,
                                        show_default=False, help="processes that tokenize (default: the cores)")]
ShardTokens = Annotated[int, flag("--shard-tokens", metavar="N", group=OUTPUT, min=1,
                                  help="tokens per shard file at most")]
DataFormat = Annotated[Optional[str], flag("--data-format", metavar="text|completions|chat", group=DATA,
                                           show_default=False, help="the samples' format (default: seen per file)")]
MaskPrompt = Annotated[bool, flag("--mask-prompt/--no-mask-prompt", group=DATA,
                                  help="learn only the answers of chat and prompt/completion samples")]


@tool.command
def run(model: F.Model, inputs: Inputs = None, output: Output = Path("data"), threads: Workers = None,
        chat_template: F.ChatTemplate = None, mask_prompt: MaskPrompt = True, data_format: DataFormat = None,
        shard_tokens: ShardTokens = SHARD_TOKENS) -> None:
    """Tokenize TEXT|JSONL|DIR with MODEL's tokenizer into token shards in -o DATA_DIR."""
    if not inputs:
        raise InputError("give the texts, JSONL files or directories to tokenize")
    files = input_files(inputs)
    for f in files:  # declared before the first log line: a --log-file onto a text is refused untouched
        paths().read("TEXT", f)
    m = load_model(model)
    template = None
    if is_jsonl(files[0]) and (chat_template is not None or m.file.get("tokenizer.chat_template")):
        template = chat_template_for(m, chat_template)
    workers = threads or max(1, os.cpu_count() or 1)
    total = sum(f.stat().st_size for f in files)
    log(f"tokenize: {len(files)} file(s), {total / 2**20:.1f} MiB, with {m.path.name}'s tokenizer "
        f"in {workers} process(es)")
    t0 = time.perf_counter()
    report = write_token_shards(files, output, m.vocab, workers=workers, chat_template=template,
                                mask_prompt=mask_prompt, data_format=data_format, shard_tokens=shard_tokens,
                                progress=_Progress(progress_stream(), t0))
    index, seconds = report.index, time.perf_counter() - t0
    if report.invalid_bytes:
        warn(f"{report.invalid_bytes} bytes were not UTF-8; each was replaced by U+FFFD")
    what = f"{index.n_samples} samples, " if index.kind == "samples" else ""
    log(f"tokenize: {what}{index.n_tokens} tokens ({index.dtype}) in {len(index.shards)} shard(s) in {output}, "
        f"{seconds:.1f} s ({total / 2**20 / max(seconds, 1e-9):.1f} MiB/s)")


class _Progress:
    """Bytes tokenized so far: redrawn in place on a terminal, a line every 10 s elsewhere."""

    def __init__(self, stream, t0: float) -> None:
        self.stream, self.t0, self.last = stream, t0, t0
        self.tty = stream is not None and stream.isatty()

    def __call__(self, done: int, total: int) -> None:
        if self.stream is None:
            return
        now = time.perf_counter()
        if not self.tty and now - self.last < 10 and done < total:
            return
        self.last = now
        rate = done / max(now - self.t0, 1e-9)
        eta = (total - done) / rate if rate > 0 else 0.0
        line = (f"tokenize: {done / 2**20:.0f}/{total / 2**20:.0f} MiB ({100 * done / max(total, 1):.0f}%), "
                f"{rate / 2**20:.1f} MiB/s, {eta:.0f} s left")
        end = "\n" if not self.tty or done >= total else "\r"
        self.stream.write(line + ("\033[K" if self.tty else "") + end)
        self.stream.flush()


main = tool.main

if __name__ == "__main__":
    sys.exit(main())
