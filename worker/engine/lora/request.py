"""The adapter a request runs with (vLLM's `LoRARequest`, same fields and order)."""

from __future__ import annotations

from dataclasses import dataclass

from ferry.worker.engine.errors import LoraAdapterError


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """`lora_name` names the adapter (in logs, errors, and `Engine.loras_held`); `lora_path` is a
    PEFT adapter directory, or an `s3://bucket/prefix/` or `hf://org/name[@revision]` reference
    (downloaded once per node into the model cache). `lora_int_id` is kept for vLLM's signature;
    the engine keys adapters by name and path."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoraAdapterError("a LoRARequest needs a lora_name")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise LoraAdapterError(f"LoRA adapter {self.lora_name!r} needs a lora_path (a directory, s3:// or hf://)")

    @property
    def key(self) -> tuple[str, str]:
        """What tells two adapters apart: the same name at another path is another adapter."""
        return (self.lora_name, self.lora_path)
