"""The module the `pagedllm` entry point names: it hands pagedllm the backend class."""

from pagedllm.plugins import hookimpl


@hookimpl
def register_backends(register):
    from pagedllm_recording.backend import RecordingBackend  # imported when backends are listed: keep it light

    register(RecordingBackend)
