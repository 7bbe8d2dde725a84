"""A direct Python transcription of llama.cpp's SPM tokenizer session (llm_tokenizer_spm),
for checking the sentencepiece-based tokenizer of llamapy.vocab on vocabularies for which
no llama.cpp test file exists. Slow (pure Python); used on short texts only.

The algorithm: split the text (spaces escaped to U+2581) into UTF-8 characters; keep a
priority queue of adjacent pairs whose concatenation is a token, by score (higher first,
then leftmost); merge the best pair, re-queue its neighbours, and repeat; finally emit
each symbol's token, or re-split it along the merges that built it, or emit its bytes.
"""
from __future__ import annotations

import heapq


def _utf8_len(byte: int) -> int:
    return (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[byte >> 4]


class SpmReference:
    def __init__(self, texts: list[str], scores: list[float]) -> None:
        self.index = {t.encode("utf-8", "surrogateescape"): i for i, t in enumerate(texts)}
        self.scores = scores

    def byte_token(self, b: int) -> int:
        key = f"<0x{b:02X}>".encode()
        return self.index[key] if key in self.index else self.index[bytes([b])]

    def encode_fragment(self, text: str) -> list[int]:
        data = text.replace(" ", "\u2581").encode("utf-8", "surrogateescape")
        # symbols: [start, length, prev, next]
        syms = []
        pos = 0
        while pos < len(data):
            n = min(_utf8_len(data[pos]), len(data) - pos)
            syms.append([pos, n, len(syms) - 1, len(syms) + 1 if pos + n < len(data) else -1])
            pos += n
        heap: list = []
        rev_merge: dict[bytes, tuple[int, int]] = {}

        def add_bigram(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            piece = data[syms[left][0]:syms[left][0] + syms[left][1] + syms[right][1]]
            tok = self.index.get(piece)
            if tok is None:
                return
            heapq.heappush(heap, (-self.scores[tok], left, right, len(piece)))
            rev_merge[piece] = (left, right)

        for i in range(1, len(syms)):
            add_bigram(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            ls, rs = syms[left], syms[right]
            if ls[1] == 0 or rs[1] == 0 or ls[1] + rs[1] != size:
                continue
            ls[1] += rs[1]
            rs[1] = 0
            ls[3] = rs[3]
            if rs[3] >= 0:
                syms[rs[3]][2] = left
            add_bigram(ls[2], left)
            add_bigram(left, ls[3])

        out: list[int] = []

        def resegment(i: int) -> None:
            piece = data[syms[i][0]:syms[i][0] + syms[i][1]]
            tok = self.index.get(piece)
            if tok is not None:
                out.append(tok)
                return
            merge = rev_merge.get(piece)
            if merge is None:
                out.extend(self.byte_token(b) for b in piece)
                return
            resegment(merge[0])
            resegment(merge[1])

        i = 0 if syms else -1
        while i != -1:
            resegment(i)
            i = syms[i][3]
        return out
