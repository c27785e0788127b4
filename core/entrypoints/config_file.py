"""``--config FILE.yaml``, as vLLM reads it: each key is a flag of the command (``max-model-len: 4096`` or
``max_model_len: 4096``); flags given on the command line win over the file's."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagedllm.errors import ConfigError


def expand_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with ``--config FILE`` replaced by the file's flags that the command line does not give itself
    (placed last, after any positional argument)."""
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    rest, path = [], None
    args = iter(argv)
    for arg in args:
        if arg == "--config":
            path = next(args, None)
            if path is None:
                raise ConfigError("--config needs a YAML file")
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    command = next((a for a in rest if not a.startswith("-")), None)
    options = _command_options(parser, command)
    given = {options[a.split("=", 1)[0]].dest for a in rest if a.split("=", 1)[0] in options}
    return rest + _flags_from_file(Path(path), options, given)


def _command_options(parser: argparse.ArgumentParser, command: str | None) -> dict[str, argparse.Action]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]._option_string_actions
    return parser._option_string_actions


def _flags_from_file(path: Path, options: dict[str, argparse.Action], given: set[str]) -> list[str]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config {path}: cannot read it as YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the file must map flag names to values")
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = options.get(flag)
        if action is None:
            raise ConfigError(f"--config {path}: {key!r} is not a flag of this command ({flag})")
        if value is None or action.dest in given:
            continue
        if isinstance(value, bool):
            if value and action.nargs == 0:
                flags.append(flag)
            elif not value and "--no-" + flag[2:] in options:
                flags.append("--no-" + flag[2:])
            elif value != bool(action.default):
                raise ConfigError(f"--config {path}: {key}: {value} cannot be expressed with {flag}")
        elif isinstance(value, dict) or (isinstance(value, list) and action.nargs is None):
            flags += [flag, json.dumps(value)]  # a JSON-valued flag: --speculative-config, --allowed-origins
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags
