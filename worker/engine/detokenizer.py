"""Incremental detokenization and stop strings.

Text is released only when it is final: a token that ends in the middle of a UTF-8 character
(the tokenizer decodes it as U+FFFD) waits for the next token, and the tail that could still be
the start of a stop string is held back until it cannot match any more.

How tokens become text follows vLLM's options: `skip_special_tokens` leaves special tokens out;
without skipping, `spaces_between_special_tokens` puts a space between an added token and the
text around it (Hugging Face's slow-tokenizer decode, vLLM's); `include_stop_str_in_output` keeps
a matched stop string at the end of the text instead of cutting it off.
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
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    text: str = ""  # all final text so far (stop string cut off once matched)
    num_emitted_chars: int = 0  # how much of `text` has been handed out as deltas
    _ids: list[int] = field(init=False)
    _prefix_offset: int = field(init=False)
    _read_offset: int = field(init=False)
    _prefix_text: str | None = field(init=False, default=None)  # decode of ids[prefix:read], cached
    _spaced: dict[int, str] = field(init=False)  # added token id -> its text, when those get spaces around them

    def __post_init__(self) -> None:
        self._ids = list(self.prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # A stop string kept in the output need not be held back: it is text either way.
        longest = 0 if self.include_stop_str_in_output else max((len(s) for s in self.stop_strings), default=0)
        self._hold = max(longest - 1, 0)
        spaced = not self.skip_special_tokens and self.spaces_between_special_tokens
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) if spaced else {}
        self._spaced = {token_id: token.content for token_id, token in decoder.items()}

    def _decode(self, ids: list[int]) -> str:
        if not self._spaced or not any(i in self._spaced for i in ids):
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                         clean_up_tokenization_spaces=False)
        texts, run = [], []  # runs of ordinary tokens decoded together, added tokens as they are
        for token_id in ids:
            if token_id in self._spaced:
                texts += [self._decode(run)] if run else []
                texts.append(self._spaced[token_id])
                run = []
            else:
                run.append(token_id)
        texts += [self._decode(run)] if run else []
        return " ".join(texts)

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
        self.text = self.text[: best[0] + (len(best[1]) if self.include_stop_str_in_output else 0)]
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
