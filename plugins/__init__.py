"""Plugin system: backends (and later other extensions) are found through pluggy entry points."""

from pagedllm.plugins.hookspecs import hookimpl
from pagedllm.plugins.manager import (
    BackendInfo,
    get_backend_class,
    get_plugin_manager,
    list_backends,
)

__all__ = ["hookimpl", "BackendInfo", "get_backend_class", "get_plugin_manager", "list_backends"]
