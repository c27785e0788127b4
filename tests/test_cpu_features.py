"""ISA levels read from CPU flags, and PAGEDLLM_CPU_ISA: lower for the kernels and dtype, higher for dtype only."""

from pathlib import Path

import pytest

from pagedllm import ConfigError
from pagedllm.backends.common import cpu_features
from pagedllm.backends.cpu.runner.kernels import ISA_FLAGS, build_key

AVX2 = frozenset({"avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
ZEN4 = AVX512 | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16"}


def test_levels_are_read_from_the_flags():
    assert cpu_features.detected_level(frozenset({"sse4_2"})) == "generic"
    assert cpu_features.detected_level(AVX2) == "avx2"
    assert cpu_features.detected_level(AVX512) == "avx512"
    assert cpu_features.detected_level(ZEN4) == "avx512_bf16"
    assert cpu_features.detected_level(SAPPHIRE_RAPIDS) == "amx"
    # A level counts only with every level below it: bf16 without AVX-512 is no AVX-512 level.
    assert cpu_features.detected_level(AVX2 | {"avx512_bf16", "amx_bf16", "amx_tile"}) == "avx2"


def test_native_bf16_starts_at_avx512_bf16():
    assert [cpu_features.has_native_bf16(level) for level in cpu_features.LEVELS] == [False, False, False, True, True]


@pytest.fixture()
def level(monkeypatch):
    def set_levels(detected, asked):
        monkeypatch.setattr(cpu_features, "detected_level", lambda flags=None: detected)
        monkeypatch.setenv(cpu_features.ENV, asked)
    return set_levels


def test_a_lower_level_is_taken_by_the_kernels_and_dtype(level):
    level("amx", "avx2")
    assert (cpu_features.kernel_level(), cpu_features.dtype_level()) == ("avx2", "avx2")
    assert not cpu_features.has_native_bf16()
    assert "PAGEDLLM_CPU_ISA=avx2: kernels avx2, --dtype auto as avx2" in cpu_features.describe()


def test_a_higher_level_changes_only_dtype_auto(level):
    level("avx2", "avx512_bf16")
    assert (cpu_features.kernel_level(), cpu_features.dtype_level()) == ("avx2", "avx512_bf16")
    assert cpu_features.has_native_bf16()


def test_a_bad_level_is_refused_with_the_choices(level):
    level("avx2", "avx10")
    with pytest.raises(ConfigError, match="PAGEDLLM_CPU_ISA='avx10': use one of generic, avx2, avx512"):
        cpu_features.kernel_level()


def test_the_avx2_caps_hold_torch_and_mkl_to_avx2():
    caps = cpu_features.library_caps("avx2")
    assert caps == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert cpu_features.library_caps("amx") == {}


def test_each_level_has_its_own_kernel_build():
    assert ISA_FLAGS["avx2"] == ["-march=x86-64-v3"] and "-mavx512bf16" in ISA_FLAGS["avx512_bf16"]
    assert ISA_FLAGS["amx"] == ISA_FLAGS["avx512_bf16"]  # AMX comes through oneDNN
    keys = {build_key(level) for level in ("generic", "avx2", "avx512", "avx512_bf16")}
    assert len(keys) == 4


def test_a_build_under_its_key_loads_without_asking_ninja(tmp_path, monkeypatch):
    """The key covers the sources' contents; ninja compares file times, and a fresh checkout's sources are newer than
    any build: it would compile them all again. A library that does not load (a build cut short) is built again."""
    import torch.utils.cpp_extension

    from pagedllm.backends.cpu.runner import kernels

    module, _ = kernels.load_kernels("kernel")
    library = Path(module.__file__)

    def no_ninja(**kwargs):
        raise AssertionError("asked ninja to build what is built")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_ninja)
    again, _ = kernels.load_kernels.__wrapped__("kernel")
    assert Path(again.__file__) == library and hasattr(again, "quantized_linear")
    (tmp_path / library.name).write_bytes(b"cut short")
    assert kernels._built(library.stem, tmp_path) is None
    assert kernels._built(library.stem, tmp_path / "absent") is None
