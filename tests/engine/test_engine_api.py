"""The public engine API: streaming deltas, stop conditions, seeds, logprobs, abort, bad input."""

from __future__ import annotations

import json
import shutil

import pytest

from ferry.worker.engine import (
    LLM,
    Engine,
    EngineInputError,
    FinishReason,
    InvalidPromptError,
    InvalidResumeError,
    InvalidSamplingParams,
    InvalidStructuredOutputError,
    PromptTooLongError,
    RequestFailedError,
    Resume,
    SamplingParams,
    sampling_params,
)
from ferry.worker.engine.detokenizer import IncrementalDetokenizer
from ferry.worker.engine.structured import params as structured_params
from ferry.worker.models.config import UnsupportedModelError
from ferry.worker.models.loader import ModelNotFoundError


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir))


def _stream(engine: Engine, request_id: str, prompt, params) -> list:
    engine.add_request(request_id, prompt, params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o for o in engine.step() if o.request_id == request_id]
    return deltas


def test_text_prompt_streams_deltas_that_add_up(llm):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    deltas = _stream(llm.engine, "s1", "def fibonacci(n):", params)
    [whole] = llm.generate(["def fibonacci(n):"], params, use_tqdm=False)
    assert [t for d in deltas for t in d.new_token_ids] == whole.token_ids
    assert "".join(d.new_text for d in deltas) == whole.text
    assert whole.text == llm.tokenizer.decode(whole.token_ids, skip_special_tokens=True)
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert not any(d.finished for d in deltas[:-1])
    m = deltas[-1].metrics
    assert m.ttft is not None and m.ttft >= 0 and len(m.token_times) == 24
    assert m.queue_time is not None and 0 <= m.queue_time <= m.ttft  # arrival to first scheduled


def test_finish_reasons_are_typed_and_still_compare_and_print_as_strings(llm):
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert out.finish_reason is FinishReason.LENGTH and out.finish_reason == "length"
    assert f"{out.finish_reason}" == str(out.finish_reason) == "length" and json.dumps(out.finish_reason) == '"length"'
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "error"]


def test_stop_string_is_cut_exactly_and_never_streamed(llm):
    base = llm.generate(
        ["The quick brown"], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    text = base.text
    start = next(i for i in range(8, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    stop = text[start : start + 3]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop, "never-matches-xyz"])
    deltas = _stream(llm.engine, "stop1", "The quick brown", params)
    streamed = "".join(d.new_text for d in deltas)
    assert streamed == text[: text.index(stop)]
    assert all(stop not in d.new_text for d in deltas)
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop


def test_stop_token_ids_and_eos(llm):
    base = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    stop_token = base.token_ids[4]
    first = base.token_ids.index(stop_token)
    out = llm.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_token]), use_tqdm=False
    )[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    held = llm.generate(
        [[5, 6, 7]],
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_token], min_tokens=first + 2),
        use_tqdm=False,
    )[0]
    assert len(held.token_ids) > first + 1  # min_tokens keeps it going past the stop token


def test_seeded_sampling_reproduces_in_any_batch(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=123, ignore_eos=True)
    alone = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batch = llm.generate([[9, 9], [1, 2, 3], [4, 4, 4, 4]], [others, params, others], use_tqdm=False)
    assert batch[1].token_ids == alone


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True, presence_penalty=0.8,
                       frequency_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(max_tokens=20, temperature=0.9, top_k=20, seed=3, min_tokens=15, stop_token_ids=[5, 6, 7, 8]),
    ],
    ids=["seeded-penalties", "greedy-frequency", "seeded-min-tokens"],
)
def test_resumed_request_continues_as_the_uninterrupted_run(llm, params):
    """A job picked up after its worker died: prompt + the tokens generated so far go in as a
    Resume, and the rest comes out as if nothing had happened (seed, penalties, max_tokens and
    min_tokens all count the earlier tokens)."""
    prompt = [11, 12, 13, 14, 15]
    full = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    assert len(full) >= 12
    for cut in (1, 8, 12):
        engine = llm.engine
        engine.add_request(f"resume-{cut}", prompt, params, resume=Resume(full[:cut]))
        rest = []
        while engine.has_unfinished_requests():
            rest += [t for o in engine.step() for t in o.new_token_ids]
        assert full[:cut] + rest == full, cut
    assert llm.engine.kv_usage().num_used_blocks == 0


