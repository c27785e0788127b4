"""pagedllm-recording: the ``recording`` backend (see backend.py) and a reader for what it writes (``python -m
pagedllm_recording FILE``)."""

from pagedllm_recording.backend import INNER_ENV, PATH_ENV, RecordingBackend

__all__ = ["RecordingBackend", "INNER_ENV", "PATH_ENV"]
