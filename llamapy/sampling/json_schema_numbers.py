"""Integer bounds as GBNF (llama.cpp's build_min_max_int): the decimal integers in [min, max]
written digit by digit, so a model cannot write 1000 where the schema says at most 999.

The alternatives and their order are llama.cpp's, so the grammar text is the same; a bound of
INT64_MIN or INT64_MAX means there is none.
"""
from __future__ import annotations

from .grammar_parser import GrammarError
from .json_schema import INT64_MAX, INT64_MIN

INT_MAX = 2**31 - 1


class _Writer:
    def __init__(self) -> None:
        self.out: list[str] = []

    def w(self, text: str) -> None:
        self.out.append(text)

    def digit_range(self, lo: str, hi: str) -> None:
        self.w(f"[{lo}]" if lo == hi else f"[{lo}-{hi}]")

    def more_digits(self, min_digits: int, max_digits: int) -> None:
        self.w("[0-9]")
        if min_digits == max_digits == 1:
            return
        self.w("{" + str(min_digits))
        if max_digits != min_digits:
            self.w("," + (str(max_digits) if max_digits != INT_MAX else ""))
        self.w("}")

    def uniform_range(self, lo: str, hi: str) -> None:
        """The numbers from `lo` to `hi`, both of the same number of digits."""
        i = 0
        while i < len(lo) and i < len(hi) and lo[i] == hi[i]:
            i += 1
        if i > 0:
            self.w(f'"{lo[:i]}"')
        if i < len(lo) and i < len(hi):
            if i > 0:
                self.w(" ")
            sub_len = len(lo) - i - 1
            if sub_len > 0:
                lo_sub, hi_sub = lo[i + 1:], hi[i + 1:]
                zeros, nines = "0" * sub_len, "9" * sub_len
                to_reached = False
                self.w("(")
                if lo_sub == zeros:
                    self.digit_range(lo[i], chr(ord(hi[i]) - 1))
                    self.w(" ")
                    self.more_digits(sub_len, sub_len)
                else:
                    self.w(f"[{lo[i]}] (")
                    self.uniform_range(lo_sub, nines)
                    self.w(")")
                    if ord(lo[i]) < ord(hi[i]) - 1:
                        self.w(" | ")
                        if hi_sub == nines:
                            self.digit_range(chr(ord(lo[i]) + 1), hi[i])
                            to_reached = True
                        else:
                            self.digit_range(chr(ord(lo[i]) + 1), chr(ord(hi[i]) - 1))
                        self.w(" ")
                        self.more_digits(sub_len, sub_len)
                if not to_reached:
                    self.w(" | ")
                    self.digit_range(hi[i], hi[i])
                    self.w(" ")
                    self.uniform_range(zeros, hi_sub)
                self.w(")")
            else:
                self.w(f"[{lo[i]}-{hi[i]}]")

    def range(self, lo: int, hi: int, decimals_left: int = 16, top_level: bool = True) -> None:
        has_min, has_max = lo != INT64_MIN, hi != INT64_MAX
        if has_min and has_max:
            if lo < 0 and hi < 0:
                self.w('"-" (')
                self.range(-hi, -lo, decimals_left, True)
                self.w(")")
                return
            if lo < 0:
                self.w('"-" (')
                self.range(0, -lo, decimals_left, True)
                self.w(") | ")
                lo = 0
            lo_s, hi_s = str(lo), str(hi)
            for digits in range(len(lo_s), len(hi_s)):
                self.uniform_range(lo_s, "9" * digits)
                lo_s = "1" + "0" * digits
                self.w(" | ")
            self.uniform_range(lo_s, hi_s)
            return
        less_decimals = max(decimals_left - 1, 1)
        if has_min:
            if lo < 0:
                self.w('"-" (')
                self.range(INT64_MIN, -lo, decimals_left, False)
                self.w(") | [0] | [1-9] ")
                self.more_digits(0, decimals_left - 1)
            elif lo == 0:
                if top_level:
                    self.w("[0] | [1-9] ")
                    self.more_digits(0, less_decimals)
                else:
                    self.more_digits(1, decimals_left)
            elif lo <= 9:
                c = str(lo)
                start = "1" if top_level else "0"
                if c > start:
                    self.digit_range(start, chr(ord(c) - 1))
                    self.w(" ")
                    self.more_digits(1, less_decimals)
                    self.w(" | ")
                self.digit_range(c, "9")
                self.w(" ")
                self.more_digits(0, less_decimals)
            else:
                lo_s = str(lo)
                c = lo_s[0]
                if c > "1":
                    self.digit_range("1" if top_level else "0", chr(ord(c) - 1))
                    self.w(" ")
                    self.more_digits(len(lo_s), less_decimals)
                    self.w(" | ")
                self.digit_range(c, c)
                self.w(" (")
                self.range(int(lo_s[1:]), INT64_MAX, less_decimals, False)
                self.w(")")
                if c < "9":
                    self.w(" | ")
                    self.digit_range(chr(ord(c) + 1), "9")
                    self.w(" ")
                    self.more_digits(len(lo_s) - 1, less_decimals)
            return
        if has_max:
            if hi >= 0:
                if top_level:
                    self.w('"-" [1-9] ')
                    self.more_digits(0, less_decimals)
                    self.w(" | ")
                self.range(0, hi, decimals_left, True)
            else:
                self.w('"-" (')
                self.range(-hi, INT64_MAX, decimals_left, False)
                self.w(")")
            return
        raise GrammarError("JSON schema: an integer range needs a minimum or a maximum")


def integer_range(lo: int, hi: int) -> str:
    """The GBNF of the integers from `lo` to `hi` (INT64_MIN / INT64_MAX: unbounded)."""
    writer = _Writer()
    writer.range(lo, hi)
    return "".join(writer.out)
