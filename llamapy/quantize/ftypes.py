"""llama.cpp's file types (`llama_ftype`): the names and numbers llama-quantize takes, and the
tensor type each one quantizes to by default.

The table is llama-quantize's QUANT_OPTIONS, in its order (which decides what a number
means when two names share it: `15` is `Q4_K`, the alias listed before `Q4_K_M`). The file
types whose tensor types llamapy has no quantizer for (the IQ family but IQ4_NL, the TQ,
MXFP4, NVFP4, Q1_0 and Q2_0 families) are known by name so that they are refused as such,
not as typos.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from ggmlpy import GGMLType

from ..errors import InputError


class FileType(IntEnum):
    """llama.h's `enum llama_ftype` (the value of general.file_type)."""

    ALL_F32 = 0
    MOSTLY_F16 = 1
    MOSTLY_Q4_0 = 2
    MOSTLY_Q4_1 = 3
    MOSTLY_Q8_0 = 7
    MOSTLY_Q5_0 = 8
    MOSTLY_Q5_1 = 9
    MOSTLY_Q2_K = 10
    MOSTLY_Q3_K_S = 11
    MOSTLY_Q3_K_M = 12
    MOSTLY_Q3_K_L = 13
    MOSTLY_Q4_K_S = 14
    MOSTLY_Q4_K_M = 15
    MOSTLY_Q5_K_S = 16
    MOSTLY_Q5_K_M = 17
    MOSTLY_Q6_K = 18
    MOSTLY_IQ2_XXS = 19
    MOSTLY_IQ2_XS = 20
    MOSTLY_Q2_K_S = 21
    MOSTLY_IQ3_XS = 22
    MOSTLY_IQ3_XXS = 23
    MOSTLY_IQ1_S = 24
    MOSTLY_IQ4_NL = 25
    MOSTLY_IQ3_S = 26
    MOSTLY_IQ3_M = 27
    MOSTLY_IQ2_S = 28
    MOSTLY_IQ2_M = 29
    MOSTLY_IQ4_XS = 30
    MOSTLY_IQ1_M = 31
    MOSTLY_BF16 = 32
    MOSTLY_TQ1_0 = 36
    MOSTLY_TQ2_0 = 37
    MOSTLY_MXFP4_MOE = 38
    MOSTLY_NVFP4 = 39
    MOSTLY_Q1_0 = 40
    MOSTLY_Q2_0 = 41


GUESSED = 1024  # llama.cpp's mark on a file type guessed from the tensors (no general.file_type)


@dataclass(frozen=True)
class QuantOption:
    """One of llama-quantize's types: its name, the file type it writes and its description."""

    name: str
    ftype: FileType
    description: str


