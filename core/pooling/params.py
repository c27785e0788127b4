"""What a pooling request asks for, checked when made so a bad value never reaches a step."""

from __future__ import annotations

import dataclasses

from pagedllm.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """vLLM's PoolingParams: ``normalize`` (None: the model's pooler config decides, L2 for embedding models) and
    ``dimensions`` (keep the first N of the vector, then normalize: Matryoshka models are trained for it)."""

    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or not 1 <= self.dimensions <= 2**31 - 1):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {self.dimensions!r}",
                                      param="dimensions")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be true or false, got {self.normalize!r}", param="normalize")
