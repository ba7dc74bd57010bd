"""Incremental detokenization and stop-string matching for one sequence."""
from __future__ import annotations

from meshserve.api.limits import MAX_CHAR_TOKENS
from meshserve.tokenizer import Tokenizer

# Prompt tokens decoded before the first output token: enough for a tokenizer that marks word starts
# (SentencePiece's Metaspace) to render the first token's leading space as it would mid-text.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Emits text as tokens arrive, holding back an incomplete UTF-8 character (byte-level BPE can
    split one across tokens). Decodes a short window per token, not the whole output each step.
    The window starts in the prompt's last tokens, so the first output token is rendered in context
    (a Metaspace tokenizer strips a leading space from text that starts with a token)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_token_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        context = list((prompt_token_ids or [])[-PROMPT_CONTEXT_TOKENS:])
        self.tokens: list[int] = context
        self.prefix_offset = 0  # window start: decoding from here reproduces text already emitted
        self.read_offset = len(context)  # tokens before this are emitted (or are the prompt's)
        # A prompt that ends inside a character (a stream continued from a cut mid-character): its
        # last bytes are rendered with the first output tokens, which complete that character.
        while (self.read_offset > 0 and len(context) - self.read_offset < MAX_CHAR_TOKENS
               and tokenizer.decode(context[:self.read_offset], skip_special_tokens=self.skip).endswith("\ufffd")):
            self.read_offset -= 1

    def add(self, token_id: int) -> str:
        self.tokens.append(token_id)
        return self._advance(final=False)

    def add_many(self, token_ids: list[int]) -> str:
        """What add() of each token in turn returns, together: one window over them all, two
        decodes instead of two a token. Where the window's text ends inside a character (add()
        would hold only that character back, this the whole window) they go one by one."""
        if len(token_ids) <= 1:
            return self.add(token_ids[0]) if token_ids else ""
        before = (len(self.tokens), self.prefix_offset, self.read_offset)
        self.tokens.extend(token_ids)
        delta = self._advance(final=False)
        if self.read_offset == len(self.tokens):
            return delta
        del self.tokens[before[0]:]
        self.prefix_offset, self.read_offset = before[1], before[2]
        return "".join(self.add(t) for t in token_ids)

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
        return delta


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_len` characters of `text`."""
    best = None
    for s in stops:
        i = text.find(s, max(0, len(text) - new_len - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
