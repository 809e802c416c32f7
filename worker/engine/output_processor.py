"""The output processor: a step's sampled tokens, appended one by one, become `RequestOutput` deltas.

Each token is appended to its request and checked against every stop condition before the next
one: EOS, stop token ids (both once min_tokens exist), max_tokens and the context's end, the
grammar's end, and stop strings through the request's detokenizer. A condition met inside an
accepted run of speculative proposals ends the request right there, the tokens after it
dropped, exactly as it would have ended without speculation. The processor tells the core to
finish each request it ends, which frees its blocks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from ferry.worker.engine.core import CoreOutput, EngineCore
from ferry.worker.engine.detokenizer import IncrementalDetokenizer
from ferry.worker.engine.errors import InvalidStructuredOutputError, RequestFailedError
from ferry.worker.engine.outputs import FinishReason, PositionLogprobs, RequestOutput
from ferry.worker.engine.request import Request

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, core: EngineCore, tokenizer, max_model_len: int) -> None:
        self.core = core  # finishes the requests a stop condition ends
        self.tokenizer = tokenizer  # decodes logprobs' tokens; None: outputs carry no text
        self.max_model_len = max_model_len
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}  # by request id, until its last output

    def add_request(self, request: Request, detokenizer: IncrementalDetokenizer | None) -> None:
        if detokenizer is not None:
            self._detokenizers[request.request_id] = detokenizer

    def process(self, core_output: CoreOutput) -> list[RequestOutput]:
        """A delta for every request that ended or got tokens in the step."""
        outputs = [self._output(request, [], None) for request in core_output.ended]
        now = time.monotonic()
        for sampled in core_output.sampled:
            request = sampled.request
            try:
                outputs.append(self._append(request, sampled.token_ids, sampled.logprobs, now))
            except Exception as exc:  # one request's tokens (its detokenizer, its grammar) raised: it fails alone
                log.exception("request %s failed on its own output", request.request_id)
                error = RequestFailedError(f"{type(exc).__name__}: {exc}")
                error.__cause__ = exc
                self.core.finish(request, FinishReason.ERROR, error=error)
                outputs.append(self._output(request, [], None))
        return outputs

    def _append(self, request: Request, tokens: list[int], logprobs: list | None, now: float) -> RequestOutput:
        emitted, emitted_logprobs = [], []
        reason, stop_reason = None, None
        detok = self._detokenizers.get(request.request_id)
        first = request.metrics.first_token_time is None  # its first output carries its prompt's logprobs
        for i, token in enumerate(tokens):
            token_logprobs = self._decorate(logprobs[i]) if logprobs is not None else None
            request.append_output(token, token_logprobs)
            emitted.append(token)
            if token_logprobs is not None:
                emitted_logprobs.append(token_logprobs)
            metrics = request.metrics
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            metrics.token_times.append(now)
            reason, stop_reason = self._token_stop(request, token)
            # The EOS or stop token that ends a request is not text unless include_stop_str_in_output (vLLM's rule).
            stop_token = reason is FinishReason.STOP and not request.params.include_stop_str_in_output
            text_tokens = [] if stop_token else [token]
            if request.grammar is not None:
                if not request.grammar.accept(token):
                    raise InvalidStructuredOutputError(f"token {token} does not match the grammar")
                if reason is None and request.grammar.finished:
                    reason = FinishReason.STOP  # the grammar accepted its end (an EOS that ignore_eos let through)
            if detok is not None:
                stops_active = request.num_output_tokens >= request.params.min_tokens
                matched = detok.add_tokens(text_tokens, final=reason is not None, check_stop=stops_active)
                if matched is not None and reason is None:
                    reason, stop_reason = FinishReason.STOP, matched
            if reason is not None:
                break
        if reason is not None:
            self.core.finish(request, reason, stop_reason)
        prompt_logprobs = None
        if first and request.prompt_logprobs is not None:
            prompt_logprobs = [self._decorate(entry) for entry in request.prompt_logprobs]
        return self._output(request, emitted, emitted_logprobs or None, prompt_logprobs)

    def _token_stop(self, request: Request, token: int) -> tuple[FinishReason | None, str | int | None]:
        """The stop condition `token` (just appended) meets, if any, and its stop token id."""
        p = request.params
        if request.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in request.eos_token_ids:
                return FinishReason.STOP, None
            if token in p.stop_token_ids:
                return FinishReason.STOP, token
        if request.length_reached(self.max_model_len):
            return FinishReason.LENGTH, None
        return None, None

    def _decorate(self, logprobs: PositionLogprobs | None) -> PositionLogprobs | None:
        if logprobs is None or self.tokenizer is None:
            return logprobs
        return {tid: replace(lp, decoded_token=self.tokenizer.decode([tid])) for tid, lp in logprobs.items()}

    def _output(self, request: Request, new_tokens: list[int], new_logprobs: list | None,
                prompt_logprobs: list[PositionLogprobs | None] | None = None) -> RequestOutput:
        """The delta; a finished request's held-back text comes out with it (none for a failed
        one: its detokenizer may be what failed), and its detokenizer goes."""
        finished = request.is_finished
        detok = self._detokenizers.get(request.request_id)
        if finished:
            self._detokenizers.pop(request.request_id, None)
            detok = None if request.finish_reason is FinishReason.ERROR else detok
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_tokens,
            new_text=detok.take_delta(finished) if detok is not None else "",
            new_logprobs=new_logprobs,
            finished=finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_output_tokens=request.num_output_tokens,
            metrics=request.metrics,
            error=request.error,
            prompt_logprobs=prompt_logprobs,
        )
