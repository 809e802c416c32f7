"""The public engine API: streaming deltas, stop conditions, seeds, logprobs, abort, bad input."""

from __future__ import annotations

import json
import shutil

import pytest

from ferry.worker.engine import LLM, Engine, Resume, SamplingParams
from ferry.worker.engine.detokenizer import IncrementalDetokenizer
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


def test_resumed_tokens_are_validated(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("r1", [1, 2], SamplingParams(max_tokens=3), resume=Resume([4, 5, 6]))
    with pytest.raises(ValueError, match="resumed token ids"):
        engine.add_request("r2", [1, 2], SamplingParams(max_tokens=3), resume=Resume([-1]))
    assert not engine.has_unfinished_requests()


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
    assert outs["ab1"].finished and outs["ab1"].finish_reason == "abort"
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
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e1", [], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("e2", [1] * engine.max_model_len, SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("e3", [1, 10**9], SamplingParams())
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1], [2]], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[1, 2], []], SamplingParams(), use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.kv_usage().num_used_blocks == 0


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
    validation): that request ends with finish_reason "error", the others get their own tokens."""
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
    assert outs["bad"][-1].finish_reason == "error" and "IndexError" in outs["bad"][-1].stop_reason
    assert [t for o in outs["good"] for t in o.new_token_ids] == alone
    assert engine.kv_usage().num_used_blocks == 0


def test_stop_token_ids_beyond_the_vocabulary_are_refused(llm):
    from ferry.worker.engine import InvalidSamplingParams

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
    first_live_token_step = None
    for step in range(200):
        if step == 3:
            engine.add_request("live", prompts["live"], params, priority=0)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.request_id == "live" and first_live_token_step is None and out.new_token_ids:
                first_live_token_step = step
        if not engine.has_unfinished_requests():
            break
    assert first_live_token_step == 3  # admitted at once, not after a batch request finished
    assert engine.stats().num_preemptions == 1
    assert tokens == alone
