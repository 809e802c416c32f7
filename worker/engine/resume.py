"""Resuming a request that generated part of its output elsewhere (a job whose worker died).

The engine continues exactly where the earlier run stopped: the earlier tokens extend the
context, count against max_tokens and min_tokens, feed the presence/frequency penalties, advance
a seeded request's generator one vector each, and are replayed through the request's
detokenizer, so a character or a stop string that straddles the hand-over comes out as in an
uninterrupted run. Only text past what the client already has is released.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Resume:
    token_ids: list[int] = field(default_factory=list)  # tokens generated before, in order
    num_text_chars: int | None = None  # characters of text the client already has; None: all the earlier tokens' text

    def __post_init__(self) -> None:
        if self.num_text_chars is not None and self.num_text_chars < 0:
            raise ValueError(f"num_text_chars must be >= 0, got {self.num_text_chars}")
