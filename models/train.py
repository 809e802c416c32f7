"""Train Ferry's shipped models on the Python standard library's own source, on CPU, from a seed.

Writes two Hugging Face checkpoints (config.json, model.safetensors, tokenizer.json) that share
one byte-level BPE tokenizer:

  models/demo/    a small code-completion model: the target of the speculative-decoding pair
  models/draft/   a much smaller model with the same tokenizer: the speculative-decoding draft

plus models/loss.png (train and held-out loss) and models/training.json (what ran: corpus,
configs, steps, wall time, losses, greedy samples).

The corpus is every `.py` file under this Python's standard library (PSF licence, on every
machine, no download), minus tests, codec tables and generated files, deduplicated; about one
file in 32, chosen by a hash of its path, is held out for the validation loss.

Each model stops at its step budget or its wall-clock cap, whichever comes first, and saves;
the learning rate anneals on whichever of the two is nearer to done, so a capped run still
ends cooled down. On a machine that reaches the step budgets first, two runs give the same
weights (same seed, one thread).

    .venv/bin/python models/train.py                                 # the committed run
    .venv/bin/python models/train.py --demo-steps 20 --draft-steps 20 --out /tmp/m   # a smoke run
"""

from __future__ import annotations

import os

# One thread everywhere, before the libraries start their pools: the machine is shared.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data"}
HELD_OUT_ONE_IN = 32
CHAT_TEMPLATE = (
    # A code model has no chat turns: a system message becomes a comment, user and assistant
    # content are plain code, and an assistant turn ends with </s>.
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}# {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}</s>"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% endfor %}"
)
SAMPLE_PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\n\ndef list_python_files(root):",
    'def is_prime(n):\n    """Return True if n is a prime number."""',
]


@dataclass
class ModelSpec:
    """One model's shape and its training budget."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    steps: int  # step budget: the schedule's length when the clock is not the limit
    minutes: float  # wall-clock cap
    lr: float
    batch_size: int = 8
    seq_len: int = 256
    warmup: int = 30


@dataclass
class Corpus:
    train: list[str]  # file texts, sorted by path
    held_out: list[str]
    num_files: int
    num_duplicates: int
    num_bytes: int
    root: str


@dataclass
class History:
    """One model's training record, as written to training.json and plotted."""

    name: str
    num_params: int
    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    steps_done: int = 0
    stopped_by: str = "steps"  # "steps" | "wall-clock cap"
    wall_s: float = 0.0
    final_held_out_loss: float = math.nan
    samples: dict[str, str] = field(default_factory=dict)


def collect_corpus(root: Path) -> Corpus:
    """Every library `.py` file under `root`, deduplicated by content, split by a hash of its path."""
    train, held_out, seen, duplicates, total = [], [], set(), 0, 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest = hashlib.sha256(text.encode()).digest()
        if digest in seen or not text.strip():
            duplicates += digest in seen
            continue
        seen.add(digest)
        total += len(text.encode())
        split = hashlib.sha256(rel.as_posix().encode()).digest()[0] % HELD_OUT_ONE_IN
        (held_out if split == 0 else train).append(text)
    return Corpus(train, held_out, len(seen), duplicates, total, str(root))


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (any byte string encodes) with <s>, </s> and the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def encode(tokenizer, texts: list[str]) -> torch.Tensor:
    """All files as one stream of token ids, each file wrapped in <s> ... </s>."""
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts):
        ids += [tokenizer.bos_token_id, *enc.ids, tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.int32)


def make_model(spec: ModelSpec, tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=2048,  # trained on 256-token windows; longer contexts run, less well
        rope_theta=10000.0,
        tie_word_embeddings=True,  # the head is a large share of so small a model
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def held_out_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """`count` evenly spaced, non-overlapping windows: [count, seq_len]."""
    stride = (len(stream) - seq_len) // count
    return torch.stack([stream[i * stride : i * stride + seq_len] for i in range(count)]).long()


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int = 16) -> float:
    model.eval()
    losses = [model(input_ids=b, labels=b).loss.item() for b in windows.split(batch_size)]
    model.train()
    return sum(losses) / len(losses)


