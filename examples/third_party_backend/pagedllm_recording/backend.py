"""The ``recording`` backend: runs another backend and writes every batch it executes to a JSONL file.

For debugging a scheduler or a backend: each line is one event. ``start`` has the engine's settings and the model,
``step`` one executed batch (its shape, each sequence's query length, context and block table, the rows whose
logits were asked for, and the seconds the wrapped backend took), ``copy_blocks`` a copy-on-write, ``end`` the
step count. Lines are flushed as they are written, so a crash keeps every step before it.

    PAGEDLLM_RECORDING_BACKEND=cpu PAGEDLLM_RECORDING_PATH=steps.jsonl pagedllm generate --backend recording "Hi"
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from pagedllm import Backend, Batch, ConfigError, ModelInfo
from pagedllm.plugins.manager import get_backend_class

INNER_ENV = "PAGEDLLM_RECORDING_BACKEND"  # the backend to wrap (default cpu)
PATH_ENV = "PAGEDLLM_RECORDING_PATH"  # the JSONL file (default pagedllm-recording-<pid>.jsonl)


def inner_backend_class() -> type[Backend]:
    name = os.environ.get(INNER_ENV, "").strip() or "cpu"
    if name == RecordingBackend.name:
        raise ConfigError(f"{INNER_ENV}={name}: the recording backend cannot wrap itself")
    return get_backend_class(name)


class _WrappedClassAttributes(abc.ABCMeta):
    """pagedllm reads these from the backend's class before it makes one: answer with the wrapped backend's."""

    @property
    def default_block_size(cls) -> int:
        return inner_backend_class().default_block_size

    @property
    def env_vars(cls) -> dict[str, tuple[str, ...]]:
        return inner_backend_class().env_vars

    @property
    def settings(cls) -> tuple:
        # Listing every backend's flags must not fail when the wrapped one cannot be found; then it has none.
        try:
            return inner_backend_class().settings
        except Exception:
            return ()


class RecordingBackend(Backend, metaclass=_WrappedClassAttributes):
    name = "recording"
    _checking = False

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        if cls._checking:  # the error for an unknown wrapped backend lists all backends, this one included
            return False, "checking the backend it wraps"
        cls._checking = True
        try:
            inner_backend_class()
        except Exception as exc:  # any reason the wrapped backend cannot run is this one's too
            return False, f"the backend to wrap ({INNER_ENV}) cannot run: {exc}"
        finally:
            cls._checking = False
        return True, ""

    def __init__(self, config, model) -> None:
        super().__init__(config, model)
        self.inner = inner_backend_class()(config, model)
        self.path = Path(os.environ.get(PATH_ENV, "").strip() or f"pagedllm-recording-{os.getpid()}.jsonl")
        self._file = None
        self._info: ModelInfo | None = None
        self._steps = 0

    @property
    def writes_kv_before_attention(self) -> bool:
        return self.inner.writes_kv_before_attention

    def _write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    # -- the contract, passed through ----------------------------------------------------------------------
    def load_model(self) -> ModelInfo:
        self._info = self.inner.load_model()
        return self._info

    def check_block_size(self, block_size: int) -> None:
        self.inner.check_block_size(block_size)

    def kv_cache_bytes_per_block(self) -> int:
        return self.inner.kv_cache_bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.inner.allocate_kv_cache(num_blocks)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", buffering=1, encoding="utf-8")  # line-buffered: flushed per line
        c = self.config
        self._write({"event": "start", "backend": self.inner.name, "model": self.model.name,
                     "model_info": dataclasses.asdict(self._info), "num_blocks": num_blocks,
                     "block_size": c.block_size, "max_num_seqs": c.max_num_seqs,
                     "max_num_batched_tokens": c.max_num_batched_tokens, "max_model_len": c.max_model_len,
                     "chunked_prefill": c.enable_chunked_prefill, "prefix_caching": c.enable_prefix_caching})

    def execute(self, batch: Batch):
        wall = time.time()
        start = time.perf_counter()
        logits = self.inner.execute(batch)
        seconds = time.perf_counter() - start
        self._steps += 1
        blocks = batch.num_blocks_per_seq()
        self._write({
            "event": "step", "step": self._steps, "time": wall, "seconds": round(seconds, 6),
            "num_seqs": batch.num_seqs, "num_tokens": batch.num_tokens, "num_decodes": batch.num_decodes,
            "query_lens": np.diff(batch.query_start_loc).tolist(), "num_computed": batch.num_computed.tolist(),
            "seq_lens": batch.seq_lens.tolist(),
            "block_table": [row[:n].tolist() for row, n in zip(batch.block_table, blocks)],
            "logits_indices": batch.logits_indices.tolist(), "logits_shape": list(np.shape(logits))})
        return logits

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        self._write({"event": "copy_blocks", "after_step": self._steps, "src": src.tolist(), "dst": dst.tolist()})
        self.inner.copy_blocks(src, dst)

    def warm_up(self, batch: Batch) -> None:
        self.inner.warm_up(batch)  # start-up, not a step: not recorded

    def describe(self) -> str:
        return f"recording every step to {self.path}; wrapped backend {self.inner.name}: {self.inner.describe()}"

    def release_thread(self) -> None:
        self.inner.release_thread()

    def shutdown(self) -> None:
        if self._file is not None:
            self._write({"event": "end", "steps": self._steps})
            self._file.close()
            self._file = None
        self.inner.shutdown()