F = FileType
QUANT_OPTIONS: tuple[QuantOption, ...] = (
    QuantOption("Q1_0", F.MOSTLY_Q1_0, " 1.125 bpw quantization"),
    QuantOption("Q2_0", F.MOSTLY_Q2_0, " 2.25 bpw quantization (group 64)"),
    QuantOption("Q4_0", F.MOSTLY_Q4_0, " 4.34G, +0.4685 ppl @ Llama-3-8B"),
    QuantOption("Q4_1", F.MOSTLY_Q4_1, " 4.78G, +0.4511 ppl @ Llama-3-8B"),
    QuantOption("MXFP4_MOE", F.MOSTLY_MXFP4_MOE, " MXFP4 MoE"),
    QuantOption("Q5_0", F.MOSTLY_Q5_0, " 5.21G, +0.1316 ppl @ Llama-3-8B"),
    QuantOption("Q5_1", F.MOSTLY_Q5_1, " 5.65G, +0.1062 ppl @ Llama-3-8B"),
    QuantOption("IQ2_XXS", F.MOSTLY_IQ2_XXS, " 2.06 bpw quantization"),
    QuantOption("IQ2_XS", F.MOSTLY_IQ2_XS, " 2.31 bpw quantization"),
    QuantOption("IQ2_S", F.MOSTLY_IQ2_S, " 2.5  bpw quantization"),
    QuantOption("IQ2_M", F.MOSTLY_IQ2_M, " 2.7  bpw quantization"),
    QuantOption("IQ1_S", F.MOSTLY_IQ1_S, " 1.56 bpw quantization"),
    QuantOption("IQ1_M", F.MOSTLY_IQ1_M, " 1.75 bpw quantization"),
    QuantOption("TQ1_0", F.MOSTLY_TQ1_0, " 1.69 bpw ternarization"),
    QuantOption("TQ2_0", F.MOSTLY_TQ2_0, " 2.06 bpw ternarization"),
    QuantOption("Q2_K", F.MOSTLY_Q2_K, " 2.96G, +3.5199 ppl @ Llama-3-8B"),
    QuantOption("Q2_K_S", F.MOSTLY_Q2_K_S, " 2.96G, +3.1836 ppl @ Llama-3-8B"),
    QuantOption("IQ3_XXS", F.MOSTLY_IQ3_XXS, " 3.06 bpw quantization"),
    QuantOption("IQ3_S", F.MOSTLY_IQ3_S, " 3.44 bpw quantization"),
    QuantOption("IQ3_M", F.MOSTLY_IQ3_M, " 3.66 bpw quantization mix"),
    QuantOption("Q3_K", F.MOSTLY_Q3_K_M, "alias for Q3_K_M"),
    QuantOption("IQ3_XS", F.MOSTLY_IQ3_XS, " 3.3 bpw quantization"),
    QuantOption("Q3_K_S", F.MOSTLY_Q3_K_S, " 3.41G, +1.6321 ppl @ Llama-3-8B"),
    QuantOption("Q3_K_M", F.MOSTLY_Q3_K_M, " 3.74G, +0.6569 ppl @ Llama-3-8B"),
    QuantOption("Q3_K_L", F.MOSTLY_Q3_K_L, " 4.03G, +0.5562 ppl @ Llama-3-8B"),
    QuantOption("IQ4_NL", F.MOSTLY_IQ4_NL, " 4.50 bpw non-linear quantization"),
    QuantOption("IQ4_XS", F.MOSTLY_IQ4_XS, " 4.25 bpw non-linear quantization"),
    QuantOption("Q4_K", F.MOSTLY_Q4_K_M, "alias for Q4_K_M"),
    QuantOption("Q4_K_S", F.MOSTLY_Q4_K_S, " 4.37G, +0.2689 ppl @ Llama-3-8B"),
    QuantOption("Q4_K_M", F.MOSTLY_Q4_K_M, " 4.58G, +0.1754 ppl @ Llama-3-8B"),
    QuantOption("Q5_K", F.MOSTLY_Q5_K_M, "alias for Q5_K_M"),
    QuantOption("Q5_K_S", F.MOSTLY_Q5_K_S, " 5.21G, +0.1049 ppl @ Llama-3-8B"),
    QuantOption("Q5_K_M", F.MOSTLY_Q5_K_M, " 5.33G, +0.0569 ppl @ Llama-3-8B"),
    QuantOption("Q6_K", F.MOSTLY_Q6_K, " 6.14G, +0.0217 ppl @ Llama-3-8B"),
    QuantOption("Q8_0", F.MOSTLY_Q8_0, " 7.96G, +0.0026 ppl @ Llama-3-8B"),
    QuantOption("F16", F.MOSTLY_F16, "14.00G, +0.0020 ppl @ Mistral-7B"),
    QuantOption("BF16", F.MOSTLY_BF16, "14.00G, -0.0050 ppl @ Mistral-7B"),
    QuantOption("F32", F.ALL_F32, "26.00G              @ 7B"),
    QuantOption("COPY", F.ALL_F32, "only copy tensors, no quantizing"),  # after F32: 0 means F32
)

