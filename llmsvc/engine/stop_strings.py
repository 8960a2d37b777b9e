"""Stop-string matching on detokenized text, across token boundaries."""
from __future__ import annotations


class StopStringChecker:
    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include = include_stop_str_in_output
        self.max_len = max((len(s) for s in self.stop), default=0)

    def find(self, text: str, num_new_chars: int) -> tuple[int, str] | None:
        """The stop string that ends first within the last `num_new_chars` characters of `text`
        (ties: the first in the list), as if the text had come one character at a time: a stop
        completed earlier wins over one that started earlier (vLLM's rule).

        Returns (length of text to keep, the stop string) or None."""
        if not self.stop or num_new_chars <= 0:
            return None
        best: tuple[int, str] | None = None
        for s in self.stop:
            start = max(0, len(text) - num_new_chars - len(s) + 1)
            idx = text.find(s, start)
            if idx >= 0 and (best is None or idx + len(s) < best[0] + len(best[1])):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        return (idx + len(s) if self.include else idx), s

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that could still grow into a stop string."""
        if not self.stop:
            return 0
        for k in range(min(self.max_len - 1, len(text)), 0, -1):
            suffix = text[-k:]
            if any(s.startswith(suffix) for s in self.stop):
                return k
        return 0
