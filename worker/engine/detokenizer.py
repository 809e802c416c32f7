"""Incremental detokenization and stop strings.

Text is released only when it is final: a token that ends in the middle of a UTF-8 character
(the tokenizer decodes it as U+FFFD) waits for the next token, and the tail that could still be
the start of a stop string is held back until it cannot match any more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Prompt tokens decoded before the output, so the first output token gets the spacing it has
# in context (sentencepiece drops a leading space at the start of a decode).
_CONTEXT_TOKENS = 5


@dataclass
class IncrementalDetokenizer:
    tokenizer: object  # a transformers tokenizer
    prompt_token_ids: list[int]
    stop_strings: list[str]
    text: str = ""  # all final text so far (stop string cut off once matched)
    num_emitted_chars: int = 0  # how much of `text` has been handed out as deltas
    _ids: list[int] = field(init=False)
    _prefix_offset: int = field(init=False)
    _read_offset: int = field(init=False)
    _prefix_text: str | None = field(init=False, default=None)  # decode of ids[prefix:read], cached

    def __post_init__(self) -> None:
        self._ids = list(self.prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._hold = max((len(s) for s in self.stop_strings), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add_tokens(self, token_ids: list[int], final: bool = False, check_stop: bool = True) -> str | None:
        """Take new tokens; return the stop string if one now matches (text is cut before it).
        `final`: the request ends with these tokens, so an incomplete character is released too."""
        self._ids.extend(token_ids)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        prefix_text = self._prefix_text
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            start = len(self.text)
            self.text += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._prefix_text = None
            return self._find_stop(start) if check_stop else None
        return None

    def _find_stop(self, new_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            # A match may straddle the old text's tail and the new text.
            index = self.text.find(stop, max(0, new_from - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def replay(
        self, token_ids: list[int], min_tokens: int, num_text_chars: int | None, final: bool = False
    ) -> str | None:
        """Feed tokens an earlier run generated, token by token as the engine fed them (stop
        strings checked once `min_tokens` exist), and mark `num_text_chars` of the text as
        already handed out (None: all of it that was final). `final`: the request ends with the
        last of them. Returns a stop string that matched."""
        matched = None
        for i, token in enumerate(token_ids):
            last = final and i == len(token_ids) - 1
            matched = self.add_tokens([token], final=last, check_stop=i + 1 >= min_tokens) or matched
        emitted = len(self.text) if num_text_chars is None else min(num_text_chars, len(self.text))
        self.num_emitted_chars = emitted
        return matched

    def take_delta(self, finished: bool) -> str:
        """Text released since the last call; while running, the last chars that could still
        begin a stop string stay held back."""
        end = len(self.text) if finished or not self._hold else max(self.num_emitted_chars, len(self.text) - self._hold)
        delta = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta
