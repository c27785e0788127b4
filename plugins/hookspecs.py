"""The hooks a pagedllm plugin may implement.

A plugin is any module listed under the ``pagedllm`` entry-point group; the built-in ``cpu`` and
``openvino`` backends are registered exactly this way.
"""

from typing import Callable

import pluggy

hookspec = pluggy.HookspecMarker("pagedllm")
hookimpl = pluggy.HookimplMarker("pagedllm")


@hookspec
def register_backends(register: Callable[[type], None]) -> None:
    """Call ``register(BackendClass)`` once for each backend the plugin provides.

    A backend class subclasses :class:`pagedllm.Backend`. Registering must be cheap: import heavy
    runtimes (openvino, IPEX) lazily, inside the class's methods, so that listing backends never
    fails because one of them is not installed.
    """
