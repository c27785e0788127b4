"""Loads plugins from the ``pagedllm`` entry-point group and answers "which backends exist"."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
import os

import pluggy

from pagedllm.errors import BackendNotFoundError
from pagedllm.plugins import hookspecs

logger = logging.getLogger("pagedllm.plugins")

ENTRY_POINT_GROUP = "pagedllm"
PLUGINS_ENV = "PAGEDLLM_PLUGINS"

# What to install for the built-in backends when they are missing or unavailable.
_INSTALL_HINTS = {
    "cpu": 'pip install "pagedllm[cpu]"',
    "openvino": 'make install, or pip install "pagedllm[openvino]" then pip install --no-deps optimum-intel==2.2.0',
}


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    name: str
    cls: type | None
    plugin: str  # entry-point name or module that registered it
    package: str  # distribution that ships the plugin
    available: bool
    reason: str  # why not available ("" when available)


class _PluginState:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("pagedllm")
        self.pm.add_hookspecs(hookspecs)
        self.load_errors: dict[str, tuple[str, str]] = {}  # entry-point name -> (package, error)
        self.packages: dict[str, str] = {}  # plugin name -> distribution name


def _wanted_plugins() -> set[str] | None:
    value = os.environ.get(PLUGINS_ENV)
    if value is None or not value.strip():
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


@functools.lru_cache(maxsize=None)
def _state() -> _PluginState:
    state = _PluginState()
    wanted = _wanted_plugins()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if wanted is not None and ep.name not in wanted:
            continue
        package = ep.dist.name if ep.dist is not None else "?"
        try:
            module = ep.load()
        except Exception as exc:  # a broken plugin must not break the others
            logger.warning("plugin %r from %s failed to load: %s", ep.name, package, exc)
            state.load_errors[ep.name] = (package, f"{type(exc).__name__}: {exc}")
            continue
        if state.pm.get_plugin(ep.name) is None:
            state.pm.register(module, name=ep.name)
            state.packages[ep.name] = package
    return state


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, loaded on first use."""
    return _state().pm


def register_plugin(module: object, name: str, package: str = "local") -> None:
    """Register a plugin object by hand (for tests and embedding applications)."""
    state = _state()
    state.pm.register(module, name=name)
    state.packages[name] = package


def unregister_plugin(name: str) -> None:
    state = _state()
    plugin = state.pm.get_plugin(name)
    if plugin is not None:
        state.pm.unregister(plugin)
    state.packages.pop(name, None)


def _registered_classes() -> list[tuple[type, str]]:
    """(backend class, plugin name) for every registered backend, without checking availability."""
    state = _state()
    found = []
    for impl in state.pm.hook.register_backends.get_hookimpls():
        plugin_name = state.pm.get_name(impl.plugin) or "?"
        registered: list[type] = []
        impl.function(register=registered.append)
        found.extend((cls, plugin_name) for cls in registered)
    return found


def registered_backend_classes() -> list[type]:
    """Every registered backend class, available here or not (their settings exist either way)."""
    return [cls for cls, _ in _registered_classes()]


def _info(cls: type, plugin_name: str) -> BackendInfo:
    try:
        ok, reason = cls.is_available()
    except Exception as exc:
        ok, reason = False, f"availability check failed: {exc}"
    return BackendInfo(name=cls.name, cls=cls, plugin=plugin_name,
                       package=_state().packages.get(plugin_name, "?"), available=bool(ok),
                       reason="" if ok else reason)


def list_backends() -> list[BackendInfo]:
    """Every registered backend with its availability, plus plugins that failed to load."""
    infos = {cls.name: _info(cls, plugin) for cls, plugin in _registered_classes()}
    for ep_name, (package, error) in _state().load_errors.items():
        if ep_name not in infos:
            infos[ep_name] = BackendInfo(ep_name, None, ep_name, package, False, f"plugin failed to load: {error}")
    return sorted(infos.values(), key=lambda info: info.name)


def get_backend_class(name: str) -> type:
    """The backend class called ``name``, or an error naming what exists and what to install.

    Only the chosen backend's availability is checked: probing the others may load their runtimes.
    """
    for cls, plugin in _registered_classes():
        if cls.name == name:
            info = _info(cls, plugin)
            if info.available:
                return cls
            break
    infos = {info.name: info for info in list_backends()}
    info = infos.get(name)
    if info is None:
        known = ", ".join(sorted(infos)) or "none"
        hint = _INSTALL_HINTS.get(name)
        msg = f"unknown backend {name!r}; installed backends: {known}."
        if hint:
            msg += f" To get {name!r}: {hint}."
        else:
            msg += " A third-party backend is a pip package with a 'pagedllm' entry point."
        if (wanted := _wanted_plugins()) is not None:
            msg += f" Note: {PLUGINS_ENV}={','.join(sorted(wanted))} restricts which plugins load."
        raise BackendNotFoundError(msg)
    if not info.available or info.cls is None:
        msg = f"backend {name!r} is installed but cannot run here: {info.reason}."
        hint = _INSTALL_HINTS.get(name)
        if hint:
            msg += f" To fix: {hint}."
        available = [i.name for i in infos.values() if i.available]
        if available:
            msg += f" Available backends: {', '.join(available)}."
        raise BackendNotFoundError(msg)
    return info.cls
