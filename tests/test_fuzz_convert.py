"""A fuzzer for llamapy-convert: 500 mutated Hugging Face checkpoints, the same ones for a seed.

The bases are the small llama (three shards and an index), gemma3 (one BF16 file) and the
qwen2 / qwen3 variants of the llama one (test_hostile_convert.variant). Each case applies one
to three mutations (`mutate`, from `random.Random(SEED * 100_003 + case)`):
- config.json values: wrong types, NaN and infinities, negatives, zeros, huge and nearby
  numbers, strings with newlines, deep nesting; keys deleted, moved into text_config, the
  rope settings reshaped; the file's text truncated, deeply nested, not UTF-8;
- the shard index: paths absolute, with "..", missing, empty, links out of the folder, a
  tensor named twice, entries removed or added, the index deleted;
- safetensors headers: the length field, offsets, dtypes, shapes (transposed, huge, empty),
  entries duplicated, renamed or deleted, the file truncated.

Each mutated checkpoint goes through llamapy-convert in this process. The outcome must be
exit 0 with a file llamapy loads, or a non-zero exit with exactly one `error:` line and no
output file; never a traceback or another exception, never a hang; every input file (the
checkpoint's and those its index points to outside it) byte for byte as before; and the
peak memory of the whole run bounded (no allocation sized by a config number). A refusal
must come from the converter's own checks, before it writes: the read-back of the written
file (llamapy.save) is a safety net, and a case only it catches is a finding here.
"""
from __future__ import annotations

import copy
import json
import math
import random
import resource
import shutil
from pathlib import Path

import pytest

import llamapy
import llamapy.convert
from llamapy.errors import LlamapyError, SaveError
from test_hostile_cli import run_tool
from test_hostile_convert import INDEX, digests, read_header, variant, write_header
from test_hostile_gguf import deadline

SEED = 47
N_CASES = 500
CASE_SECONDS = 30.0  # a case takes a fraction of a second: only a hang reaches it
OUTTYPES = ("f32", "f32", "f16", "bf16", "q8_0")

# the keys the converter reads (and some it does not), nested rope keys, and the values they get
KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
        "rope_parameters", "rope_scaling", "sliding_window", "sliding_window_pattern", "final_logit_softcapping",
        "attn_logit_softcapping", "architectures", "text_config", "tie_word_embeddings", "bos_token_id",
        "eos_token_id", "pad_token_id", "is_causal", "layer_norm_eps", "_name_or_path", "rope_local_base_freq",
        "original_max_position_embeddings", "model_config", "use_cache")
ROPE_KEYS = ("rope_theta", "rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "beta_fast", "attention_factor", "full_attention",
             "sliding_attention")
VALUES = [None, True, False, 0, 1, 2, 3, -1, -64, 7, 15, 16, 32, 64, 128, 999, 1000, 1008, 2**31 - 1, 2**31, 2**32,
          2**63, 10**12, 10**30, 1e12, 1e300, 0.5, 1e-50, -0.0, 64.0, math.nan, math.inf, -math.inf, "64", "",
          "x\ny", [], {}, [1, 2], {"a": 1}, "llama3", "yarn", "linear", "longrope", ["LlamaForCausalLM"],
          ["Qwen2ForCausalLM"], ["Qwen3ForCausalLM"], ["Gemma3ForCausalLM"], ["GPT2LMHeadModel"]]
INTEGERS = [0, 1, 2, 7, 8, 31, 32, 33, 63, 64, 4096, 2**31 - 1, 2**32, 2**63 - 1, 2**64 - 1]
DTYPES = ["F32", "F16", "BF16", "I64", "F8_E4M3", "f32", "", 5, None, ["F32"]]


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _value(rng: random.Random, old: object) -> object:
    """A hostile value for a key now holding `old`: from VALUES, or near the old number."""
    if isinstance(old, (int, float)) and not isinstance(old, bool) and rng.random() < 0.35:
        return rng.choice([old * 2, old // 2 if isinstance(old, int) else old / 2, old + 1, old - 1, float(old),
                           -old])
    if rng.random() < 0.04:
        return nested(rng.choice([50, 500]))
    return copy.deepcopy(rng.choice(VALUES))


