"""Small random Hugging Face checkpoints (llama, llama3, qwen2, qwen3, gemma3), rebuilt byte for byte
from a seed: the test fixtures of test_convert and the recording script (which runs under
another venv, with transformers and PyTorch) build them with this one module, so the recorded
references are about the very files the tests convert.

What a checkpoint is made of, in tests/data/hf/NAME/:
- the files transformers wrote (config.json, generation_config.json, the shard index, the
  tokenizer files), committed as they are;
- layout.json: each safetensors file's tensors (name, dtype, shape, sha256 of the bytes) in
  the order written, and the file's `__metadata__`; the weights themselves are not committed
  but drawn here from a seed per tensor name (numpy's PCG64) and checked against the sha256s;
- for the qwen and llama3 checkpoints, tokenizer.json (11 MB: Qwen1.5's real 151,646-token
  vocabulary; Llama 3's 128,256 tokens) is not committed either: it is rebuilt from llama.cpp's
  vocabulary test files shared/data/vocab/ggml-vocab-{qwen2,llama-bpe}.gguf (tokens, merges,
  the family's pre-tokenizer and post-processor), and llama.cpp's convert_hf_to_gguf.py
  identifies them as Qwen1.5-7B's ("qwen2") and Llama 3's ("llama-bpe").

Only numpy, json and tokenizers are imported: both venvs have them.
"""
from __future__ import annotations

import functools
import hashlib
import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data" / "hf"
NAMES = ("llama", "llama3", "qwen2", "qwen3", "gemma3")

# Qwen1.5 / Qwen2's pre-tokenizer regex, as its tokenizer.json has it
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")

# test_peft's PEFT LoRA adapters (tests/data/hf/NAME-lora, recorded by record_peft_adapters.py)
PEFT_NAMES = ("llama", "qwen2")
PEFT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# and the LoRA llamapy-finetune trains on the llama checkpoint's F32 GGUF for test_peft (the
# recording trains it again): on the first FINETUNE_CHARS characters of the TinyStories sample
FINETUNE_CHARS = 2000
FINETUNE_ARGS = ("--lora-rank", "4", "--lora-alpha", "8", "-c", "32", "--epochs", "1", "-lr", "1e-2", "--seed", "1",
                 "-t", "2")


def tensor_values(checkpoint: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's float32 values: N(0, 1) from a seed of (checkpoint, name), scaled as the
    tensor's role wants (matrices 1/sqrt(fan-in), so activations stay near unit size; norm
    weights near 1, or near 0 for gemma3, whose RMSNorm adds 1; biases small)."""
    seed = int.from_bytes(hashlib.sha256(f"{checkpoint}/{name}".encode()).digest()[:8], "little")
    x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    if name.endswith("norm.weight"):
        return x * np.float32(0.1) + np.float32(0.0 if checkpoint == "gemma3" else 1.0)
    if name.endswith(".bias"):
        return x * np.float32(0.1)
    return x / np.float32(np.sqrt(shape[-1]))


def to_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values stored as a safetensors dtype (BF16: the top 16 bits, rounded to nearest even)."""
    if dtype == "F32":
        return values.astype(np.float32)
    if dtype == "F16":
        return values.astype(np.float16)
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def write_safetensors(path: Path, tensors: list[tuple[str, str, np.ndarray]], metadata: dict[str, str]) -> None:
    """A safetensors file: 8-byte header length, the JSON header (padded with spaces to 8
    bytes, as the safetensors library writes it), then the tensors' bytes in the given order.
    (llamapy.convert.safetensors.write_safetensors writes the same; this module cannot import
    llamapy, which the recording venv lacks.)"""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(data.shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, _, data in tensors:
            f.write(np.ascontiguousarray(data).tobytes())


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_VALUE_TYPES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL",
                8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}
# tensor types a conversion writes: name, elements per block, bytes per block
_TENSOR_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 8: ("Q8_0", 32, 34), 30: ("BF16", 1, 2)}


