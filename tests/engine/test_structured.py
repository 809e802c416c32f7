"""Structured outputs on a random-weight model: only the grammar can make its output valid."""

from __future__ import annotations

import json
import logging
import random
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch
import xgrammar as xgr

from ferry.worker.engine import LLM, Engine, Resume, SamplingParams
from ferry.worker.engine.kv_cache import KVCacheManager
from ferry.worker.engine.scheduler import Scheduler
from ferry.worker.engine.structured import (
    GrammarState,
    InvalidStructuredOutputError,
    SchemaTooComplexError,
    StructuredOutputManager,
    StructuredOutputs,
)
from ferry.worker.engine.structured.grammars import compiler_message, grammar_source
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


def test_a_bad_grammar_fails_only_its_request(llm):
    # The wire's check cannot parse EBNF: the compiler refuses it, in its own words about the text.
    bad = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputs(grammar='root ::= "a'))
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
    assert isinstance(failed.error, InvalidStructuredOutputError)
    assert str(failed.error) == ('structured_outputs.grammar cannot be compiled: EBNF lexer error at line 1, '
                                 'column 12: Expect " in string literal')  # without xgrammar's source location
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
    with pytest.raises(InvalidStructuredOutputError, match="'not' at #/properties/a cannot be enforced"):
        StructuredOutputs(json={"type": "object", "properties": {"a": {"not": {"type": "number"}}}})
    with pytest.raises(SchemaTooComplexError, match="unrolls to 50000 characters"):
        StructuredOutputs(regex="[a-z]{50000}")
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


def _accepts(schema: dict, text: str) -> bool:
    return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(grammar_source("json", schema).text), text)


def test_json_numbers_have_bounded_length_and_are_finite_doubles_and_int64s():
    # Bounded so a model cannot write digits until max_tokens, and so that every number the
    # grammar allows parses as a finite double (issue 35: 79.83E533 overflowed) and every integer
    # as an int64.
    numbers = {"type": "array", "items": {"type": "number"}}
    largest = "-9999999999999999999.99999999999999999E+289"  # the grammar's: still a finite double
    assert _accepts(numbers, f"[{largest}, 1.7976931348623157e289, -0.12345678901234567, 0, 5e-289, 1e7]")
    assert json.loads(largest) > -float("inf")
    for wild in ("[1e290]", "[79.83E533]", "[1e1000]", "[0.123456789012345678]", "[12345678901234567890]"):
        assert not _accepts(numbers, wild)
    integers = {"type": "array", "items": {"type": "integer"}}
    assert _accepts(integers, "[-999999999999999999, 999999999999999999]")
    assert not _accepts(integers, "[1000000000000000000]")  # 19 digits: past what every int64 holds
    bounded = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
    assert _accepts(bounded, str(2**63 - 1)) and _accepts(bounded, str(-(2**63)))
    assert not _accepts(bounded, str(2**63))
    one_sided = {"type": "integer", "minimum": 0}
    assert _accepts(one_sided, "999999999999999999") and not _accepts(one_sided, "1000000000000000000")
    assert not _accepts(one_sided, "-1")
    # A pattern's own digits are the user's: not bounded.
    assert _accepts({"type": "string", "pattern": "^[1-9][0-9]*$"}, '"' + "9" * 40 + '"')


def test_json_strings_have_one_spelling():
    # Escapes only for what cannot be written raw: "\u0061" is "a", so an additional property
    # could otherwise be a declared one in disguise; no escape spells a lone surrogate either.
    strings = {"type": "array", "items": {"type": "string"}}
    assert _accepts(strings, '["a\\"b\\\\c\\n\\u001f\\t", "é"]')
    for twice in ('["\\u0061"]', '["\\/"]', '["\\ud800"]', '["\\u00e9"]'):
        assert not _accepts(strings, twice)
    mixed = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}}
    assert _accepts(mixed, '{"a": 1, "b": "x"}') and not _accepts(mixed, '{"\\u0061": "x"}')


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


