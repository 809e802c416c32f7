"""Structured outputs on a random-weight model: only the grammar can make its output valid."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest

from ferry.worker.engine import LLM, Engine, Resume, SamplingParams
from ferry.worker.engine.kv_cache import KVCacheManager
from ferry.worker.engine.scheduler import Scheduler
from ferry.worker.engine.structured import GrammarState, InvalidStructuredOutputError, StructuredOutputs
from tests.engine.helpers import make_request

_NAME = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"name": _NAME}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    {
        "type": "object",
        "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"}, "name": _NAME},
                                "required": ["id", "name"]}},
        "required": ["user"],
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": _NAME, "maxItems": 2}, "count": {"type": "integer"}},
        "required": ["tags", "count"],
    },
    {"type": "object", "properties": {"a": _NAME, "b": {"type": "integer"}}, "required": ["a"]},  # b optional
    {"type": "object", "properties": {"v": {"type": ["integer", "null"]}}, "required": ["v"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "n": {"type": "integer"}}, "required": ["kind", "n"]},
    {"type": "string", "maxLength": 8},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "object", "properties": {"p": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}}, "required": ["p"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["code"]},
    {
        "type": "object",
        "properties": {"items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": _NAME, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"]}}},
        "required": ["items"],
    },
    {"type": "object", "properties": {"m": {"type": "array", "maxItems": 2,
                                            "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}},
     "required": ["m"]},
    {
        "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["a", "b"],
    },
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"}}, "required": ["date"]},
]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", 'say "hi"']
# Every sampling setting sees the masked logits.
SETTINGS = [
    {"temperature": 0.0},
    {"temperature": 1.0, "seed": 3},
    {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
    {"temperature": 1.5, "min_p": 0.05, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5},
]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_model_len=512)


def _json(schema) -> SamplingParams:
    return SamplingParams(max_tokens=160, temperature=0.0, structured_outputs=StructuredOutputs(json=schema))


def test_twenty_schemas_parse_and_validate_in_one_batch(llm):
    params = [
        SamplingParams(max_tokens=160, structured_outputs=StructuredOutputs(json=schema), **SETTINGS[i % len(SETTINGS)])
        for i, schema in enumerate(SCHEMAS)
    ]
    outputs = llm.generate(["Extract:"] * len(SCHEMAS), params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outputs, strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
        assert "\n" not in out.text and "  " not in out.text.replace('"  ', "")  # no free whitespace


def test_unconstrained_requests_in_the_same_batch_are_unchanged(llm):
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [alone] = llm.generate(["hello"], plain, use_tqdm=False)
    mixed = llm.generate(["hello", "hello"], [plain, _json(SCHEMAS[0])], use_tqdm=False)
    assert mixed[0].token_ids == alone.token_ids


def test_json_object_regex_and_choice(llm):
    params = [
        SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=StructuredOutputs(json_object=True)),
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputs(regex=REGEX)),
        SamplingParams(max_tokens=40, temperature=1.0, seed=1, structured_outputs={"choice": CHOICES}),
        SamplingParams(
            max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputs(grammar='root ::= "ab" [0-9] "!"')
        ),
    ]
    obj, reg, choice, ebnf = llm.generate(["Answer:"] * 4, params, use_tqdm=False)
    assert isinstance(json.loads(obj.text), dict)
    assert reg.finish_reason == "stop"
    assert re.fullmatch(REGEX, reg.text)
    assert choice.text in CHOICES and choice.finish_reason == "stop"
    assert re.fullmatch(r"ab[0-9]!", ebnf.text)


def test_a_finished_grammar_ends_the_request_even_with_ignore_eos(llm):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, structured_outputs={"choice": ["yes"]})
    [out] = llm.generate(["Q:"], params, use_tqdm=False)
    assert out.text == "yes" and out.finish_reason == "stop"


def test_a_bad_schema_fails_only_its_request(llm):
    bad = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputs(json={"type": "objectx"}))
    good = _json(SCHEMAS[1])
    engine = llm.engine
    engine.add_request("bad", "hi", bad)
    engine.add_request("good", "hi", good)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    [failed] = outs["bad"]
    assert failed.finished and failed.finish_reason == "error"
    assert isinstance(failed.error, InvalidStructuredOutputError) and "objectx" in failed.stop_reason
    assert outs["good"][-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(o.new_text for o in outs["good"])), SCHEMAS[1])


def test_malformed_specs_are_refused_up_front():
    with pytest.raises(InvalidStructuredOutputError, match="exactly one"):
        StructuredOutputs(json={"type": "object"}, regex="a")
    with pytest.raises(InvalidStructuredOutputError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(InvalidStructuredOutputError, match="not valid JSON"):
        StructuredOutputs(json="{nope")
    with pytest.raises(InvalidStructuredOutputError, match="choice"):
        StructuredOutputs(choice=[])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputs(choice=["a"]))


def test_greedy_output_is_identical_with_ngram_speculation(llama_dir, llm):
    params = [_json(SCHEMAS[i]) for i in (0, 1, 2, 3, 6, 9)]  # short outputs: a quick test
    plain = llm.generate(["Extract:"] * len(params), params, use_tqdm=False)
    spec = Engine(
        str(llama_dir), max_model_len=512,
        speculative={"method": "ngram", "num_speculative_tokens": 4, "measure_speedup": False, "pause_steps": 0},
    )
    outs = LLM.__new__(LLM)
    outs.engine, outs._next_id = spec, 0
    speculated = outs.generate(["Extract:"] * len(params), params, use_tqdm=False)
    assert [o.token_ids for o in speculated] == [o.token_ids for o in plain]
    assert spec.stats().spec_decode.num_draft_tokens > 0  # proposals were made (and truncated to the grammar)


def test_resume_mid_output_continues_the_same_valid_text(llm):
    schema = SCHEMAS[8]
    [whole] = llm.generate(["Extract:"], _json(schema), use_tqdm=False)
    cut = len(whole.token_ids) // 2
    engine = llm.engine
    engine.add_request("resumed", "Extract:", _json(schema), resume=Resume(whole.token_ids[:cut]))
    rest = []
    while engine.has_unfinished_requests():
        rest += [t for o in engine.step() for t in o.new_token_ids]
    assert whole.token_ids[:cut] + rest == whole.token_ids
    jsonschema.validate(json.loads(whole.text), schema)


def test_resumed_tokens_the_grammar_refuses_fail_the_request(llm):
    engine = llm.engine
    engine.add_request("r", "x", SamplingParams(max_tokens=8, structured_outputs={"choice": ["yes"]}),
                       resume=Resume(engine.encode("no")))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finish_reason == "error" and isinstance(outs[-1].error, InvalidStructuredOutputError)


def test_compiled_grammars_are_shared_and_evicted_lru(llama_dir):
    engine = Engine(str(llama_dir), max_model_len=64, structured_outputs_cache_size=2)
    a, b, c = (StructuredOutputs(choice=[x]) for x in "abc")
    fa = engine.structured.compile(a)
    assert engine.structured.compile(StructuredOutputs(choice=["a"])) is fa
    engine.structured.compile(b)
    engine.structured.compile(c)  # evicts a, the least recently used
    assert engine.structured.compile(a) is not fa


def test_a_request_whose_grammar_compiles_does_not_hold_up_others():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    compiling = make_request("c", 4)
    compiling.grammar = GrammarState(Future())  # never completes here
    plain = make_request("p", 4)
    scheduler.add(compiling)
    scheduler.add(plain)
    out = scheduler.schedule()
    assert [r.request_id for r in out.requests] == ["p"]
    assert scheduler.waiting == [compiling]


@pytest.mark.slow
def test_twenty_schemas_validate_on_the_pretrained_smollm2(smollm2_dir):
    # The real model: the grammar keeps it to the schema while it picks sensible values.
    llm = LLM(str(smollm2_dir), max_model_len=512)
    prompts = [f"Fill in JSON matching this schema: {json.dumps(schema)}\nJSON:" for schema in SCHEMAS]
    outputs = llm.generate(prompts, [_json(schema) for schema in SCHEMAS], use_tqdm=False)
    for schema, out in zip(SCHEMAS, outputs, strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_json_numbers_have_bounded_length():
    # Bounded so a model cannot write digits until max_tokens; every int64 and double still fits.
    import xgrammar as xgr

    from ferry.worker.engine.structured.manager import _json_grammar

    grammar = xgr.Grammar.from_ebnf(_json_grammar(json.dumps({"type": "array", "items": {"type": "number"}})))
    integers = xgr.Grammar.from_ebnf(_json_grammar(json.dumps({"type": "integer"})))
    accepts = xgr.testing._is_grammar_accept_string
    assert accepts(integers, "-9223372036854775808") and not accepts(integers, "12345678901234567890")
    assert accepts(grammar, "[1.7976931348623157e308, -0.12345678901234567, 0]")
    assert not accepts(grammar, "[0.123456789012345678]") and not accepts(grammar, "[1e1000]")
    # A pattern's own digits are the user's: not bounded.
    pattern = xgr.Grammar.from_ebnf(_json_grammar(json.dumps({"type": "string", "pattern": "^[1-9][0-9]*$"})))
    assert accepts(pattern, '"' + "9" * 40 + '"')


def test_json_strings_hold_neither_surrogates_nor_special_tokens(llm):
    # A byte-level model's tokens can spell a UTF-8 surrogate (three bytes that decode to three
    # U+FFFD) or be `<s>`/`<unk>`, which xgrammar took for five plain characters and the
    # detokenizer drops: either way the text would no longer be what the grammar matched.
    schema = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 6, "maxItems": 6}
    outputs = llm.generate([f"kill {i}: the quick brown fox" for i in range(8)], _json(schema), use_tqdm=False)
    special = set(llm.tokenizer.all_special_ids)
    for out in outputs:
        assert out.finish_reason == "stop"
        assert "\ufffd" not in out.text
        assert not special & set(out.token_ids[:-1])  # only the final stop token
        jsonschema.validate(json.loads(out.text), schema)
