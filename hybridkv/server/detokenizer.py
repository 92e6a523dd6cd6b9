"""Incremental detokenization: text for new token ids, O(new tokens) per call, never half a character.

The prefix-offset method: decode a short window that ends at the new tokens and one that ends
before them; the new text is the difference. While the window's text ends in U+FFFD (a multi-byte
character split across tokens), nothing is emitted and the window waits for the next token.
"""
from __future__ import annotations

from typing import Optional


class IncrementalDetokenizer:
    """Feed token ids of one sequence as they come; get back only the newly completed text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decoding window
        self.read_offset = 0  # ids before this are already in the emitted text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int]) -> str:
        """Append `new_ids`; return the text they complete ('' while a character is unfinished)."""
        if self.tokenizer is None or not new_ids:
            return ""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]


class StopHoldback:
    """Streamed text that a later stop string could still swallow is held back until it cannot.

    `push(text)` returns what is safe to send now; `finish(text, final)` returns the rest of the
    engine's final text (stop string cut) after what was sent.
    """

    def __init__(self, stop: list[str]):
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending = ""
        self.sent = ""

    def push(self, text: str) -> str:
        self.pending += text
        cut = len(self.pending) - self.hold
        if cut <= 0:
            return ""
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.sent += out
        return out

    def finish(self, text: str, final: Optional[str]) -> str:
        """The last `text` came with the end: what is left to send of `final`, the engine's text
        for the whole sequence (stop string cut), after what was sent."""
        if final is None:
            final = self.sent + self.pending + text
        rest = final[len(self.sent):] if final.startswith(self.sent) else ""
        self.sent += rest
        self.pending = ""
        return rest
