"""Entry point of the built-in openvino backend (registered like any third-party plugin).

Importing this module never imports openvino: the backend class imports it lazily, so listing
backends works (and says what to install) when the ``openvino`` extra is missing.
"""

from pagedllm.plugins import hookimpl


@hookimpl
def register_backends(register):
    from pagedllm.backends.openvino.backend import OpenVINOBackend

    register(OpenVINOBackend)
