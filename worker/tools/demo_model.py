"""A small local model for `ferry up` when none is configured: random Llama weights and a real
byte-level BPE tokenizer (with a chat template), saved as an ordinary HF checkpoint.

Its text is gibberish, but every byte goes through the real loading, tokenizing, batching,
streaming and detokenizing paths, and it needs no network. A trained demo model replaces it later.
"""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "Ferry serves language models behind an async job API with streaming and webhooks.",
    "A worker pulls jobs from Redis Streams into a continuously batched, paged-attention engine.",
    "The prefix cache is snapshotted to object storage, so a cold worker starts warm.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Grüße aus Zürich — naïve café, 東京, and multi-byte characters stream correctly.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_level_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on `texts`, with <s>, </s>, <unk> and the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_demo_model(directory: Path, *, vocab_size: int = 512, hidden_size: int = 128, num_layers: int = 2) -> Path:
    """Write the checkpoint to `directory` (created) and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_level_bpe(CORPUS * 4, vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        initializer_range=0.25,  # peaked logits: varied, deterministic greedy text
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    import sys

    print(f"wrote {make_demo_model(Path(sys.argv[1]))}")
