"""Which LoRA adapter a request runs with, as vLLM names it: ``LoRARequest(lora_name, lora_int_id, lora_path)``."""

from __future__ import annotations

import dataclasses

from pagedllm.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter in peft's format (a folder of ``adapter_config.json`` and ``adapter_model.safetensors``).
    ``lora_int_id`` (1 or more) names it in the engine: requests with the same id share its loaded weights and their
    prefix-cache blocks, which no other adapter (nor the base model) ever reads."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or not \
                1 <= self.lora_int_id < 2**31:
            raise InvalidRequestError(f"lora_int_id must be an integer from 1, got {self.lora_int_id!r}",
                                      param="lora_request")
        if not self.lora_name or not self.lora_path:
            raise InvalidRequestError("a LoRA request needs a name and a path", param="lora_request")