def lr_at(spec: ModelSpec, step: int, elapsed: float, peak: float) -> float:
    """Linear warmup, then cosine to 10% of the peak over whichever budget is nearer to done."""
    if step < spec.warmup:
        return peak * (step + 1) / spec.warmup
    progress = min(1.0, max(step / spec.steps, elapsed / (spec.minutes * 60)))
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train_model(spec: ModelSpec, tokenizer, train_ids: torch.Tensor, eval_ids: torch.Tensor, seed: int, eval_every: int):
    model = make_model(spec, tokenizer, seed)
    history = History(spec.name, sum(p.numel() for p in model.parameters()))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr, betas=(0.9, 0.95),
    )
    batches = torch.Generator().manual_seed(seed)
    probe = held_out_windows(eval_ids, spec.seq_len, 16)
    start = time.monotonic()
    bar = tqdm(total=spec.steps, desc=f"{spec.name} ({history.num_params / 1e6:.2f}M params)", unit="step", file=sys.stderr)
    for step in range(spec.steps):
        elapsed = time.monotonic() - start
        if elapsed > spec.minutes * 60:
            history.stopped_by = "wall-clock cap"
            break
        for group in optim.param_groups:
            group["lr"] = lr_at(spec, step, elapsed, spec.lr)
        offsets = torch.randint(0, len(train_ids) - spec.seq_len, (spec.batch_size,), generator=batches)
        batch = torch.stack([train_ids[o : o + spec.seq_len] for o in offsets.tolist()]).long()  # [B, T]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        history.steps.append(step + 1)
        history.train_loss.append(round(loss.item(), 4))
        history.steps_done = step + 1
        if (step + 1) % eval_every == 0:
            history.eval_steps.append(step + 1)
            history.eval_loss.append(round(evaluate(model, probe), 4))
        bar.set_postfix(loss=f"{loss.item():.3f}", held_out=history.eval_loss[-1] if history.eval_loss else "-")
        bar.update()
    bar.close()
    history.wall_s = round(time.monotonic() - start, 1)
    history.final_held_out_loss = round(evaluate(model.eval(), held_out_windows(eval_ids, spec.seq_len, 64)), 4)
    return model.eval(), history


@torch.no_grad()
def greedy_samples(model, tokenizer, max_new_tokens: int) -> dict[str, str]:
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
        samples[prompt] = tokenizer.decode(out[0, ids.shape[1] :].tolist())
    return samples


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "models")
    p.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: leave the other core to others)")
    p.add_argument("--demo-steps", type=int, default=5000)
    p.add_argument("--demo-minutes", type=float, default=44.0)
    p.add_argument("--draft-steps", type=int, default=800)
    p.add_argument("--draft-minutes", type=float, default=9.0)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--sample-tokens", type=int, default=64)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    specs = [
        # At this budget (a few million tokens) the step count limits the loss more than width or
        # depth: a first run with a 6-layer demo at lr 2e-3 ended behind the 2-layer draft.
        ModelSpec("demo", 192, 4, 6, 2, 512, args.demo_steps, args.demo_minutes, lr=3e-3),
        ModelSpec("draft", 128, 2, 4, 2, 352, args.draft_steps, args.draft_minutes, lr=3e-3),
    ]
    corpus = collect_corpus(args.stdlib)
    print(f"corpus: {corpus.num_files} files, {corpus.num_bytes / 1e6:.1f} MB, {len(corpus.held_out)} held out", file=sys.stderr)
    tokenizer = train_tokenizer(corpus.train, args.vocab_size)
    train_ids, eval_ids = encode(tokenizer, corpus.train), encode(tokenizer, corpus.held_out)
    print(f"tokens: {len(train_ids):,} train, {len(eval_ids):,} held out", file=sys.stderr)
    histories = []
    for spec in specs:
        model, history = train_model(spec, tokenizer, train_ids, eval_ids, args.seed, args.eval_every)
        history.samples = greedy_samples(model, tokenizer, args.sample_tokens)
        model.save_pretrained(args.out / spec.name)
        tokenizer.save_pretrained(args.out / spec.name)
        histories.append(history)
        print(f"{spec.name}: held-out loss {history.final_held_out_loss} after {history.steps_done} steps "
              f"({history.stopped_by}, {history.wall_s:.0f} s)", file=sys.stderr)

    from bench.plots import plot_training

    plot_training(histories, args.out / "loss.png")
    record = {
        "command": " ".join(["models/train.py", *(argv if argv is not None else sys.argv[1:])]),
        "args": {k: str(v) for k, v in vars(args).items()},
        "niceness": os.nice(0),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "corpus": {k: v for k, v in asdict(corpus).items() if k not in ("train", "held_out")}
        | {"train_tokens": len(train_ids), "held_out_tokens": len(eval_ids), "held_out_files": len(corpus.held_out)},
        "specs": [asdict(s) for s in specs],
        "models": [asdict(h) for h in histories],
        "total_wall_s": round(time.monotonic() - started, 1),
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
