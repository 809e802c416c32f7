"""Random LoRA adapters written by peft (the reference implementation) for a tiny base checkpoint,
and the reference's greedy tokens: transformers with the adapter merged into the base weights.

Every adapter goes through Ferry's real adapter loading (adapter_config.json +
adapter_model.safetensors, as peft's `save_pretrained` writes them).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def write_adapter(
    base_dir: Path,
    directory: Path,
    r: int = 8,
    alpha: int = 16,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    seed: int = 0,
    std: float = 0.08,
    use_rslora: bool = False,
    **config_overrides,
) -> Path:
    """A PEFT adapter for the checkpoint at `base_dir`, saved to `directory`: both A and B drawn
    from N(0, std) (peft's own init leaves B zero, an adapter that changes nothing)."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM", use_rslora=use_rslora, **config_overrides)
    with warnings.catch_warnings():  # peft calls transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory


def merged_model(base_dir: Path, adapter_dir: Path | None):
    """transformers' model with the adapter merged into its weights (None: the base alone), float32, eval."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return base
    with warnings.catch_warnings():  # (as in write_adapter)
        warnings.simplefilter("ignore", FutureWarning)
        return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


@torch.no_grad()
def reference_greedy(base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]],
                     max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (token ids), the adapter merged."""
    model = merged_model(base_dir, adapter_dir)
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(generated[0, len(prompt):].tolist())
    return out