def test_resumed_token_ids_outside_the_vocabulary_are_refused(llm):
    engine = llm.engine
    for bad in ([-1], [engine.arch.vocab_size], [4, "5"]):
        with pytest.raises(InvalidResumeError, match="resumed token ids"):
            engine.add_request("r", [1, 2], SamplingParams(max_tokens=3), resume=Resume(bad))
    assert not engine.has_unfinished_requests()


def test_a_resume_that_ends_with_a_stop_string_is_refused(llm):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    [run] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    text = run.text
    start = next(i for i in range(4, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    stop = text[start : start + 3]
    stopped = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    with pytest.raises(InvalidResumeError, match="stop string"):
        llm.engine.add_request("r", [5, 6, 7], stopped, resume=Resume(run.token_ids))
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv_usage().num_used_blocks == 0


@pytest.mark.parametrize("reached", ["max_tokens", "max_model_len"])
def test_a_resume_already_at_its_end_finishes_with_length_and_no_new_tokens(llama_dir, reached):
    """The earlier attempt had generated its last token when its worker died: the engine ends
    the request as the uninterrupted run ended, LENGTH, with the text the client still lacks."""
    llm = LLM(str(llama_dir), max_model_len=16)
    max_tokens = 6 if reached == "max_tokens" else None  # None: the rest of the context, 16 - 4
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    [run] = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
    assert run.finish_reason == FinishReason.LENGTH and len(run.token_ids) == (6 if max_tokens else 12)
    engine = llm.engine
    engine.add_request("again", [5, 6, 7, 8], params, resume=Resume(run.token_ids, num_text_chars=2))
    [out] = engine.step()
    assert out.finished and out.finish_reason is FinishReason.LENGTH and out.stop_reason is None
    assert out.new_token_ids == [] and out.num_output_tokens == len(run.token_ids)
    assert out.new_text == run.text[2:] and out.error is None
    assert not engine.has_unfinished_requests() and engine.kv_usage().num_used_blocks == 0


def test_logprobs_per_generated_token(llm):
    out = llm.generate(
        [[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.logprobs) == 5
    for token, position in zip(out.token_ids, out.logprobs):
        assert token in position and position[token].rank == 1  # greedy picks the top token
        assert len(position) == 2 and all(lp.logprob <= 0 for lp in position.values())
        assert all(lp.decoded_token is not None for lp in position.values())


def test_abort_reports_and_frees(llm):
    engine = llm.engine
    engine.add_request("ab1", [1, 2, 3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("ab2", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort("ab1") and not engine.abort("nope")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["ab1"].finished and outs["ab1"].finish_reason is FinishReason.ABORT
    engine.abort("ab2")  # aborted while waiting or running, either way nothing leaks
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_usage().num_used_blocks == 0


def test_chat_template_is_applied(llm):
    messages = [{"role": "user", "content": "hi"}]
    ids = llm.engine.apply_chat_template(messages)
    assert llm.tokenizer.decode(ids).startswith("<|user|>hi") and llm.tokenizer.decode(ids).endswith("<|assistant|>")
    out = llm.chat(messages, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and len(out.token_ids) == 3


def test_a_chat_its_template_refuses_is_an_invalid_prompt(llama_dir):
    engine = Engine(str(llama_dir), max_model_len=32)
    engine.tokenizer.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    with pytest.raises(InvalidPromptError, match="roles must alternate"):
        engine.apply_chat_template([{"role": "user", "content": "hi"}])


def test_detokenizer_never_breaks_a_utf8_character(llm):
    text = "price: 5€ ñ ✓ done"
    ids = llm.tokenizer.encode(text)
    detok = IncrementalDetokenizer(llm.tokenizer, [], [])
    pieces = []
    for i, token in enumerate(ids):
        detok.add_tokens([token], final=i == len(ids) - 1)
        pieces.append(detok.take_delta(finished=i == len(ids) - 1))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len(ids) > len(text.split())  # multi-byte characters really were split across tokens


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_bad_sampling_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_leave_nothing_queued(llm):
    engine = llm.engine
    with pytest.raises(InvalidPromptError, match="empty"):
        engine.add_request("e1", [], SamplingParams())
    with pytest.raises(InvalidPromptError, match="empty"):
        llm.generate([""], SamplingParams(), use_tqdm=False)
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        engine.add_request("e2", [1] * engine.max_model_len, SamplingParams())
    with pytest.raises(InvalidPromptError, match="token ids"):
        engine.add_request("e3", [1, 10**9], SamplingParams())
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1], [2]], [SamplingParams()], use_tqdm=False)
    with pytest.raises(InvalidPromptError, match="empty"):
        llm.generate([[1, 2], []], SamplingParams(), use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.kv_usage().num_used_blocks == 0


def test_every_refusal_is_an_engine_input_error_and_a_value_error():
    """One base class for what add_request refuses: the worker maps each subclass to a wire
    code, and callers that catch ValueError keep working."""
    kinds = (InvalidPromptError, PromptTooLongError, InvalidSamplingParams, InvalidStructuredOutputError,
             InvalidResumeError)
    assert all(issubclass(kind, EngineInputError) and issubclass(kind, ValueError) for kind in kinds)
    assert issubclass(PromptTooLongError, InvalidPromptError)
    assert (sampling_params.InvalidSamplingParams, structured_params.InvalidStructuredOutputError) == (
        InvalidSamplingParams, InvalidStructuredOutputError
    )  # the old import paths name the same classes


def test_a_model_without_a_tokenizer_refuses_text_and_chats(tmp_path, llama_dir):
    model = tmp_path / "ids-only"
    shutil.copytree(llama_dir, model)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).unlink(missing_ok=True)
    engine = Engine(str(model), max_model_len=32)
    with pytest.raises(InvalidPromptError, match="no tokenizer"):
        engine.add_request("t", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidPromptError, match="chat template"):
        engine.apply_chat_template([{"role": "user", "content": "hi"}])
    engine.add_request("ids", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    [out] = [o for _ in range(4) for o in engine.step() if o.finished]
    assert out.new_text == "" and out.finish_reason is FinishReason.LENGTH


def test_unknown_model_and_unsupported_architecture(tmp_path, tiny_model_factory):
    with pytest.raises(ModelNotFoundError, match="not found|not in the local"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        LLM("some-org/not-a-cached-model")
    model_dir = tiny_model_factory("llama")
    config = (model_dir / "config.json").read_text()
    other = tmp_path / "gpt2ish"
    other.mkdir()
    for f in model_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    (other / "config.json").write_text(config.replace('"LlamaForCausalLM"', '"GPTNeoXForCausalLM"'))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture"):
        LLM(str(other))
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(model_dir), dtype="int3")


def test_hub_id_resolves_from_the_local_cache(tmp_path, monkeypatch, llama_dir):
    """A hub id loads from the Hugging Face cache layout without any network access."""
    import huggingface_hub.constants

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--ferry-test--tiny-llama"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for f in llama_dir.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached = LLM("ferry-test/tiny-llama")
    local = LLM(str(llama_dir))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert cached.engine.model_dir == snapshot.resolve() or cached.engine.model_dir == snapshot
    assert (
        cached.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids
        == local.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids
    )


def test_a_request_whose_own_processing_raises_fails_alone(llm):
    """One request's data breaks while it runs (here an out-of-range stop id slipped past
    validation): that request ends with ERROR and the exception in `error` (stop_reason stays
    for stop strings and stop token ids), the others get their own tokens."""
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
    engine.add_request("good", [5, 6, 7], params)
    engine.add_request("bad", [8, 9, 10], SamplingParams(max_tokens=8, temperature=0.0, min_tokens=4))
    engine.scheduler.requests["bad"].params.stop_token_ids.append(engine.arch.vocab_size + 3)
    outs: dict[str, list] = {"good": [], "bad": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    failed = outs["bad"][-1]
    assert failed.finished and failed.finish_reason is FinishReason.ERROR and failed.stop_reason is None
    assert isinstance(failed.error, RequestFailedError) and "IndexError" in str(failed.error)
    assert outs["good"][-1].error is None
    assert [t for o in outs["good"] for t in o.new_token_ids] == alone
    assert engine.kv_usage().num_used_blocks == 0


def test_stop_token_ids_beyond_the_vocabulary_are_refused(llm):
    with pytest.raises(InvalidSamplingParams, match="stop_token_ids"):
        llm.engine.add_request("x", [1, 2], SamplingParams(stop_token_ids=[llm.engine.arch.vocab_size]))
    assert not llm.engine.has_unfinished_requests()


def test_unset_max_tokens_generates_to_the_end_of_the_context(llama_dir):
    engine = LLM(str(llama_dir), max_model_len=40)
    [out] = engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) == 40 - 4 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="min_tokens"):  # the resolved max_tokens still bounds min_tokens
        engine.engine.add_request("m", [5] * 30, SamplingParams(min_tokens=20))


def test_generation_config_sampling_applies_only_to_unset_fields(tmp_path, llama_dir):
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(config | {"temperature": 0.0, "top_k": 7}))
    llm = LLM(str(model))
    assert llm.engine.sampling_defaults == {"temperature": 0.0, "top_k": 7}
    prompt = [[5, 6, 7]]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    unset = [llm.generate(prompt, SamplingParams(max_tokens=12, seed=s, ignore_eos=True), use_tqdm=False)
             for s in (1, 2)]
    assert unset[0][0].token_ids == unset[1][0].token_ids == greedy[0].token_ids  # the model's temperature 0
    hot = [llm.generate(prompt, SamplingParams(max_tokens=12, temperature=5.0, seed=s, ignore_eos=True),
                        use_tqdm=False)[0].token_ids for s in (1, 2, 3)]
    assert len({tuple(h) for h in hot}) > 1  # an explicit temperature wins over the model's


def test_resolved_params_fill_only_what_is_unset():
    params = SamplingParams(top_p=0.5).resolved({"top_p": 0.9, "temperature": 0.7}, remaining=33)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
        33, 0.7, 0.5, 0, 1.0
    )


def test_logit_bias_must_be_this_models_and_in_range(llm):
    vocab = llm.engine.arch.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias: token id {vocab} is beyond the vocabulary"):
        llm.engine.add_request("lb", [5, 6], SamplingParams(logit_bias={vocab: 1.0}))
    for bad in ({1: 100.5}, {-1: 1.0}, {i: 1.0 for i in range(301)}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                     logit_bias={9: 100.0}), use_tqdm=False)
    assert out.token_ids == [9] * 5


def test_background_requests_step_aside_while_a_foreground_prompt_prefills(llama_dir, llm):
    """The step that prefills a live prompt computes nothing for the background decodes (they
    keep their blocks), so the live prompt's first token pays for its own prefill alone; the
    next step decodes them all, and every request keeps its greedy tokens."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = {"batch0": [3, 4, 5], "batch1": [6, 7, 8, 9], "live": list(range(20, 40))}
    alone = {rid: llm.generate([p], params, use_tqdm=False)[0].token_ids for rid, p in prompts.items()}
    engine = Engine(llama_dir)
    for rid in ("batch0", "batch1"):
        engine.add_request(rid, prompts[rid], params, priority=2, background=True)
    tokens: dict[str, list[int]] = {}
    steps = []
    for step in range(20):
        if step == 2:
            engine.add_request("live", prompts["live"], params, priority=2)  # the flag decides, not the priority
            assert engine.next_step_is_full()  # what arrives now could not join the live prompt's step
        outs = engine.step()
        steps.append(sorted(o.request_id for o in outs if o.new_token_ids))
        for out in outs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_unfinished_requests():
            break
    assert steps[:4] == [["batch0", "batch1"], ["batch0", "batch1"], ["live"], ["batch0", "batch1", "live"]]
    assert tokens == alone and engine.stats().num_preemptions == 0


def test_a_live_request_preempts_a_batch_one_and_both_keep_their_greedy_tokens(llama_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {"batch0": list(range(3, 30)), "batch1": list(range(40, 61)), "live": list(range(70, 90))}
    alone = {}
    for request_id, prompt in prompts.items():
        engine = Engine(llama_dir, max_num_seqs=2)
        engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                alone.setdefault(request_id, []).extend(out.new_token_ids)
    engine = Engine(llama_dir, max_num_seqs=2)
    engine.add_request("batch0", prompts["batch0"], params, priority=2)
    engine.add_request("batch1", prompts["batch1"], params, priority=2)
    tokens: dict[str, list[int]] = {}
    preemptions: dict[str, int] = {}
    first_live_token_step = None
    for step in range(200):
        if step == 3:
            engine.add_request("live", prompts["live"], params, priority=0)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            preemptions[out.request_id] = out.metrics.num_preemptions
            if out.request_id == "live" and first_live_token_step is None and out.new_token_ids:
                first_live_token_step = step
        if not engine.has_unfinished_requests():
            break
    assert first_live_token_step == 3  # admitted at once, not after a batch request finished
    assert engine.stats().num_preemptions == 1
    assert sorted(preemptions.values()) == [0, 0, 1] and preemptions["live"] == 0  # each request's own count
    assert tokens == alone
