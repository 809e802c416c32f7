"""Loading: everything an engine needs from its checkpoint before it takes a request, as one
`LoadedModel` (the model's facts, its tokenizer and defaults, the executor running its weights,
the KV pool's size).

Two orders matter: the tensor-parallel check runs before any weight is read, and the KV pool is
sized once the weights are in memory, at the smallest of every rank's budget.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from ferry.worker.engine.config import EngineConfig
from ferry.worker.engine.errors import LoraAdapterError
from ferry.worker.engine.executor import Executor, ParallelExecutor, check_tensor_parallel
from ferry.worker.engine.kv_budget import kv_budget_bytes, split_pool
from ferry.worker.engine.model_runner import ModelRunner
from ferry.worker.engine.parallel.group import RankGroup
from ferry.worker.engine.parallel.wire import RankSpec
from ferry.worker.engine.prefix_io import KV_LAYOUT, KVLayout
from ferry.worker.engine.spec.proposers import load_draft
from ferry.worker.models.config import ModelArch, UnsupportedModelError
from ferry.worker.models.fallback import fallback_arch
from ferry.worker.models.kv_split import kv_split, may_release_behind_windows
from ferry.worker.models.loader import gguf_file, load_model, parse_dtype, resolve_model_path
from ferry.worker.models.lora_layers import attach_lora
from ferry.worker.models.quantization import Quantization, resolve_quantization
from ferry.worker.models.sharding import UNSHARDED, local_arch
from ferry.worker.protocol.sampling import MODEL_DEFAULTS

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    """One model, loaded and ready to step: what the engine's parts are built from."""

    model_dir: Path  # the checkpoint directory (a GGUF converted into the model cache, a hub id resolved)
    arch: ModelArch  # the whole model's shapes, not one rank's shard
    dtype: torch.dtype  # of the weights and the KV pool
    device: torch.device  # rank 0's (the engine's process)
    max_model_len: int  # prompt + output tokens per request: the config's, within what the model supports
    tokenizer: object | None  # a transformers tokenizer; None: prompts are token ids, outputs carry no text
    eos_token_ids: tuple[int, ...]  # every id that ends a request: config.json, generation_config.json, tokenizer
    sampling_defaults: dict[str, float | int]  # what generation_config.json sets of MODEL_DEFAULTS' fields
    quantization: str  # "none" | "gguf" | "int8": how the weights are held in memory
    executor: Executor  # runs a step: rank 0's model runner (and the other ranks' processes)
    num_blocks: int  # the KV pool's blocks, the same on every rank
    # a hybrid model's windowed layers' pool (worker.models.kv_split; 0: one pool for every layer)
    num_window_blocks: int
    draft: tuple | None  # (model, arch) of the speculative draft model (method "draft"), else None
    model_salt: str  # the prefix cache's namespace for this model: equal salts, shareable KV
    kv_layout: KVLayout  # one block of KV as snapshots save and restore it (every kv head, every rank's)

    @property
    def runner(self) -> ModelRunner:
        return self.executor.runner


