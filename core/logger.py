"""One ``pagedllm`` logger tree with a default handler, so logs say what was chosen out of the box."""

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
_configured = False


def configure_logging() -> None:
    """Attach a stderr handler to the ``pagedllm`` logger once (PAGEDLLM_LOGGING_LEVEL, default INFO).

    ``PAGEDLLM_CONFIGURE_LOGGING=0`` leaves logging entirely to the application.
    """
    global _configured
    if _configured or os.environ.get("PAGEDLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    _configured = True
    root = logging.getLogger("pagedllm")
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper())
    root.propagate = False

