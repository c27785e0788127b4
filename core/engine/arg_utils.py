"""The engine's settings as command-line flags and as the README's table: the core's settings, then every installed
backend's own (asked of the plugin manager, which ``pagedllm.config`` never imports)."""

from __future__ import annotations

import argparse
import dataclasses
import logging

from pagedllm.config import SETTINGS, EngineArgs, Setting
from pagedllm.plugins.manager import registered_backend_classes

logger = logging.getLogger("pagedllm.config")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The core's settings, then every installed backend's own."""
    group = parser.add_argument_group("engine")
    for s in SETTINGS:
        _add_flag(group, s, ", ".join([*s.env_aliases, s.env]))
    owners = backend_settings()
    if owners:
        group = parser.add_argument_group("backend settings")
    for s, backends in owners:
        _add_flag(group, s, ", ".join([*s.env_aliases, s.env]), f" ({'/'.join(backends)} backend)")
    _add_gpu_only_flags(parser)


# vLLM flags for GPUs (or for its own internals): accepted, so that vLLM command lines start, with a one-line warning.
GPU_ONLY_FLAGS: tuple[tuple[str, dict], ...] = (
    ("--gpu-memory-utilization", {"type": float}),
    ("--enforce-eager", {"action": "store_true", "default": None}),
    ("--swap-space", {"type": float}),
    ("--num-gpu-blocks-override", {"type": int}),
    ("--disable-custom-all-reduce", {"action": "store_true", "default": None}),
    ("--distributed-executor-backend", {}),
    ("--disable-log-stats", {"action": "store_true", "default": None}),
)


def _add_gpu_only_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM flags with no effect on CPUs (accepted with a warning)")
    for flag, kwargs in GPU_ONLY_FLAGS:
        group.add_argument(flag, dest="gpu_only_" + flag[2:].replace("-", "_"), help=argparse.SUPPRESS, **kwargs)


def warn_gpu_only_flags(namespace: argparse.Namespace) -> None:
    for flag, _ in GPU_ONLY_FLAGS:
        if getattr(namespace, "gpu_only_" + flag[2:].replace("-", "_"), None) is not None:
            logger.warning("%s has no effect on pagedllm (it is a vLLM setting for GPUs); ignored", flag)


def from_cli_args(namespace: argparse.Namespace) -> EngineArgs:
    warn_gpu_only_flags(namespace)
    values = {f.name: getattr(namespace, f.name, None) for f in dataclasses.fields(EngineArgs)
              if f.name != "backend_options"}
    options = {s.name: getattr(namespace, s.name) for s, _ in backend_settings()
               if getattr(namespace, s.name, None) is not None}
    return EngineArgs(**values, backend_options=options)


def _add_flag(group, s: Setting, env: str, owner: str = "") -> None:
    help_text = s.help + owner + (f" ({'|'.join(s.choices)})" if s.choices else "") + f" [env {env}"
    help_text += f"; default {s.default}]" if s.default is not None else "]"
    flags = (s.flag, s.short_flag) if s.short_flag else (s.flag,)
    if s.type is bool:
        group.add_argument(*flags, dest=s.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    else:
        group.add_argument(*flags, dest=s.name, type=s.type, default=None, help=help_text)


def backend_settings() -> list[tuple[Setting, list[str]]]:
    """Each installed backend's own settings, once each, with the backends that read them."""
    owners: dict[str, tuple[Setting, list[str]]] = {}
    for cls in registered_backend_classes():
        for s in cls.settings:
            owners.setdefault(s.name, (s, []))[1].append(cls.name)
    return list(owners.values())


def setting_owners() -> dict[str, list[str]]:
    """Setting name -> the installed backends that declare it."""
    return {s.name: backends for s, backends in backend_settings()}


def settings_table() -> list[str]:
    """The settings as a Markdown table (README's): flag, env vars, default, meaning."""
    classes = registered_backend_classes()
    lines = ["| flag | env var | default | meaning |", "| --- | --- | --- | --- |"]

    def row(s: Setting, envs: list[str], owner: str = "") -> None:
        default = s.shown_default or ("on" if s.default is True else "off" if s.default is False else s.default)
        choices = f" ({', '.join(f'`{c}`' for c in s.choices)})" if s.choices else ""
        flag = f"`{s.flag}`" + (f", `{s.short_flag}`" if s.short_flag else "")
        lines.append(f"| {flag} | {', '.join(envs)} | {default} | {s.help}{choices}{owner} |")

    for s in SETTINGS:
        envs = [f"`{e}` ({cls.name} backend)" for cls in classes for e in cls.env_vars.get(s.name, ())]
        row(s, [*envs, *(f"`{e}`" for e in (*s.env_aliases, s.env))])
    for s, backends in backend_settings():
        row(s, [f"`{e}`" for e in (*s.env_aliases, s.env)], f"; {'/'.join(backends)} backend")
    return lines