# llama_ftype_get_default_type, for the file types llamapy can write
DEFAULT_TYPE: dict[FileType, GGMLType] = {
    F.ALL_F32: GGMLType.F32, F.MOSTLY_F16: GGMLType.F16, F.MOSTLY_BF16: GGMLType.BF16,
    F.MOSTLY_Q4_0: GGMLType.Q4_0, F.MOSTLY_Q4_1: GGMLType.Q4_1, F.MOSTLY_Q5_0: GGMLType.Q5_0,
    F.MOSTLY_Q5_1: GGMLType.Q5_1, F.MOSTLY_Q8_0: GGMLType.Q8_0, F.MOSTLY_Q2_K: GGMLType.Q2_K,
    F.MOSTLY_Q3_K_S: GGMLType.Q3_K, F.MOSTLY_Q3_K_M: GGMLType.Q3_K, F.MOSTLY_Q3_K_L: GGMLType.Q3_K,
    F.MOSTLY_Q4_K_S: GGMLType.Q4_K, F.MOSTLY_Q4_K_M: GGMLType.Q4_K, F.MOSTLY_Q5_K_S: GGMLType.Q5_K,
    F.MOSTLY_Q5_K_M: GGMLType.Q5_K, F.MOSTLY_Q6_K: GGMLType.Q6_K, F.MOSTLY_IQ4_NL: GGMLType.IQ4_NL,
}

# the file type llama.cpp guesses from a file's most common tensor type (llama_model_loader)
GUESS_FROM_TYPE: dict[GGMLType, FileType] = {
    GGMLType.F32: F.ALL_F32, GGMLType.F16: F.MOSTLY_F16, GGMLType.BF16: F.MOSTLY_BF16,
    GGMLType.Q4_0: F.MOSTLY_Q4_0, GGMLType.Q4_1: F.MOSTLY_Q4_1, GGMLType.Q5_0: F.MOSTLY_Q5_0,
    GGMLType.Q5_1: F.MOSTLY_Q5_1, GGMLType.Q8_0: F.MOSTLY_Q8_0, GGMLType.Q2_K: F.MOSTLY_Q2_K,
    GGMLType.Q3_K: F.MOSTLY_Q3_K_M, GGMLType.Q4_K: F.MOSTLY_Q4_K_M, GGMLType.Q5_K: F.MOSTLY_Q5_K_M,
    GGMLType.Q6_K: F.MOSTLY_Q6_K, GGMLType.IQ4_NL: F.MOSTLY_IQ4_NL,
}


def find_option(text: str) -> QuantOption | None:
    """llama-quantize's try_parse_ftype: a name (any case) or a number, or None. A number is
    the first option with that file type (`15` is Q4_K, `0` is F32); unlike llama-quantize's
    std::stoi, "8bit.gguf" is not the number 8."""
    for option in QUANT_OPTIONS:
        if option.name.lower() == text.strip().lower():
            return option
    try:
        number = int(text)
    except ValueError:
        return None
    return next((option for option in QUANT_OPTIONS if option.ftype == number), None)


def parse_option(text: str | int | FileType) -> QuantOption:
    """The option of a type name or number (InputError when there is none, or when llamapy
    cannot write it)."""
    option = find_option(str(int(text)) if isinstance(text, int) else text)
    if option is None:
        names = ", ".join(o.name for o in QUANT_OPTIONS if o.ftype in DEFAULT_TYPE or o.name == "COPY")
        raise InputError(f"unknown quantization type {text!r}: use one of {names} (or its number)")
    check_writable(option)
    return option


def check_writable(option: QuantOption) -> None:
    if option.ftype == F.MOSTLY_Q2_K_S:
        raise InputError("Q2_K_S needs an importance matrix (--imatrix), which llamapy does not support: "
                         "use Q2_K")
    if option.ftype not in DEFAULT_TYPE:
        raise InputError(f"{option.name}: llamapy has no quantizer for this type (it writes F32, F16, BF16, Q4_0, "
                         "Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and the K-quant mixes Q2_K .. Q6_K)")
