"""Where a reasoning model's thinking ends in its output, so that a grammar applies to the answer only.

A request with `reasoning_end_token_ids` (the model's `</think>` as token ids) is unconstrained
until its output has generated those tokens in a row; the grammar starts with the token after
them. With `reasoning_start_token_id` too, the output thinks only when its first token is that one
(Qwen3 writes `<think>` first when it thinks, nothing when its template turned thinking off): the
first token may be it or what the grammar allows, and any other first token is the answer's.

The gate is a pure function of the tokens it has seen (`split`), so speculative proposals and a
resumed request's tokens go through it exactly as generated ones do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

UNDECIDED, THINKING, ANSWER = "undecided", "thinking", "answer"


@dataclass(slots=True)
class ReasoningGate:
    end_token_ids: tuple[int, ...]  # the thinking ends once these were generated in a row
    start_token_id: int | None  # set: only an output whose first token is this one thinks
    state: str = ""  # UNDECIDED (no token yet, the start token may come), THINKING or ANSWER
    tail: tuple[int, ...] = ()  # while thinking: its last tokens, fewer than end_token_ids

    def __post_init__(self) -> None:
        self.state = self.state or (UNDECIDED if self.start_token_id is not None else THINKING)

    @property
    def open(self) -> bool:
        """The grammar applies to the next token (possibly beside the start token: `undecided`)."""
        return self.state != THINKING

    def split(self, token_ids: Sequence[int]) -> tuple[int, str, tuple[int, ...]]:
        """How many leading `token_ids` are thinking (its end tokens included), and the state and
        tail after them all; the gate itself is left as it is."""
        state, tail = self.state, self.tail
        for i, token in enumerate(token_ids):
            if state == ANSWER:
                return i, state, ()
            if state == UNDECIDED:
                state = THINKING if token == self.start_token_id else ANSWER
                if state == ANSWER:
                    return i, state, ()
            tail = (*tail, token)[-len(self.end_token_ids):]
            if tail == self.end_token_ids:
                return i + 1, ANSWER, ()
            tail = tail[-(len(self.end_token_ids) - 1):] if len(self.end_token_ids) > 1 else ()
        return len(token_ids), state, tail

    def advance(self, token_ids: Sequence[int]) -> int:
        """Take in generated tokens; returns how many of them were thinking (the rest are the grammar's)."""
        n, self.state, self.tail = self.split(token_ids)
        return n