class _Reader:
    """A GGUF file read front to back: fast where gguf's GGUFReader takes ten seconds for a
    151k-token vocabulary (it builds an object per array item)."""

    def __init__(self, path: Path) -> None:
        self.buf, self.pos = path.read_bytes(), 0

    def take(self, fmt: str):
        (x,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return x

    def raw_string(self) -> bytes:
        n = self.take("<Q")
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def items(self, vtype: int, n: int) -> list[bytes]:
        """n array items' raw bytes."""
        if vtype == 8:
            return [self.raw_string() for _ in range(n)]
        size = struct.calcsize(_SCALARS[vtype])
        self.pos += n * size
        return [self.buf[i:i + size] for i in range(self.pos - n * size, self.pos, size)]


def _read_gguf(path: Path) -> tuple[dict, list, _Reader]:
    """(key -> (type, value or (item type, raw items)), tensor infos, the reader at the data)."""
    r = _Reader(path)
    r.pos = 8  # magic, version
    n_tensors, n_kv = r.take("<Q"), r.take("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = r.raw_string().decode("utf-8")
        vtype = r.take("<I")
        if vtype == 9:
            item, n = r.take("<I"), r.take("<Q")
            metadata[key] = (vtype, (item, r.items(item, n)))
        elif vtype == 8:
            metadata[key] = (vtype, r.raw_string().decode("utf-8"))
        else:
            metadata[key] = (vtype, r.take(_SCALARS[vtype]))
    infos = []
    for _ in range(n_tensors):
        name = r.raw_string().decode("utf-8")
        ne = [r.take("<Q") for _ in range(r.take("<I"))]
        infos.append((name, ne, r.take("<I"), r.take("<Q")))
    alignment = metadata.get("general.alignment", (4, 32))[1]
    r.pos += -r.pos % alignment
    return metadata, infos, r


def gguf_metadata(path: Path) -> dict:
    """The metadata of a GGUF file: scalars and strings as values, arrays as lists."""
    out = {}
    for key, (vtype, value) in _read_gguf(path)[0].items():
        if vtype == 9:
            item, raw = value
            value = ([x.decode("utf-8") for x in raw] if item == 8
                     else [struct.unpack(_SCALARS[item], x)[0] for x in raw])
        out[key] = value
    return out


@dataclass(frozen=True)
class BpeTokenizer:
    """How a published byte-level BPE tokenizer.json is put together, beyond its tokens and merges."""

    vocab: str  # the llama.cpp vocabulary file under shared/data/vocab
    split: str  # the pre-tokenizer's regex
    trim_offsets: bool
    ignore_merges: bool
    bos: str | None  # a BOS token the post-processor adds


BPE_TOKENIZERS = {
    "qwen2": BpeTokenizer("ggml-vocab-qwen2.gguf", QWEN2_SPLIT, False, False, None),
    "llama3": BpeTokenizer("ggml-vocab-llama-bpe.gguf", LLAMA3_SPLIT, True, True, "<|begin_of_text|>"),
}
TOKENIZER_OF = {"qwen2": "qwen2", "qwen3": "qwen2", "llama3": "llama3"}  # checkpoint -> its rebuilt tokenizer.json


@functools.cache
def bpe_tokenizer_json(kind: str, shared: Path) -> str:
    """A real tokenizer.json rebuilt from llama.cpp's vocabulary file: byte-level BPE with the
    family's split regex (and NFC for Qwen), the normal tokens and merges, its special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    spec = BPE_TOKENIZERS[kind]
    meta = gguf_metadata(shared / "data" / "vocab" / spec.vocab)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False, ignore_merges=spec.ignore_merges))
    if kind == "qwen2":
        tok.normalizer = normalizers.NFC()
    level = dict(add_prefix_space=False, trim_offsets=spec.trim_offsets, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(spec.split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(**level)])
    tok.decoder = decoders.ByteLevel(**level)
    specials = [i for i, t in enumerate(types) if t == 3]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in specials])
    if spec.bos is None:
        tok.post_processor = processors.ByteLevel(**level)
    else:
        bos = (spec.bos, tokens.index(spec.bos))
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(**level),
            processors.TemplateProcessing(single=f"{spec.bos}:0 $A:0", pair=f"{spec.bos}:0 $A:0 {spec.bos}:1 $B:1",
                                          special_tokens=[bos])])
    return tok.to_str()


def layout(name: str) -> dict:
    return json.loads((DATA / name / "layout.json").read_text())


def write_checkpoint(name: str, dest: Path, shared: Path) -> Path:
    """Build checkpoint `name` in `dest` (created): the committed files, the tokenizer.json of
    the qwen ones, and the weights drawn from their seeds (each checked against layout.json)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in (DATA / name).iterdir():
        if f.name not in ("layout.json", "reference.json"):
            shutil.copyfile(f, dest / f.name)
    if name in TOKENIZER_OF:
        (dest / "tokenizer.json").write_text(bpe_tokenizer_json(TOKENIZER_OF[name], shared), encoding="utf-8")
    for fname, spec in layout(name)["files"].items():
        tensors = []
        for tname, dtype, shape, sha in spec["tensors"]:
            data = to_dtype(tensor_values(name, tname, tuple(shape)), dtype)
            if hashlib.sha256(data.tobytes()).hexdigest() != sha:
                raise AssertionError(f"{name}/{fname}: {tname} drawn from its seed differs from the recorded one")
            tensors.append((tname, dtype, data))
        write_safetensors(dest / fname, tensors, spec["metadata"])
    return dest


def gguf_listing(path: Path) -> dict:
    """Every metadata key and tensor of a GGUF file, in order: a key's type and value (an
    array as its item type, length and the sha256 of its items' bytes, each after its length
    as 8 bytes), a tensor's name, ne, type and the sha256 of its bytes."""
    meta, infos, r = _read_gguf(path)
    metadata = {}
    for key, (vtype, value) in meta.items():
        if vtype == 9:
            item, raw = value
            metadata[key] = {"type": "ARRAY", "item": _VALUE_TYPES[item], "len": len(raw),
                             "sha256": hashlib.sha256(b"".join(len(x).to_bytes(8, "little") + x
                                                               for x in raw)).hexdigest()}
        else:
            metadata[key] = {"type": _VALUE_TYPES[vtype], "value": value}
    tensors = []
    for name, ne, ttype, offset in infos:
        type_name, block, size = _TENSOR_TYPES[ttype]
        nbytes = int(np.prod(ne, dtype=np.int64)) // block * size
        data = r.buf[r.pos + offset:r.pos + offset + nbytes]
        tensors.append([name, ne, type_name, hashlib.sha256(data).hexdigest()])
    return {"metadata": metadata, "tensors": tensors}


def assert_logits_match(logits: np.ndarray, recorded, tol: float) -> None:
    """`logits` (float64, every position's full row) are the recorded ones (a logits.npz of the
    recorders: seeded ids, each position's top 8, logsumexp) within `tol` of each position's
    largest recorded logit."""
    scale = np.abs(recorded["logits"]).max(axis=1)
    assert (np.abs(logits[:, recorded["ids"]] - recorded["logits"]).max(axis=1) <= tol * scale).all()
    top = np.take_along_axis(logits, recorded["top_ids"], 1)
    assert (np.abs(top - recorded["top_logits"]).max(axis=1) <= tol * scale).all()
    m = logits.max(axis=1)
    logsumexp = np.log(np.exp(logits - m[:, None]).sum(axis=1)) + m
    assert np.allclose(logsumexp, recorded["logsumexp"], rtol=tol, atol=0)


if __name__ == "__main__":  # python tests/hf_checkpoints.py NAME DEST: a checkpoint to try llamapy-convert on
    import sys
    if len(sys.argv) != 3 or sys.argv[1] not in NAMES:
        raise SystemExit(f"usage: python tests/hf_checkpoints.py {{{','.join(NAMES)}}} DEST_FOLDER")
    import os
    shared_dir = Path(os.environ.get("LLAMAPY_SHARED", Path(__file__).resolve().parent.parent.parent / "shared"))
    print(f"wrote {write_checkpoint(sys.argv[1], Path(sys.argv[2]), shared_dir)}")