def load(config: EngineConfig) -> LoadedModel:
    """Read the checkpoint, load the weights (spawning the other ranks at tensor_parallel_size > 1),
    size the KV pool and build the executor."""
    model_dir = resolve_model_path(config.model, config.model_cache_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    arch = model_arch(hf_config, config.model_impl)
    dtype = parse_dtype(config.dtype, getattr(hf_config, "dtype", None))
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    max_model_len = _max_model_len(arch, config.max_model_len)
    tokenizer = _load_tokenizer(model_dir)
    torch.manual_seed(config.seed)

    tp = config.tensor_parallel_size
    check_tensor_parallel(arch, tp, device, config.quantization)  # before any weight is read
    if config.enable_lora and arch.implementation == "transformers":
        raise LoraAdapterError(f"enable_lora: {arch.architecture} runs on the transformers fallback, which takes no "
                               "LoRA adapters (Ferry's native decoder does)")
    if tp > 1 and device.type == "cuda":
        device = torch.device("cuda", 0)  # rank r runs on cuda:r
    # Quantized weights load on one rank only: the format's default at tensor_parallel_size > 1 is float.
    requested = config.quantization if tp == 1 or config.quantization is not None else "none"
    quantization = resolve_quantization(requested, gguf_file(config.model, config.model_cache_dir), device, dtype)
    spec = RankSpec(
        model_dir=str(model_dir), arch=arch, dtype=dtype, device_type=device.type, max_model_len=max_model_len,
        block_size=config.block_size, kv_cache_bytes=config.kv_cache_bytes, max_num_seqs=config.max_num_seqs,
        size=tp, num_threads=torch.get_num_threads(), store_port=0, timeout_s=config.tensor_parallel_timeout_s,
        lora_slots=(config.max_loras, config.max_lora_rank) if config.enable_lora else None,
    )
    group = RankGroup(spec) if tp > 1 else None  # the other ranks load their shards meanwhile
    try:
        executor, (num_blocks, num_window_blocks), pool_bytes, draft = _start_executor(
            config, spec, device, tokenizer, group, quantization)
    except BaseException:
        if group is not None:
            group.close()
        raise

    block_shape = (arch.num_layers, 2, arch.num_kv_heads, config.block_size, arch.head_dim)
    loaded = LoadedModel(
        model_dir=model_dir,
        arch=arch,
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(model_dir, arch, tokenizer),
        sampling_defaults=_sampling_defaults(model_dir),
        quantization=quantization.method,
        executor=executor,
        num_blocks=num_blocks,
        num_window_blocks=num_window_blocks,
        draft=draft,
        model_salt=config.model_salt or _default_model_salt(model_dir, dtype, quantization.method, arch.implementation),
        kv_layout=KVLayout(KV_LAYOUT, block_shape, dtype, config.block_size),
    )
    log.info(
        "engine ready: %s (%s) on %s, %s, quantization %s, tensor parallel %d, KV pool %d blocks x %d tokens%s "
        "(%.1f MiB per rank), max_model_len %d",
        model_dir.name, arch.architecture, device, dtype, loaded.quantization, tp, num_blocks, config.block_size,
        f" (+{num_window_blocks} blocks of the sliding-window layers)" if num_window_blocks else "",
        pool_bytes / 2**20, max_model_len,
    )
    return loaded


def model_arch(hf_config, model_impl: str = "auto") -> ModelArch:
    """The model's facts and which code runs it (EngineConfig.model_impl), said in one log line:
    Ferry's native decoder, or the transformers fallback (and why native does not run it)."""
    if model_impl == "transformers":
        arch = fallback_arch(hf_config)
        log.info("model implementation: transformers fallback for %s (model_impl='transformers')", arch.architecture)
        return arch
    try:
        arch = ModelArch.from_hf_config(hf_config)
    except UnsupportedModelError as native_refused:
        if model_impl == "ferry":
            raise
        try:
            arch = fallback_arch(hf_config)
        except UnsupportedModelError as fallback_refused:
            raise UnsupportedModelError(f"{native_refused}; {fallback_refused}") from None
        log.info("model implementation: transformers fallback for %s (Ferry's native decoder: %s)",
                 arch.architecture, native_refused)
        return arch
    log.info("model implementation: Ferry's native decoder for %s", arch.architecture)
    return arch


def _max_model_len(arch: ModelArch, wanted: int | None) -> int:
    limit = arch.max_position_embeddings  # sliding windows are honoured by the attention kernels
    if wanted is None:
        return limit
    if wanted > limit:
        raise ValueError(f"max_model_len={wanted} exceeds what the model supports ({limit})")
    return wanted


def _load_tokenizer(model_dir: Path):
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any((model_dir / n).is_file() for n in names):
        log.warning("no tokenizer in %s: prompts must be token ids and outputs carry no text", model_dir)
        return None
    return AutoTokenizer.from_pretrained(model_dir)


def _eos_token_ids(model_dir: Path, arch: ModelArch, tokenizer) -> tuple[int, ...]:
    ids = set(arch.eos_token_ids)
    if (model_dir / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        ids.update(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def _sampling_defaults(model_dir: Path) -> dict[str, float | int]:
    """The sampling values the model's generation_config.json sets (only those it names: the
    fields a client leaves unset take them, see `SamplingParams.resolved`)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    found = {name: config[name] for name in MODEL_DEFAULTS if config.get(name) is not None}
    if found:
        log.info("sampling defaults from generation_config.json: %s", found)
    return found


def _start_executor(config: EngineConfig, spec: RankSpec, device: torch.device, tokenizer,
                    group: RankGroup | None, quantization: Quantization) -> tuple[Executor, tuple[int, int], int,
                                                                                  tuple | None]:
    """Load this rank's shard of the model (and the draft model, whole, for method "draft"), size
    the KV pool (the smallest of every rank's) and build the executor. Returns it, the pools' block
    counts (main, windowed), their bytes on this rank and the draft."""
    shard = UNSHARDED if group is None else group.shard
    arch, dtype, block_size, max_model_len = spec.arch, spec.dtype, spec.block_size, spec.max_model_len
    model = load_model(Path(spec.model_dir), arch, dtype, device, max_model_len, quantization, shard)
    if spec.lora_slots is not None:  # after the weights are packed: the slots wrap the packed projections
        attach_lora(model, *spec.lora_slots)
    draft = None
    if config.speculative is not None and config.speculative.method == "draft":  # whole, on rank 0
        draft = load_draft(config.speculative.draft_model, arch, tokenizer, dtype, device, max_model_len,
                           config.model_cache_dir)
    local = local_arch(arch, shard)
    bytes_per_block = ModelRunner.bytes_per_block(local, block_size, dtype)
    if draft is not None:  # the draft's KV pool mirrors the target's blocks, from the same budget
        bytes_per_block += ModelRunner.bytes_per_block(draft[1], block_size, dtype)
    ranks_per_host = shard.size if device.type == "cpu" else 1
    num_blocks = kv_budget_bytes(config.kv_cache_bytes, device, max_model_len, block_size, config.max_num_seqs,
                                 bytes_per_block, ranks_per_host) // bytes_per_block
    # A hybrid model's windowed layers get a pool of their own, which releases blocks out of the window.
    split = kv_split(arch) if may_release_behind_windows(arch, draft is not None) else None

    def pools(count: int) -> tuple[int, int]:  # from the smallest of every rank's counts
        if count * block_size < max_model_len:
            raise ValueError(
                f"a KV pool of {count} blocks x {block_size} tokens cannot hold one sequence of "
                f"max_model_len={max_model_len}; raise kv_cache_bytes (needs at least "
                f"{-(-max_model_len // block_size) * bytes_per_block} bytes) or lower max_model_len"
            )
        return split_pool(count, split, block_size, config.max_num_seqs, config.step_token_budget(device.type))

    sizes = pools(num_blocks) if group is None else group.agree_num_blocks(num_blocks, pools)
    if group is None:
        executor = Executor(ModelRunner(model, local, sizes[0], block_size, dtype, device, sizes[1]))
    else:
        executor = ParallelExecutor(group, arch, model, local, sizes, block_size, dtype, device)
    pools_in_use = [p for p in (executor.runner.kv_cache, executor.runner.window_kv_cache) if p is not None]
    return executor, sizes, sum(p.numel() * p.element_size() for p in pools_in_use), draft


def _default_model_salt(model_dir: Path, dtype: torch.dtype, quantization: str, implementation: str) -> str:
    config_text = (model_dir / "config.json").read_text()
    # Quantized weights (or the transformers fallback's kernels) compute other KV; a native
    # unquantized engine keeps the salt it always had.
    held = "" if quantization == "none" else f"|{quantization}"
    held += "|transformers" if implementation == "transformers" else ""
    return hashlib.sha256(f"{config_text}|{dtype}{held}".encode()).hexdigest()[:16]
