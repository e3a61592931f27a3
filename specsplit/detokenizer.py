"""Incremental detokenization and stop strings for one streamed request.

Text is decoded from a short window of tokens (the vLLM offsets trick): the delta of a new token
is decode(ids[prefix:]) minus decode(ids[prefix:read]), so tokenizers that drop a leading space
at the start of a decode, or split a character over several byte tokens, stream the same text
that decoding the whole output at once gives. An incomplete UTF-8 character waits for its next
token. With stop strings, the last len(longest stop) - 1 characters are held back until they
can no longer be the start of a stop string, so a stop string is never streamed (unless the
request asks to keep it: include_stop).
"""
from __future__ import annotations

from typing import Callable, Sequence


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (), include_stop: bool = False):
        """include_stop: the text keeps the stop string it ends at (vLLM's include_stop_str_in_output)."""
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""  # all text decoded so far (cut at a stop string)
        self._sent = 0  # characters of text already streamed
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.stopped = False  # a stop string was found; nothing more is taken
        self._stops_end_after = 0  # a stop string counts only if it ends past this many characters

    def add(self, token: int, stops: bool = True) -> None:
        """stops False (min_tokens): no stop string ending in the text so far counts; one that a
        later token completes does, wherever it starts."""
        self.ids.append(token)
        self._advance(final=False, stops=stops)

    def _advance(self, final: bool, stops: bool = True) -> None:
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return
        start = len(self.text)
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        if not stops:
            self._stops_end_after = len(self.text)
        elif self.stop:
            self._find_stop(start)

    def _find_stop(self, start: int) -> None:
        lo = max(0, start - self._hold)
        hits = []
        for s in self.stop:
            i = self.text.find(s, lo)
            while 0 <= i and i + len(s) <= self._stops_end_after:
                i = self.text.find(s, i + 1)
            if i >= 0:
                hits.append((i, i + len(s)))
        if hits:
            first = min(i for i, _ in hits)  # the first to start (the longest of those, with include_stop)
            self.text = self.text[: max(e for i, e in hits if i == first) if self.include_stop else first]
            self.stopped = True

    def next_offset(self) -> int:
        """Where the next token's first byte will fall in the text (characters): past the text so
        far and the characters the tokens still held (they end inside a character) complete, so
        a token that continues a character starts where that character does. A window of
        decodes, as `add`'s, in the text's own terms (a tokenizer's space clean-ups included); none
        where no token is held (the text so far ends where the next token starts)."""
        if self._read == len(self.ids):
            return len(self.text)
        held = self._decode(self.ids[self._prefix:]).rstrip("\ufffd")
        return len(self.text) + len(held) - len(self._decode(self.ids[self._prefix:self._read]))

    def take(self, final: bool = False) -> str:
        """The text that may be streamed now (everything, once the request is finished)."""
        if final and not self.stopped:
            self._advance(final=True)
        end = len(self.text) if (final or self.stopped) else max(self._sent, len(self.text) - self._hold)
        piece = self.text[self._sent:end]
        self._sent = end
        return piece
