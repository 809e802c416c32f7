"""Proposers for speculative decoding: prompt lookup (n-gram) and a draft model.

Both set `request.spec.token_ids`; the draft model also sets `request.spec.draft_probs`, the
distribution each proposal was drawn from, which the target's rejection sampler needs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from numpy.lib.stride_tricks import sliding_window_view
from transformers import AutoConfig, AutoTokenizer

from ferry.worker.engine.kv_cache import KVCacheManager
from ferry.worker.engine.model_runner import ModelRunner, SeqChunk
from ferry.worker.engine.request import Request
from ferry.worker.engine.sampler import SamplingRow, adjust_logits, peek_noise, sampling_probs
from ferry.worker.models.config import ModelArch
from ferry.worker.models.loader import gguf_file, load_model, resolve_model_path
from ferry.worker.models.quantization import resolve_quantization


def prompt_lookup(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of the sequence's last n tokens,
    trying n from max_n down to min_n; [] when no suffix occurs earlier.

    A continuation that runs into the sequence's end goes on copying from itself (as an LZ77
    back-reference does): a match d tokens back means the text repeats with period d."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        # Every n-gram that starts before the suffix itself: [len - n, n].
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            proposal = tokens[start : start + k].tolist()
            while len(proposal) < k:
                proposal.append(proposal[len(proposal) - (len(tokens) - start)])
            return proposal
    return []


class NgramProposer:
    """Prompt lookup: text that repeats (code edits, quoting, summaries) proposes its own continuation.
    A proposal is deterministic given the tokens, so the verifier treats it as a point mass."""

    catch_up_tokens = catch_up_total = 0  # no model to feed

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[Request], num_tokens: list[int]) -> None:
        for request, k in zip(requests, num_tokens, strict=True):
            request.spec.token_ids = prompt_lookup(request.all_token_ids, k, self.min_n, self.max_n)

    def pending_catch_up(self, requests: list[Request]) -> int:
        return 0


def load_draft(
    directory: str,
    target: ModelArch,
    target_tokenizer,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    cache_dir: str,
):
    """Load a draft model for `target` (a checkpoint directory or GGUF, converted into `cache_dir`);
    ValueError unless it shares the target's tokenizer. Returns (model, arch)."""
    path = resolve_model_path(directory, cache_dir)
    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(path))
    if arch.max_position_embeddings < max_model_len:
        raise ValueError(
            f"draft model {path.name} supports {arch.max_position_embeddings} positions, "
            f"below max_model_len={max_model_len}"
        )
    _check_same_tokens(path, arch, target, target_tokenizer)
    quantization = resolve_quantization(None, gguf_file(directory, cache_dir), device, dtype)  # the format's default
    return load_model(path, arch, dtype, device, max_model_len, quantization), arch


def _check_same_tokens(path: Path, arch: ModelArch, target: ModelArch, target_tokenizer) -> None:
    if target_tokenizer is None:
        if arch.vocab_size != target.vocab_size:
            raise ValueError(f"draft vocab size {arch.vocab_size} differs from the target's {target.vocab_size}")
        return
    try:
        draft_tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"draft model {path} has no loadable tokenizer to compare with the target's: {exc}") from exc
    # Same token ids for the same strings; the embedding row counts may still differ by padding.
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"draft model {path} has a different tokenizer from the target: token ids would not match")


