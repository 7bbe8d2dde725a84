"""Small random Hugging Face checkpoints (llama, qwen2, qwen3, gemma3), rebuilt byte for byte
from a seed: the test fixtures of test_convert and the recording script (which runs under
another venv, with transformers and PyTorch) build them with this one module, so the recorded
references are about the very files the tests convert.

What a checkpoint is made of, in tests/data/hf/NAME/:
- the files transformers wrote (config.json, generation_config.json, the shard index, the
  tokenizer files), committed as they are;
- layout.json: each safetensors file's tensors (name, dtype, shape, sha256 of the bytes) in
  the order written, and the file's `__metadata__`; the weights themselves are not committed
  but drawn here from a seed per tensor name (numpy's PCG64) and checked against the sha256s;
- for the qwen checkpoints, tokenizer.json (11 MB: Qwen1.5's real 151,646-token vocabulary) is
  not committed either: it is rebuilt from llama.cpp's vocabulary test file
  shared/data/vocab/ggml-vocab-qwen2.gguf (tokens, merges, Qwen's pre-tokenizer), and
  llama.cpp's convert_hf_to_gguf.py identifies it as Qwen1.5-7B's ("qwen2").

Only numpy, json, gguf and tokenizers are imported: both venvs have them.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data" / "hf"
NAMES = ("llama", "qwen2", "qwen3", "gemma3")
QWEN_VOCAB = ("data", "vocab", "ggml-vocab-qwen2.gguf")  # under shared/

# Qwen1.5 / Qwen2's pre-tokenizer regex, as its tokenizer.json has it
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")

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
    bytes, as the safetensors library writes it), then the tensors' bytes in the given order."""
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


def qwen_tokenizer_json(vocab_gguf: Path) -> str:
    """Qwen1.5's tokenizer.json rebuilt from llama.cpp's vocabulary file: byte-level BPE with
    Qwen's split regex and NFC, the normal tokens and merges, its 3 special tokens."""
    import gguf
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    reader = gguf.GGUFReader(vocab_gguf)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    specials = [i for i, t in enumerate(types) if t == 3]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in specials])
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
    if name.startswith("qwen"):
        (dest / "tokenizer.json").write_text(qwen_tokenizer_json(shared.joinpath(*QWEN_VOCAB)), encoding="utf-8")
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
    array as its item type, length and the sha256 of its items' bytes), a tensor's name, ne,
    type and the sha256 of its bytes. Read with the `gguf` package, as a third party would."""
    import gguf

    reader = gguf.GGUFReader(path)
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        if vtype == gguf.GGUFValueType.ARRAY:
            items = [bytes(field.parts[i]) for i in field.data]
            metadata[key] = {"type": "ARRAY", "item": gguf.GGUFValueType(field.types[1]).name, "len": len(items),
                             "sha256": hashlib.sha256(b"".join(len(x).to_bytes(8, "little") + x
                                                               for x in items)).hexdigest()}
        else:
            value = field.contents()
            metadata[key] = {"type": vtype.name, "value": value}
    tensors = [[t.name, [int(n) for n in t.shape], t.tensor_type.name, hashlib.sha256(t.data.tobytes()).hexdigest()]
               for t in reader.tensors]
    return {"metadata": metadata, "tensors": tensors}