def mutate_config(folder: Path, rng: random.Random) -> str:
    path = folder / "config.json"
    kind = rng.choice(["value", "value", "value", "value", "rope", "delete", "nesting", "text"])
    if kind == "text":
        raw = path.read_bytes()
        choice = rng.choice(["truncate", "deep", "latin1", "empty", "digits", "list"])
        raw = {"truncate": raw[:rng.randrange(len(raw))], "deep": b"[" * 20_000 + b"]" * 20_000,
               "latin1": raw.replace(b"vocab_size", "vocab_s\xefze".encode("latin-1")), "empty": b"",
               "digits": raw.replace(b'"vocab_size": ', b'"vocab_size": ' + b"7" * 6000), "list": b"[" + raw + b"]"
               }[choice]
        path.write_bytes(raw)
        return f"config.json text: {choice}"
    config = json.loads(path.read_text())
    if kind == "value":
        key = rng.choice(KEYS)
        config[key] = value = _value(rng, config.get(key))
        what = f"config {key} = {json.dumps(value)[:60]}"
    elif kind == "rope":
        rope = config.get("rope_parameters")
        rope = rope if isinstance(rope, dict) else config.setdefault("rope_parameters", {})
        target = rope.get("full_attention") if isinstance(rope.get("full_attention"), dict) and rng.random() < 0.5 \
            else rope
        key = rng.choice(ROPE_KEYS)
        target[key] = value = _value(rng, target.get(key))
        what = f"config rope {key} = {json.dumps(value)[:60]}"
    elif kind == "delete":
        key = rng.choice(sorted(config))
        del config[key]
        what = f"config without {key}"
    else:
        choice = rng.choice(["into text_config", "text_config copy", "rope per attention type", "rope as list",
                             "architectures nested"])
        if choice == "into text_config":
            key = rng.choice(KEYS[:10])
            config.setdefault("text_config", {})
            if isinstance(config["text_config"], dict):
                config["text_config"][key] = _value(rng, config.get(key))
        elif choice == "text_config copy":
            config["text_config"] = copy.deepcopy(config)
        elif choice == "rope per attention type":
            config["rope_parameters"] = {"full_attention": config.get("rope_parameters"),
                                         "sliding_attention": rng.choice([None, {}, {"rope_theta": 0.0}, [1]])}
        elif choice == "rope as list":
            config["rope_parameters"] = [config.get("rope_parameters")]
        else:
            config["architectures"] = [config.get("architectures")]
        what = f"config nesting: {choice}"
    path.write_text(json.dumps(config))
    return what


def mutate_index(folder: Path, rng: random.Random, outside: Path) -> str:
    path = folder / INDEX
    if not path.exists():
        return mutate_header(folder, rng)
    index = json.loads(path.read_text())
    weight_map = index["weight_map"]
    name = rng.choice(sorted(weight_map))
    shard = weight_map[name]
    kind = rng.choice(["absolute", "dotdot", "missing", "empty", "link out", "twice", "remove", "add", "delete index",
                       "not a map", "dot slash"])
    if kind in ("absolute", "dotdot"):
        outside.mkdir(exist_ok=True)
        shutil.copyfile(folder / shard, outside / shard)
        target = str(outside / shard) if kind == "absolute" else f"../{outside.name}/{shard}"
        for k, v in weight_map.items():
            if v == shard:
                weight_map[k] = target
    elif kind == "missing":
        weight_map[name] = "model-00009-of-00009.safetensors"
    elif kind == "empty":
        weight_map[name] = rng.choice(["", ".", "/", "\x00"])
    elif kind == "link out":
        outside.mkdir(exist_ok=True)
        shutil.move(folder / shard, outside / shard)
        (folder / shard).symlink_to(outside / shard)
    elif kind == "twice":
        text = json.dumps(index)
        entry = json.dumps(name) + ": " + json.dumps(shard)
        path.write_text(text.replace(entry, entry + ", " + entry, 1))
        return f"index: {name} named twice"
    elif kind == "remove":
        del weight_map[name]
    elif kind == "add":
        weight_map["model.layers.9.self_attn.q_proj.weight"] = shard
    elif kind == "delete index":
        path.unlink()
        return "index deleted"
    elif kind == "not a map":
        index["weight_map"] = rng.choice([None, [], "x", 3])
    else:
        weight_map[name] = "./" + shard
    path.write_text(json.dumps(index))
    return f"index: {kind} ({name})"


def mutate_header(folder: Path, rng: random.Random) -> str:
    shards = sorted(folder.glob("model*.safetensors"))
    if not shards:
        return mutate_config(folder, rng)
    path = rng.choice(shards)
    header, data = read_header(path)
    names = sorted(k for k in header if k != "__metadata__")
    name = rng.choice(names)
    entry = header[name]
    kind = rng.choice(["length", "truncate", "offsets", "dtype", "shape", "shape", "transpose", "duplicate", "rename",
                       "delete", "garbage"])
    length = None
    if kind == "length":
        length = rng.choice([0, 1, 7, len(data), 2**31, 2**63, 2**64 - 1])
    elif kind == "truncate":
        raw = path.read_bytes()
        path.write_bytes(raw[:rng.randrange(len(raw))])
        return f"{path.name} truncated"
    elif kind == "offsets":
        entry["data_offsets"][rng.randrange(2)] = rng.choice(INTEGERS + [-1, len(data), len(data) + 1, 1.5, "0"])
    elif kind == "dtype":
        entry["dtype"] = rng.choice(DTYPES)
    elif kind == "shape":
        shape = entry["shape"]
        choice = rng.choice(["dim", "append", "drop", "empty"])
        if choice == "dim" and shape:
            shape[rng.randrange(len(shape))] = rng.choice(INTEGERS + [-1, True, 1.0])
        elif choice == "append":
            shape.append(rng.choice([1, 2, 2**40]))
        elif choice == "drop" and shape:
            shape.pop()
        else:
            entry["shape"] = rng.choice([[], [0], [0, 64]])
    elif kind == "transpose":
        entry["shape"] = entry["shape"][::-1]
    elif kind == "duplicate":
        raw = json.dumps(header)
        one = json.dumps(name) + ": " + json.dumps(entry)
        raw = raw.replace(one, one + ", " + one, 1).encode()
        raw += b" " * (-len(raw) % 8)
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
        return f"{path.name}: {name} twice"
    elif kind == "rename":
        header[rng.choice(["model.layers.7.self_attn.q_proj.weight", "vision_tower.x.weight", "model.norm.bias",
                           "model.layers.0.self_attn.q_proj.bias", "lm_head.weight", "model.layers.00.mlp.up_proj"
                           ".weight", "language_model.model.layers.0.input_layernorm.weight"])] = header.pop(name)
    elif kind == "delete":
        del header[name]
    else:
        path.write_bytes(len(b"{garbage").to_bytes(8, "little") + b"{garbage" + data)
        return f"{path.name}: header not JSON"
    write_header(path, header, data, length)
    return f"{path.name}: {kind} of {name}" + (f" ({length})" if length is not None else "")


