"""The package's rooms and which way imports go between them: read from the source (every import statement, also
those inside functions), so a tool that follows imports by path draws the same picture. And `make import-map`, the
tree of import names such tools read."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"core": "pagedllm", "backends": "pagedllm.backends", "plugins": "pagedllm.plugins"}

# Rooms from the bottom up: a room may import only the rooms before it (and itself). The first ones are the public
# types and the backend contract; backends sit beside the engine and import only the contract.
ROOMS = [
    "pagedllm.utils", "pagedllm.errors", "pagedllm.logger", "pagedllm.version",
    "pagedllm.config", "pagedllm.batch", "pagedllm.lora_request", "pagedllm.sampling_params", "pagedllm.outputs",
    "pagedllm.models",
    "pagedllm.backend", "pagedllm.request", "pagedllm.plugins",
    "pagedllm.backends.common", "pagedllm.backends.cpu.layers", "pagedllm.backends.cpu.runner",
    "pagedllm.backends.cpu.tensor_parallel", "pagedllm.backends.cpu", "pagedllm.backends.openvino",
    "pagedllm.backends",
    "pagedllm.kv", "pagedllm.sampling", "pagedllm.sched", "pagedllm.pooling", "pagedllm.engine", "pagedllm.bench",
    "pagedllm.entrypoints",
    "pagedllm",
]
CONTRACT = ROOMS[:ROOMS.index("pagedllm.backends.common")]


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def room_of(module: str) -> str:
    return max((room for room in ROOMS if module == room or module.startswith(room + ".")), key=len)


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(known)
            names.update(submodules)
            if len(submodules) < len(node.names):  # a name defined in the module itself
                names.add(node.module)
    return {name for name in names if name in known}


def test_every_module_has_a_room():
    assert all(room_of(m) for m in modules())


def test_imports_go_down_only():
    known = modules()
    wrong = []
    for module, path in known.items():
        mine = ROOMS.index(room_of(module))
        for target in imports(path, known):
            theirs = ROOMS.index(room_of(target))
            if theirs > mine:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that go up (or sideways into a later room):\n" + "\n".join(sorted(wrong))


def test_the_core_never_imports_a_backend_and_backends_import_only_the_contract():
    known = modules()
    for module, path in known.items():
        targets = imports(path, known)
        if not module.startswith("pagedllm.backends"):
            assert not [t for t in targets if t.startswith("pagedllm.backends")], module
        else:
            outside = {room_of(t) for t in targets if not t.startswith("pagedllm.backends")}
            assert outside <= set(CONTRACT), f"{module} imports {sorted(outside - set(CONTRACT))}"


def test_make_import_map_lays_out_the_import_names(tmp_path):
    subprocess.run(["make", "-s", "import-map"], cwd=ROOT, check=True)
    tree = ROOT / "build" / "import-map"
    for module, path in modules().items():
        relative = Path(*module.split("."))
        candidates = [tree / relative.with_suffix(".py"), tree / relative / "__init__.py"]
        assert any(c.exists() and c.resolve() == path.resolve() for c in candidates), module