def test_an_object_holds_only_its_declared_properties_unless_it_allows_more():
    # What a tool without parameters gets: `{}` only (a random-weight model would not end an
    # object that allows any property).
    assert _accepts({"type": "object", "properties": {}}, "{}")
    assert not _accepts({"type": "object", "properties": {}}, '{"a": 1}')
    assert _accepts({"type": "object", "properties": {}, "additionalProperties": True}, '{"a": 1}')


# --- every enforced keyword holds (issue 35, fault 5) ----------------------------------------------

_S = {"type": "string", "maxLength": 6}
# Each enforced keyword (docs/structured-outputs.md), alone and in the company it needs; strings and
# arrays bounded, so a random-weight model finishes them.
KEYWORD_SCHEMAS = [
    {"type": "null"},
    {"type": ["integer", "null"]},
    {"type": "integer"},
    {"type": "integer", "minimum": -3},
    {"type": "integer", "exclusiveMinimum": 1.5, "exclusiveMaximum": 9.5},
    {"type": "number"},
    {"type": "number", "minimum": 0.25, "maximum": 0.75},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"minimum": 10},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "pattern": r"^\d+(\.\d{1,2})?$"},
    {"type": "string", "pattern": "^[^a]{1,3}$"},
    {"type": "string", "pattern": "^(cat|dog)s?$"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "time"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "ipv4"},
    {"type": "string", "format": "uuid"},
    {"enum": ["a", 1, None, True, [1], {"k": "v"}]},
    {"type": "string", "enum": ["x", "y"]},
    {"const": {"a": [1, 2]}},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, _S], "items": False},
    {"type": "array", "prefixItems": [{"const": 1}], "items": {"type": "null"}, "maxItems": 3},
    {"type": "object", "properties": {"a": _S, "b": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"a": {"type": "boolean"}}, "additionalProperties": False},
    {"properties": {"k": {"const": "v"}}, "required": ["k"]},
    {"anyOf": [{"type": "integer"}, _S, {"type": "array", "maxItems": 0}]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
     "$ref": "#/$defs/pt"},
    {"definitions": {"d": {"type": "integer", "minimum": 0, "maximum": 3}}, "type": "array",
     "items": {"$ref": "#/definitions/d"}, "maxItems": 2},
    {"title": "T", "description": "d", "default": 1, "examples": [1], "deprecated": False, "readOnly": True,
     "writeOnly": False, "$comment": "c", "type": "boolean", "$schema": "https://json-schema.org/draft/2020-12/schema"},
]
# What a random-weight model may not finish (unbounded strings and keys), for the grammar walks only.
UNBOUNDED_SCHEMAS = [
    {"type": "string", "format": "email"},
    {"type": "string", "format": "ipv6"},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "boolean"}},
    {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}},
    {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
     "required": ["v", "next"]},
    {"type": "object"},
    {"maxItems": 2},
    {},
]
FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def _valid(schema: dict, text: str) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=FORMAT_CHECKER)


