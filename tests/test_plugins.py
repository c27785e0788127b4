import os
import subprocess
import sys
import textwrap

import pytest

from pagedllm.errors import BackendNotFoundError
from pagedllm.plugins import hookimpl
from pagedllm.plugins.manager import get_backend_class, list_backends, register_plugin, unregister_plugin


def test_builtin_cpu_backend_comes_from_the_entry_point():
    infos = {i.name: i for i in list_backends()}
    cpu = infos["cpu"]
    assert cpu.available and cpu.package == "pagedllm" and cpu.plugin == "cpu"
    assert get_backend_class("cpu").name == "cpu"


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(BackendNotFoundError, match=r"unknown backend 'nope'; installed backends: .*cpu"):
        get_backend_class("nope")


def test_openvino_error_says_what_to_install():
    if "openvino" in {i.name for i in list_backends() if i.available}:
        pytest.skip("openvino is installed here")
    with pytest.raises(BackendNotFoundError, match=r"pagedllm\[openvino\]"):
        get_backend_class("openvino")


class _Plugin:
    class Unavailable:
        name = "needs-hardware"

        @classmethod
        def is_available(cls):
            return False, "no such accelerator on this machine"

    @hookimpl
    def register_backends(self, register):
        register(self.Unavailable)


def test_a_registered_but_unavailable_backend_says_why():
    register_plugin(_Plugin(), name="test-plugin", package="test-package")
    try:
        info = {i.name: i for i in list_backends()}["needs-hardware"]
        assert not info.available and info.reason == "no such accelerator on this machine"
        assert info.package == "test-package"
        with pytest.raises(BackendNotFoundError, match="cannot run here: no such accelerator"):
            get_backend_class("needs-hardware")
    finally:
        unregister_plugin("test-plugin")


@pytest.fixture(scope="module")
def third_party_package(tmp_path_factory):
    """A separate pip package with a `pagedllm` entry point, installed into its own folder."""
    src = tmp_path_factory.mktemp("plugin-src")
    (src / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "pagedllm-example-plugin"
        version = "0.0.1"
        [project.entry-points.pagedllm]
        example = "pagedllm_example_plugin"
    """))
    (src / "pagedllm_example_plugin.py").write_text(textwrap.dedent("""
        from pagedllm import Backend
        from pagedllm.plugins import hookimpl

        class ExampleBackend(Backend):
            name = "example"

            @classmethod
            def is_available(cls):
                return False, "example backend: plumbing only"

        @hookimpl
        def register_backends(register):
            register(ExampleBackend)
    """))
    target = tmp_path_factory.mktemp("plugin-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True)
    return target


def run_cli(args, env_extra=None, pythonpath=None):
    env = dict(os.environ, **(env_extra or {}))
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_third_party_package_is_discovered(third_party_package):
    out = run_cli(["backends"], pythonpath=third_party_package)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(None, 1) for line in out.stdout.splitlines())
    assert lines["example"] == "(pagedllm-example-plugin)  unavailable: example backend: plumbing only"
    assert lines["cpu"] == "(pagedllm)  available"


def test_pagedllm_plugins_restricts_loading(third_party_package):
    out = run_cli(["backends"], {"PAGEDLLM_PLUGINS": "example"}, pythonpath=third_party_package)
    assert [line.split()[0] for line in out.stdout.splitlines()] == ["example"]
    out = run_cli(["generate", "hi", "--backend", "cpu"], {"PAGEDLLM_PLUGINS": "example"},
                  pythonpath=third_party_package)
    assert out.returncode == 2
    assert "unknown backend 'cpu'" in out.stderr and "PAGEDLLM_PLUGINS=example" in out.stderr
