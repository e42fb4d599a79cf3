"""Streaming text: incremental detokenization and stop strings.

Detokenizer: the text of the generated ids, handed out as soon as it is stable. Byte-level BPE can split one
character over several tokens, so text that ends in U+FFFD (an incomplete UTF-8 sequence) is held back until the
rest arrives. Each step decodes a short window of ids (from `prefix` to the end) and compares it with the same
window without the new ids, so decoders that treat the first token of a sequence specially see it in both.
Ids the tokenizer does not know (models pad their vocabulary past the tokenizer's last id) decode to nothing.

StopStrings: a stop string is matched on the text, wherever the token boundaries fall. Text that could still be
the start of a stop string is held back until it resolves; on a match, the text before it is released and the
match itself (and anything after it) never is.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.known = len(tokenizer)
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] is the window whose text was last handed out in full
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token: int) -> str:
        """The text newly stable after `token`."""
        if not 0 <= token < self.known:
            return ""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held (an incomplete character included), at the end of the stream."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""


class StopStrings:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.matched: str | None = None  # the stop string found (the earliest in the text)

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (text safe to release, whether a stop string matched)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            at, self.matched = min(hits, key=lambda h: h[0])
            return buf[:at], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
