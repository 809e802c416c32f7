"""Helpers shared by the snapshot tests."""

from __future__ import annotations

import socket
import uuid

from ferry.worker.engine import Engine, SamplingParams

BS = 4
BLOCK_BYTES = 2 * 2 * 2 * BS * 16 * 4  # tiny llama: layers x K/V x kv heads x slots x head dim x fp32


def generate(engine: Engine, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], int]:
    """Greedy tokens of one request and its num_cached_tokens."""
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens, cached = [], -1
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    return tokens, cached


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
