"""The engine's loaded LoRA adapters: loaded into the backend on a request's first use, kept up to
``max_cpu_loras``, the least recently used one that no request runs with unloaded for a new one."""

from __future__ import annotations

import collections
import logging
import time

from pagedllm.backend import Backend
from pagedllm.config import EngineConfig
from pagedllm.errors import InvalidRequestError, QueueFullError
from pagedllm.lora_request import LoRARequest

logger = logging.getLogger("pagedllm.engine.lora")
# adapters kept loaded unless --max-cpu-loras says otherwise: queued requests keep theirs loaded, so a bound of
# max_loras would refuse a second adapter while the first one's requests wait
DEFAULT_CPU_LORAS = 16


class LoadedAdapters:
    def __init__(self, backend: Backend, config: EngineConfig) -> None:
        self.backend = backend
        self.enabled = config.enable_lora
        self.max_rank = config.max_lora_rank
        self.capacity = config.max_cpu_loras or max(config.max_loras, DEFAULT_CPU_LORAS)
        self._loaded: collections.OrderedDict[int, LoRARequest] = collections.OrderedDict()  # least recent first

    def ensure(self, lora: LoRARequest, in_use: set[int]) -> None:
        """Make ``lora`` loaded; InvalidRequestError if adapters are off, its id names another adapter, it cannot
        be loaded, or every loaded one is in use."""
        if not self.enabled:
            raise InvalidRequestError(f"LoRA adapter {lora.lora_name!r} asked for, but adapters are off: start with "
                                      f"--enable-lora", param="model")
        loaded = self._loaded.get(lora.lora_int_id)
        if loaded is not None:
            if (loaded.lora_name, loaded.lora_path) != (lora.lora_name, lora.lora_path):
                if lora.lora_int_id in in_use:
                    raise InvalidRequestError(f"lora_int_id {lora.lora_int_id} is adapter {loaded.lora_name!r} "
                                              f"({loaded.lora_path}), which requests still run with",
                                              param="lora_request")
                self.remove(lora.lora_int_id)
            else:
                self._loaded.move_to_end(lora.lora_int_id)
                return
        while len(self._loaded) >= self.capacity:
            idle = next((i for i in self._loaded if i not in in_use), None)
            if idle is None:
                raise QueueFullError(f"{len(self._loaded)} adapters are loaded and in use by queued or running "
                                     f"requests (--max-cpu-loras {self.capacity}): try again when one is done")
            self.remove(idle)
        start = time.perf_counter()
        try:
            self.backend.add_lora(lora.lora_int_id, lora.lora_path, self.max_rank)
        except Exception as exc:  # a damaged file, a shape that does not fit: this request's fault only
            raise InvalidRequestError(f"LoRA adapter {lora.lora_name!r} cannot be loaded from {lora.lora_path}: "
                                      f"{exc}", param="lora_request") from None
        self._loaded[lora.lora_int_id] = lora
        logger.info("LoRA adapter %s (id %d) loaded from %s in %.2f s", lora.lora_name, lora.lora_int_id,
                    lora.lora_path, time.perf_counter() - start)

    def remove(self, lora_id: int) -> bool:
        lora = self._loaded.pop(lora_id, None)
        if lora is None:
            return False
        self.backend.remove_lora(lora_id)
        logger.info("LoRA adapter %s (id %d) unloaded", lora.lora_name, lora_id)
        return True
