"""Tokens to text as they arrive: only text that can no longer change is released (a token may
end in the middle of a multi-byte character), and stop sequences end the text where they start
without any part of them ever having been released."""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.tokens: list[int] = []
        self.text = ""        # what has been released
        self.stopped = False  # a stop sequence was found

    def push(self, token: int) -> str:
        """Takes one token; returns the text it releases (often "", never part of a stop sequence)."""
        self.tokens.append(token)
        full = self._decoded()
        if self._cut_at_stop(full):
            return self._release(full[: self._stop_at])
        if full.endswith("\ufffd"):
            return ""
        hold = max((len(s) - 1 for s in self.stop), default=0)
        return self._release(full[: max(len(self.text), len(full) - hold)])

    def finish(self) -> str:
        """The text still held back, once no token follows."""
        if self.stopped:
            return ""
        return self._release(self._decoded().rstrip("\ufffd"))

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def _cut_at_stop(self, full: str) -> bool:
        if not self.stop:
            return False
        # A stop sequence can only start in text not released yet (or straddle its start).
        begin = max(0, len(self.text) - max(len(s) for s in self.stop))
        found = [i for s in self.stop if (i := full.find(s, begin)) >= 0]
        if not found:
            return False
        self.stopped, self._stop_at = True, max(min(found), len(self.text))
        return True

    def _release(self, upto: str) -> str:
        new = upto[len(self.text):]
        self.text = upto if len(upto) >= len(self.text) else self.text
        return new
