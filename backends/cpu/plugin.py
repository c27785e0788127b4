"""Entry point of the built-in cpu backend (registered like any third-party plugin)."""

from pagedllm.plugins import hookimpl


@hookimpl
def register_backends(register):
    from pagedllm.backends.cpu.backend import CPUBackend

    register(CPUBackend)