def mutate(folder: Path, rng: random.Random, outside: Path) -> list[str]:
    """One to three mutations of the checkpoint in `folder`, described."""
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        kind = rng.choice(["config", "config", "config", "index", "header", "header"])
        try:
            done.append(mutate_config(folder, rng) if kind == "config" else mutate_index(folder, rng, outside)
                        if kind == "index" else mutate_header(folder, rng))
        except Exception:  # noqa: BLE001 (the mutator reading what an earlier mutation spoiled)
            break  # an earlier mutation left nothing this one can read: the case is what it is
    return done


@pytest.fixture
def late_refusals(monkeypatch) -> list[str]:
    """The refusals of files the converter had written (SaveError from its write_atomically)."""
    late: list[str] = []
    write = llamapy.convert.write_atomically

    def recorded(*args, **kwargs):
        try:
            return write(*args, **kwargs)
        except SaveError as e:
            late.append(str(e))
            raise
    monkeypatch.setattr(llamapy.convert, "write_atomically", recorded)
    return late


def run_case(folder: Path, out: Path, outtype: str, capsys, late: list[str]) -> str:
    """'converted' (the file loads) or 'refused' (one error line, no file, nothing written
    first); AssertionError else."""
    n_late = len(late)
    code, err = run_tool("convert", folder, "-o", out, "--outtype", outtype, capsys=capsys)
    assert "Traceback" not in err, err
    assert len(late) == n_late, f"refused only once written: {late[-1]}"
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    if code == 0:
        assert not errors, err
        try:
            llamapy.load_model(out)
        except LlamapyError as e:
            raise AssertionError(f"exit 0, but the file does not load: {e}") from None
        return "converted"
    assert len(errors) == 1, err
    assert not any(out.parent.iterdir()), f"left {[p.name for p in out.parent.iterdir()]}"
    return "refused"


@pytest.mark.slow
def test_five_hundred_mutated_checkpoints_convert_cleanly_or_are_refused(checkpoints, tmp_path, capsys,
                                                                         late_refusals):
    bases = {"llama": checkpoints("llama"), "gemma3": checkpoints("gemma3")}
    for arch in ("qwen2", "qwen3"):
        bases[arch] = variant(bases["llama"], tmp_path / "bases" / arch, arch)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes: dict[str, int] = {}
    failures: list[str] = []
    for case in range(N_CASES):
        rng = random.Random(SEED * 100_003 + case)
        base = rng.choice(sorted(bases))
        root = tmp_path / f"case{case}"
        folder, outside, out = root / base, root / "outside", tmp_path / "out" / f"case{case}" / "model.gguf"
        shutil.copytree(bases[base], folder)
        out.parent.mkdir(parents=True)
        what = mutate(folder, rng, outside)
        before = digests(root)
        try:
            with deadline(CASE_SECONDS):
                outcome = run_case(folder, out, rng.choice(OUTTYPES), capsys, late_refusals)
            assert digests(root) == before, "an input was modified"
        except BaseException as e:  # every other outcome is a finding, a hang (TimeoutError) included
            if isinstance(e, KeyboardInterrupt):
                raise
            failures.append(f"case {case} ({base}): {'; '.join(what)}: {type(e).__name__}: {str(e)[:300]}")
            outcome = "failed"
        shutil.rmtree(root)
        shutil.rmtree(out.parent)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"fuzz outcomes of {N_CASES} cases: {outcomes}")
    assert not failures, f"{len(failures)} of {N_CASES} cases failed:\n" + "\n".join(failures[:40])
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert grown_mb < 300, f"the fuzz cases raised the peak memory by {grown_mb:.0f} MB"
    assert outcomes.get("refused", 0) > N_CASES // 2 and outcomes.get("converted", 0) > 10, outcomes
