"""vLLM's extra sampling fields, checked against a reference: greedy tokens against transformers'
`generate` on the same weights (allowed_token_ids as its `prefix_allowed_tokens_fn`, bad_words as
its `bad_words_ids`), text against the tokenizer's own decode (skip_special_tokens,
spaces_between_special_tokens), and the stop and prompt options against the plain run."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ferry.worker.engine import LLM, InvalidSamplingParams, SamplingParams
from ferry.worker.engine.detokenizer import IncrementalDetokenizer

PROMPT = [5, 6, 7, 8, 9, 10]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir))


@pytest.fixture(scope="module")
def reference(llama_dir):
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()

    def generate(**kwargs) -> list[int]:
        ids = torch.tensor([PROMPT])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, **kwargs)
        return out[0, len(PROMPT):].tolist()

    return generate


def _greedy(llm: LLM, prompt=PROMPT, **params):
    params = SamplingParams(**{"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True, **params})
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_allowed_token_ids_match_transformers_prefix_allowed_tokens(llm, reference):
    plain = reference()
    allowed = sorted({40, 41, 42, 43, 44, plain[1]} - {plain[0]})  # the first free token is not allowed
    out = _greedy(llm, allowed_token_ids=allowed).token_ids
    assert out == reference(prefix_allowed_tokens_fn=lambda _batch, _ids: allowed)
    assert set(out) <= set(allowed) and out != plain


def test_allowed_token_ids_beyond_the_vocabulary_or_empty_are_refused(llm):
    with pytest.raises(InvalidSamplingParams, match="allowed_token_ids"):
        _greedy(llm, allowed_token_ids=[llm.engine.arch.vocab_size])
    with pytest.raises(InvalidSamplingParams, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_bad_words_match_transformers_bad_words_ids(llm, reference):
    plain = _greedy(llm)
    assert plain.token_ids == reference()
    tokenizer = llm.engine.tokenizer
    # A word the free run generates: two of its tokens, decoded, that tokenize back to those two.
    for i in range(1, NEW_TOKENS - 1):
        word = tokenizer.decode(plain.token_ids[i:i + 2])
        banned = llm.engine.inputs.bad_words_token_ids([word])
        if plain.token_ids[i:i + 2] in banned:
            break
    else:
        pytest.fail("no two generated tokens spell a word that tokenizes back to them")
    out = _greedy(llm, bad_words=[word]).token_ids
    assert out == reference(bad_words_ids=banned)
    assert out != plain.token_ids
    for ids in banned:  # never generated: no window of the output is a banned sequence
        assert all(out[i:i + len(ids)] != ids for i in range(len(out)))


def test_a_one_token_bad_word_is_never_sampled(llm):
    plain = _greedy(llm).token_ids
    word = llm.engine.tokenizer.decode([plain[0]])
    banned = llm.engine.inputs.bad_words_token_ids([word])
    out = _greedy(llm, bad_words=[word]).token_ids
    assert not {ids[0] for ids in banned if len(ids) == 1} & set(out)


def test_skip_special_tokens_and_spaces_between_them(llm):
    eos = llm.engine.tokenizer.eos_token_id
    forced = {"logit_bias": {eos: 100.0}, "max_tokens": 3}  # EOS three times (ignore_eos keeps it going)
    assert _greedy(llm, **forced).text == ""
    assert _greedy(llm, **forced, skip_special_tokens=False, spaces_between_special_tokens=False).text == "</s>" * 3
    assert _greedy(llm, **forced, skip_special_tokens=False).text == " </s> </s> </s>"


def test_spaced_decode_is_hugging_face_slow_decode():
    """Hugging Face's slow tokenizers (and vLLM's slow detokenizer) join the text between added
    tokens and the added tokens themselves with spaces."""
    from tests.tiny_models import _tokenizer

    tokenizer = _tokenizer(384)
    ids = tokenizer.encode("The quick") + [tokenizer.eos_token_id] + tokenizer.encode(" fox")
    for spaced, expected in ((True, "The quick </s>  fox"), (False, "The quick</s> fox")):
        detok = IncrementalDetokenizer(tokenizer, [], [], skip_special_tokens=False,
                                       spaces_between_special_tokens=spaced)
        for token in ids:
            detok.add_tokens([token])
        assert detok.text == expected


def test_include_stop_str_in_output_keeps_the_stop_string(llm):
    text = _greedy(llm, max_tokens=40).text
    start = next(i for i in range(8, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    stop = text[start:start + 3]
    cut = _greedy(llm, max_tokens=40, stop=[stop])
    kept = _greedy(llm, max_tokens=40, stop=[stop], include_stop_str_in_output=True)
    assert cut.text == text[:text.index(stop)]
    assert kept.text == text[:text.index(stop) + len(stop)]
    assert kept.token_ids == cut.token_ids and kept.stop_reason == stop


def test_a_stop_token_is_text_only_with_include_stop_str_in_output(llm):
    plain = _greedy(llm)
    stop_token = plain.token_ids[4]
    first = plain.token_ids.index(stop_token)
    cut = _greedy(llm, stop_token_ids=[stop_token])
    kept = _greedy(llm, stop_token_ids=[stop_token], include_stop_str_in_output=True)
    tokenizer = llm.engine.tokenizer
    assert cut.token_ids == kept.token_ids == plain.token_ids[:first + 1]
    assert kept.text.startswith(cut.text) and len(kept.text) > len(cut.text)
    assert kept.text == _greedy(llm, max_tokens=first + 1).text
    assert tokenizer.decode([stop_token]) in kept.text


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    long_prompt = list(range(20, 60))
    out = _greedy(llm, long_prompt, truncate_prompt_tokens=7)
    assert out.num_prompt_tokens == 7
    assert out.token_ids == _greedy(llm, long_prompt[-7:]).token_ids
    assert out.token_ids != _greedy(llm, long_prompt).token_ids
    assert _greedy(llm, long_prompt, truncate_prompt_tokens=100).token_ids == _greedy(llm, long_prompt).token_ids