class DraftProposer:
    """A small model proposes k tokens autoregressively: one flat batch catches each request up
    (the tokens since its last draft pass, a whole prompt the first time), then one batch per
    further token.

    Its KV pool has the target's block count and block size and is indexed by the target's own
    block tables, so it needs no block manager: the draft's KV for a position sits in the same
    block and slot as the target's. Draft KV is trusted only for positions this request's draft
    computed (`request.spec.num_draft_computed`, cut back to the verified tokens each step), never
    for prefix-cache hits, whose blocks may hold another request's or no draft KV."""

    def __init__(
        self, model, arch: ModelArch, kv: KVCacheManager, num_blocks: int, dtype: torch.dtype, device, vocab_size: int
    ) -> None:
        self.runner = ModelRunner(model, arch, num_blocks, kv.block_size, dtype, device)
        self.kv = kv
        self.vocab_size = vocab_size  # the target's: q must be over the same ids as p
        self.catch_up_tokens = 0  # longest first-pass chunk of the last propose(): a whole prompt the first time
        self.catch_up_total = 0  # all requests' first-pass tokens in the last propose()

    def pending_catch_up(self, requests: list[Request]) -> int:
        # A decoding request's first draft pass feeds it everything from its last draft-computed
        # position (cut back to the verified tokens, as propose() does) to its newest token.
        return sum(
            max(0, r.num_tokens - min(r.spec.num_draft_computed, r.num_computed_tokens) - 1)
            for r in requests
            if r.is_decoding
        )

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> None:
        self.catch_up_tokens = self.catch_up_total = 0
        active, counts = [], []
        for request, k in zip(requests, num_tokens, strict=True):
            spec = request.spec
            spec.num_draft_computed = min(spec.num_draft_computed, request.num_computed_tokens)
            # Slots up to the (k-1)-th proposal, the last one the draft computes KV for; the
            # scheduler extends them to the target's k+1 tokens. A short pool means no proposals.
            if self.kv.allocate(request, 0, lookahead=k) is not None:
                active.append(request)
                counts.append(k)
        drafted: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        # Seeded requests race on the noise their verification will use (see spec/decode.py, `verify`).
        noise = [
            peek_noise(r, k, self.vocab_size) if r.generator is not None and not r.params.greedy else None
            for r, k in zip(active, counts, strict=True)
        ]
        for step in range(max(counts, default=0)):
            live = [i for i, k in enumerate(counts) if k > step]
            chunks = []
            for i in live:
                request = active[i]
                if step == 0:
                    start = request.spec.num_draft_computed
                    chunks.append(SeqChunk(request.all_token_ids[start:], start, request.block_ids, 1,
                                           long_rope=request.rope_long))
                    self.catch_up_tokens = max(self.catch_up_tokens, request.num_tokens - start)
                    self.catch_up_total += request.num_tokens - start
                else:
                    chunks.append(SeqChunk(drafted[i][-1:], request.num_tokens + step - 1, request.block_ids, 1,
                                           long_rope=request.rope_long))
            rows = [SamplingRow(active[i], list(drafted[i])) for i in live]
            step_noise = [None if noise[i] is None else noise[i][step] for i in live]
            tokens, dists = self._pick(self.runner.forward(chunks), rows, step_noise)
            for i, token, dist in zip(live, tokens, dists, strict=True):
                drafted[i].append(token)
                if dist is not None:
                    probs[i].append(dist)
        for request, k, tokens, dists in zip(active, counts, drafted, probs, strict=True):
            request.spec.token_ids = tokens
            request.spec.draft_probs = torch.stack(dists) if dists else None
            request.spec.num_draft_computed = request.num_tokens + k - 1

    def _pick(
        self, logits: torch.Tensor, rows: list[SamplingRow], noise: list[torch.Tensor | None]
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """One proposal per row, under the request's own sampling transforms, with the
        distribution it was drawn from where the verifier needs it (rejection sampling: unseeded
        random rows; greedy and seeded rows are verified by comparing tokens). noise: per row,
        the [vocab] race noise of a seeded request's position, else None."""
        vocab = logits.shape[-1]
        # Checkpoints pad their embeddings differently: ids past the target's are never proposed.
        logits = (
            logits[:, : self.vocab_size]
            if vocab >= self.vocab_size
            else F.pad(logits, (0, self.vocab_size - vocab), value=float("-inf"))
        )
        adjust_logits(logits, rows)  # a row that fails there proposes junk: the target's verification fails it
        tokens = logits.argmax(dim=-1)
        dists: list[torch.Tensor | None] = [None] * len(rows)
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            sub = [rows[i] for i in random_rows]
            q = sampling_probs(logits[random_rows], sub)
            # draw()'s exponential race, on fresh noise, or on a seeded request's peeked noise
            # (which must not advance its generator: the verification draws the same vectors).
            race = torch.empty_like(q).exponential_()
            for j, i in enumerate(random_rows):
                if noise[i] is None:
                    dists[i] = q[j]
                else:
                    race[j] = noise[i]
            tokens[random_rows] = (q / race).argmax(dim=-1)
        return tokens.tolist(), dists
