"""The server's LoRA adapters by name (``--lora-modules``, and at run time ``/v1/load_lora_adapter``): a request whose
``model`` is an adapter's name runs with it. Each name gets an id of its own for the engine; a name loaded again
gets a new id, so it never reads KV blocks cached under the adapter it replaced."""

from __future__ import annotations

import itertools
from pathlib import Path

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.lora_request import LoRARequest

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class LoRAModules:
    def __init__(self, base_names: list[str]) -> None:
        self.base_names = base_names
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        """Register an adapter; OpenAIError 400 for a taken name or a folder without ``adapter_config.json``."""
        if name in self._by_name or name in self.base_names:
            raise OpenAIError(400, f"the model name {name!r} is already served", param="lora_name")
        folder = Path(path).expanduser()
        if not (folder / "adapter_config.json").is_file():
            raise OpenAIError(400, f"{path!r} is not a LoRA adapter folder (no adapter_config.json in it)",
                              param="lora_path")
        lora = LoRARequest(name, next(self._ids), str(folder.resolve()))
        self._by_name[name] = lora
        return lora

    def remove(self, name: str) -> None:
        if self._by_name.pop(name, None) is None:
            raise OpenAIError(404, f"no LoRA adapter is named {name!r}", param="lora_name")

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return list(self._by_name)
