"""`from xlaserve.lora.request import LoRARequest`: vLLM's import path for the same class."""

from xlaserve.lora import LoRARequest

__all__ = ["LoRARequest"]
