"""The models Ferry ships (models/demo, models/draft): within budget, one tokenizer, and Ferry's
engine decodes them exactly as transformers does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

MODELS = Path(__file__).resolve().parents[2] / "models"
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):"]


def test_both_checkpoints_fit_the_size_budget_together():
    files = [p for name in ("demo", "draft") for p in (MODELS / name).iterdir()]
    assert sum(p.stat().st_size for p in files) < 30 * 1024**2


def test_demo_and_draft_share_one_tokenizer():
    assert (MODELS / "demo" / "tokenizer.json").read_bytes() == (MODELS / "draft" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("name", ["demo", "draft"])
def test_ferry_greedy_tokens_match_transformers(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ferry.worker.engine import LLM, SamplingParams

    torch.set_num_threads(1)
    path = str(MODELS / name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = LLM(path).generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = torch.tensor([tokenizer.encode(prompt)])
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.inference_mode():
            expected = reference.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24, do_sample=False
            )[0, ids.shape[1] :].tolist()
        assert list(out.token_ids) == expected


def test_chat_template_renders_a_code_prompt():
    from ferry.worker.engine import Engine

    engine = Engine(str(MODELS / "demo"))
    ids = engine.apply_chat_template(
        [{"role": "system", "content": "sort a list"}, {"role": "user", "content": "def f(xs):"}]
    )
    assert engine.tokenizer.decode(ids) == "# sort a list\ndef f(xs):"
