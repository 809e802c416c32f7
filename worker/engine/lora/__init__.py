"""LoRA adapters in the engine: `LoRARequest` names one for a request, `LoraManager` loads them
off the engine thread and keeps them in the model's device slots (worker/models/lora_layers.py)."""

from ferry.worker.engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