def test_every_enforced_keyword_holds_on_a_random_model(llm):
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=i, structured_outputs=StructuredOutputs(json=s))
              for i, s in enumerate(KEYWORD_SCHEMAS)]
    outputs = llm.generate(["Extract:"] * len(params), params, use_tqdm=False)
    for schema, out in zip(KEYWORD_SCHEMAS, outputs, strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        _valid(schema, out.text)


def _walk(matcher: xgr.GrammarMatcher, vocab_size: int, stop: int, rng: random.Random, closers: set[int]) -> list:
    """A random path through the grammar, leaning to tokens that close things; None if unfinished."""
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    tokens = []
    while len(tokens) < 200:
        if matcher.is_terminated():
            return tokens
        matcher.fill_next_token_bitmask(bitmask, 0)
        logits = torch.zeros(1, vocab_size)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        allowed = torch.nonzero(logits[0] == 0).flatten().tolist()
        closing = [t for t in allowed if t in closers]
        token = rng.choice(closing if closing and rng.random() < 0.3 else allowed)
        assert matcher.accept_token(token)
        if token != stop:
            tokens.append(token)
    return None


@pytest.mark.parametrize("schema", KEYWORD_SCHEMAS + UNBOUNDED_SCHEMAS, ids=lambda s: json.dumps(s)[:60])
def test_every_output_the_grammar_allows_validates(llm, schema):
    # Random paths through the grammar (no model): every byte a byte-level model could write,
    # surrogates, overlongs and escapes included; what ends must parse and validate.
    tokenizer, structured = llm.tokenizer, llm.engine.structured
    compiled = structured.compile(StructuredOutputs(json=schema)).result()
    stop = tokenizer.eos_token_id
    closers = {stop} | {i for t, i in tokenizer.get_vocab().items() if t in ('"', "]", "}", ",")}
    rng = random.Random(0)
    finished = 0
    for _ in range(30):
        tokens = _walk(xgr.GrammarMatcher(compiled), structured.vocab_size, stop, rng, closers)
        if tokens is not None:
            finished += 1
            _valid(schema, tokenizer.decode(tokens))
    assert finished >= 10


@pytest.mark.parametrize("regex", [r"[^a]{1,3}", r".{1,3}", r"a(bc+)?", r"\d+(\.\d{1,2})?", r"[\w\s]{2}"])
def test_every_output_a_regex_allows_matches_it(llm, regex):
    # xgrammar's own `.` and negated classes took a newline and the bytes of a surrogate.
    tokenizer, structured = llm.tokenizer, llm.engine.structured
    compiled = structured.compile(StructuredOutputs(regex=regex)).result()
    stop = tokenizer.eos_token_id
    rng = random.Random(0)
    for _ in range(30):
        tokens = _walk(xgr.GrammarMatcher(compiled), structured.vocab_size, stop, rng, {stop})
        assert tokens is not None and re.fullmatch(regex, tokenizer.decode(tokens)), tokenizer.decode(tokens or [])


# --- no compile may stall the others (issue 35, fault 4) -------------------------------------------


def test_a_compile_over_its_budget_is_refused_as_too_complex_and_the_next_one_compiles(llm):
    tokenizer = llm.tokenizer
    manager = StructuredOutputManager(tokenizer, len(tokenizer), [tokenizer.eos_token_id], 8, compile_budget_s=0.5)
    # Within the wire's budget (it unrolls to 1000 characters) but seconds of CPU to compile: only
    # a compile can tell, and it is killed at the budget.
    slow = StructuredOutputs(json={"type": "string", "pattern": "^(([a-z]{0,10}){0,10}){0,10}$"})
    with pytest.raises(SchemaTooComplexError, match=r"cannot be compiled: its grammar did not compile within the "
                                                   r"budget \(0.5 s of CPU"):
        manager.compile(slow).result()
    assert manager.compile(slow).exception() is not None  # refused again at once, from the cache
    quick = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert manager.compile(quick).result().memory_size_bytes > 0


def test_the_compilers_inner_words_reach_the_log_not_the_client(caplog):
    inner = "[08:00:02] /project/cpp/json_schema_converter.cc:974: Check failed: (val <= MAX) is false: Integer"
    assert compiler_message(RuntimeError(inner)) is None
    assert compiler_message(RuntimeError("[08:00:02] /project/cpp/regex_converter.cc:94: Regex parsing error at "
                                         "position 2: Word boundary is not supported yet.\n")) == (
        "Regex parsing error at position 2: Word boundary is not supported yet.")
    failed: Future = Future()
    failed.set_exception(RuntimeError(inner))
    with caplog.at_level(logging.ERROR), pytest.raises(InvalidStructuredOutputError) as info:
        GrammarState(failed).start([])
    assert "Check failed" not in str(info.value) and ".cc" not in str(info.value)
    assert "Check failed" in caplog.text
