"""Incremental detokenization and stop-string matching for one sequence."""
from __future__ import annotations

from meshserve.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Emits text as tokens arrive, holding back an incomplete UTF-8 character (byte-level BPE can
    split one across tokens). Decodes a short window per token, not the whole output each step."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix_offset = 0  # window start: decoding from here reproduces text already emitted
        self.read_offset = 0  # tokens before this are fully emitted
        self.text = ""

    def add(self, token_id: int) -> str:
        self.tokens.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        dec = self.tokenizer.decode
        prefix = dec(self.tokens[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = dec(self.tokens[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return delta


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_len` characters of `text`."""
    best = None
    for s in stops:
        i = text.find(s, max(0, len(text) - new_len - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
