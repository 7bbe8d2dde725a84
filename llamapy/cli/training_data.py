"""The data a training command trains, validates and tests on, from its flags: a plain text
cut into overlapping windows, or samples (JSONL in three formats, or a text cut at
--sample-start) packed into windows, conversations rendered with the chat template and
learned on their answers only (--mask-prompt)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ggmlpy.opt import Dataset
from llamapy.dataset import (
    IGNORE,
    PackedWindows,
    read_samples,
    samples_to_windows,
    text_windows,
)
from llamapy.errors import InputError
from llamapy.samples import is_jsonl, unescape
from llamapy.shard_dataset import ShardSampleWindows, shard_windows
from llamapy.token_shards import INDEX, is_shard_dir

from .common import chat_template_for, log, read_text, warn

if TYPE_CHECKING:  # jinja2 is loaded only when a template is used
    from llamapy.chat import ChatTemplate


@dataclass
class TrainingData:
    """Windows to train on; validation windows given apart (else -val-split holds some of
    the training windows out); test windows evaluated once training is done."""

    train: Dataset
    val: Dataset | None = None
    test: Dataset | None = None


@dataclass
class DataOptions:
    """How files become windows (the data flags)."""

    n_ctx: int
    window_bos: bool = False
    data_format: str | None = None
    chat_template: str | None = None
    mask_prompt: bool = True
    sample_start: str | None = None
    include_sample_start: bool = False
    escape: bool = False
    truncate: bool = True


def load_training_data(model, opts: DataOptions, file: Path | None = None, data_dir: Path | None = None,
                       val_file: Path | None = None, default_text: str | None = None) -> TrainingData:
    """The training data of a command: `-f FILE`, or `--data DIR` (token shards made by
    llamapy-tokenize, or train.jsonl, and valid.jsonl and test.jsonl when present), or
    `default_text`; `--val-file` validates on a file."""
    if file is not None and data_dir is not None:
        raise InputError("give the data with -f FILE or with --data DIR, not both")
    loader = _Loader(model, opts)
    test = None
    if data_dir is not None and is_shard_dir(data_dir):
        if val_file is not None:
            raise InputError("--val-file: token shards validate on their last windows (-val-split)")
        return TrainingData(loader.from_shards(data_dir))
    if data_dir is not None:
        if not data_dir.is_dir():
            raise InputError(f"--data: {data_dir} is not a directory (it should hold train.jsonl, and optionally "
                             "valid.jsonl and test.jsonl)")
        if not (data_dir / "train.jsonl").is_file():
            raise InputError(f"--data: {data_dir} has no train.jsonl")
        train = loader.load(data_dir / "train.jsonl", "training")
        if val_file is None and (data_dir / "valid.jsonl").is_file():
            val_file = data_dir / "valid.jsonl"
        test_file = data_dir / "test.jsonl"
    elif file is not None:
        train = loader.load(file, "training")
    elif default_text is not None:
        train = loader.windows_of_text(default_text, "the demo text")
    else:
        raise InputError("give the data to train on with -f FILE or --data DIR")
    val = loader.load(val_file, "validation") if val_file is not None else None
    if data_dir is not None and test_file.is_file():
        test = loader.load(test_file, "test")
    return TrainingData(train, val, test)


class _Loader:
    def __init__(self, model, opts: DataOptions) -> None:
        self.model, self.opts = model, opts
        self._template: ChatTemplate | None = None

    def template(self) -> ChatTemplate:
        if self._template is None:
            self._template = chat_template_for(self.model, self.opts.chat_template)
        return self._template

    def load(self, path: Path, role: str) -> Dataset:
        opts = self.opts
        if not is_jsonl(path) and not opts.sample_start:
            if not path.is_file():
                raise InputError(f"{role} data not found: {path}")
            return self.windows_of_text(read_text(path), str(path))
        sample_start = unescape(opts.sample_start) if opts.sample_start and opts.escape else opts.sample_start
        samples = read_samples(path, opts.data_format, sample_start, opts.include_sample_start, warn)
        needs_template = any(s.is_chat for s in samples)
        ds = samples_to_windows(samples, self.model.vocab, opts.n_ctx,
                                chat_template=self.template() if needs_template else None,
                                mask_prompt=opts.mask_prompt, truncate=opts.truncate)
        _describe_samples(path, role, ds, needs_template and opts.mask_prompt)
        return ds

    def from_shards(self, path: Path) -> Dataset:
        """Windows read from token shards as they train (llamapy.shard_dataset)."""
        opts = self.opts
        if opts.sample_start is not None:
            raise InputError(f"--sample-start: {path} holds token shards, cut into samples (or not) when they were "
                             "tokenized (tokenize JSONL samples, or train on the text with -f)")
        ds = shard_windows(path, self.model.vocab, opts.n_ctx, window_bos=opts.window_bos, truncate=opts.truncate,
                           data_format=opts.data_format)
        if isinstance(ds, ShardSampleWindows):
            index = ds.shards.index
            if opts.chat_template is not None or not opts.mask_prompt:
                template = index.chat_template or "no chat template"
                masked = "answers only" if index.mask_prompt else "whole conversations"
                warn(f"{path}: the samples were rendered and masked when tokenized ({template}, {masked}); "
                     "--chat-template and --mask-prompt apply to llamapy-tokenize")
            if ds.n_truncated:
                log(f"warning: {path}: {ds.n_truncated} of {ds.n_samples} samples are longer than a window of "
                    f"{ds.n_ctx} tokens and are cut (a longer -c keeps them whole; --no-truncate refuses them)")
        log(f"data: {ds.describe()}, read from the shards as they train")
        return ds

    def windows_of_text(self, text: str, name: str) -> Dataset:
        ds = text_windows(self.model.vocab, text, self.opts.n_ctx, self.opts.window_bos)
        log(f"data: {name}: {ds.n_tokens} tokens, {ds.ndata} windows of {ds.n_ctx} (stride {ds.stride})")
        return ds


def _describe_samples(path: Path, role: str, ds: PackedWindows, masked: bool) -> None:
    n_tokens = int(np.count_nonzero(ds.seq >= 0)) + ds.n_samples  # each sample's last token is only a label
    n_learned = int(np.count_nonzero(ds.labels != IGNORE))
    log(f"data: {path} ({role}): {ds.n_samples} samples, {n_tokens} tokens, {n_learned} to learn"
        f"{' (the answers: --no-mask-prompt learns the prompts too)' if masked else ''}, "
        f"packed into {ds.ndata} windows of {ds.n_ctx}")
    if ds.n_truncated:
        log(f"warning: {path}: {ds.n_truncated} of {ds.n_samples} samples are longer than a window of {ds.n_ctx} "
            "tokens and were cut (a longer -c keeps them whole; --no-truncate refuses them)")
    if ds.n_unlearned:
        log(f"warning: {path}: {ds.n_unlearned} of {ds.n_samples} samples are cut before their first token to "
            "learn and teach nothing (a longer -c keeps them)")
