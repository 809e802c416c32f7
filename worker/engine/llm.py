"""LLM: offline batch generation over the Engine (vLLM's `LLM.generate`)."""

from __future__ import annotations

import gc
from collections.abc import Sequence

from tqdm import tqdm

from ferry.worker.engine.engine import Engine
from ferry.worker.engine.lora import LoRARequest
from ferry.worker.engine.outputs import CompletionOutput, RequestOutput
from ferry.worker.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **engine_kwargs) -> None:
        """`engine_kwargs`: `EngineConfig` fields (`tensor_parallel_size=N` splits the model over N ranks)."""
        self.engine = Engine(model, **engine_kwargs)
        self._next_id = 0
        # As the worker does after loading (serve/startup.py): what is loaded by now (torch,
        # transformers, the model) lives as long as the process, so it is kept out of the cyclic
        # collector, whose full collections would otherwise scan it again and again while
        # generating (3-5% of a 32-request SmolLM2 run on a CPU, perf).
        gc.collect()
        gc.freeze()

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks, if any (`Engine.close`)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (strings or token-id lists); results come back in input order.
        `lora_request`: the adapter every prompt runs with, or one per prompt (None: the base model);
        the engine needs enable_lora=True."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"{len(params)} sampling_params for {len(prompts)} prompts: give one or one per prompt"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"{len(loras)} lora_requests for {len(prompts)} prompts: give one or one per prompt")
        ids = []
        prompt_ids = [self.engine.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        try:
            for tokens, p, lora in zip(prompt_ids, params, loras, strict=True):
                request_id = f"llm-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(request_id, tokens, p, lora_request=lora)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # a bad prompt in the list leaves nothing half-queued
                self.engine.abort(request_id)
            self.engine.step()
            raise
        return self._run(ids, prompts, prompt_ids, use_tqdm)

    def chat(
        self, conversations: Sequence[list[dict]], sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[CompletionOutput]:
        """Generate replies to chats rendered with the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # one conversation
        prompts = [self.engine.apply_chat_template(list(c)) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(
        self, ids: list[str], prompts: list, prompt_ids: list[list[int]], use_tqdm: bool
    ) -> list[CompletionOutput]:
        collected: dict[str, list[RequestOutput]] = {i: [] for i in ids}
        pending = set(ids)
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                for out in self.engine.step():
                    if out.request_id in collected:
                        collected[out.request_id].append(out)
                        if out.finished:
                            pending.discard(out.request_id)
                            bar.update()
        results = []
        for request_id, prompt, tokens in zip(ids, prompts, prompt_ids, strict=True):
            deltas = collected[request_id]
            last = deltas[-1]
            logprob_lists = [d.new_logprobs for d in deltas if d.new_logprobs]
            results.append(
                CompletionOutput(
                    request_id=request_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=tokens,
                    token_ids=[t for d in deltas for t in d.new_token_ids],
                    text="".join(d.new_text for d in deltas),
                    finish_reason=last.finish_reason,
                    stop_reason=last.stop_reason,
                    num_prompt_tokens=last.num_prompt_tokens,
                    num_cached_tokens=last.num_cached_tokens,
                    logprobs=[lp for lst in logprob_lists for lp in lst] if logprob_lists else None,
                    metrics=last.metrics,
                    error=last.error,
                    prompt_logprobs=next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None),
                )
            )
        return results
