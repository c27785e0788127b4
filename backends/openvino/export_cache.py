"""Hugging Face folder -> stateful OpenVINO IR (optimum-intel), optionally NNCF int8, cached on disk.

The cache key covers the model folder (path, file names, sizes and times), the weight format and the
versions of every package that shapes the IR, so an upgrade exports again instead of reusing a stale IR.
An int8 export starts from the cached fp32 one.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import time
import warnings
from pathlib import Path

from tqdm import tqdm

from pagedllm.errors import UnsupportedModelError
from pagedllm.models.source import cache_dir

logger = logging.getLogger("pagedllm.openvino")

MODEL_XML = "openvino_model.xml"
MARKER = "pagedllm-export.json"
# Bump when the export recipe below changes, so old cached IRs are not reused.
RECIPE_VERSION = "1"
_KEY_PACKAGES = ("openvino", "optimum-intel", "optimum", "nncf", "transformers", "torch")


def package_versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in _KEY_PACKAGES}


def export_dir(hf_dir: Path, name: str, weight_format: str) -> Path:
    """Where the export of ``hf_dir`` in ``weight_format`` (fp32 | int8 | int4) lives in the cache."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in hf_dir.iterdir() if p.is_file())
    raw = json.dumps([str(hf_dir.resolve()), files, weight_format, package_versions(), RECIPE_VERSION])
    key = hashlib.sha256(raw.encode()).hexdigest()[:16]
    return cache_dir() / "openvino" / f"{name}-{weight_format}-{key}"


def exported_model(hf_dir: Path, name: str, weight_format: str) -> Path:
    """The folder holding the IR of ``hf_dir`` in ``weight_format``, exporting it on first use."""
    out = export_dir(hf_dir, name, weight_format)
    if (out / MARKER).is_file():
        logger.info("reusing the cached OpenVINO export %s (no export needed)", out)
        return out
    if weight_format in ("int8", "int4"):
        fp32 = exported_model(hf_dir, name, "fp32")
        _build_once(out, f"{weight_format} weights for {name}", lambda tmp: _compress(fp32, tmp, weight_format))
    else:
        _build_once(out, f"OpenVINO export of {name}", lambda tmp: _export_fp32(hf_dir, tmp))
    return out


def _build_once(out: Path, what: str, build) -> None:
    """Build into a temporary folder, then rename: a crash never leaves a half-written export behind."""
    logger.info("%s: building once into %s (later starts reuse it)", what, out)
    start = time.time()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        (tmp / MARKER).write_text(json.dumps({"versions": package_versions(), "seconds": time.time() - start}))
        try:
            tmp.rename(out)
        except OSError:  # another process finished the same export meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("%s done in %.1f s", what, time.time() - start)


@contextlib.contextmanager
def _stage_bar(desc: str, total: int):
    """Progress over the export's stages (the stages themselves show their own bars where they have one)."""
    with tqdm(total=total, desc=desc, unit="stage", dynamic_ncols=True) as bar:
        started = False

        def stage(name: str) -> None:
            nonlocal started
            if started:
                bar.update(1)
            started = True
            bar.set_postfix_str(name)

        yield stage
        bar.update(1)


def _export_fp32(hf_dir: Path, out: Path) -> None:
    """Stateful ``text-generation-with-past`` IR with fp32 weights: what the paged-attention pass needs."""
    with _stage_bar("OpenVINO export", 2) as stage:
        stage("loading optimum-intel")
        import torch
        from optimum.exporters.openvino import main_export
        from optimum.intel import OVConfig

        stage(f"tracing and converting {hf_dir.name}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            try:
                # dtype given explicitly: with no OVConfig optimum compresses models over 1B parameters to int8.
                main_export(str(hf_dir), output=out, task="text-generation-with-past", stateful=True,
                            convert_tokenizer=False, ov_config=OVConfig(dtype="fp32"), local_files_only=True)
            except ValueError as exc:  # how optimum-intel refuses an architecture or a transformers version
                raise UnsupportedModelError(
                    f"optimum-intel cannot export {hf_dir} for OpenVINO: {exc}. Run this model with --backend cpu"
                ) from exc
    if not (out / MODEL_XML).is_file():
        raise RuntimeError(f"optimum-intel exported no {MODEL_XML} for {hf_dir}")


def _compress(fp32_dir: Path, out: Path, weight_format: str) -> None:
    """NNCF weight compression of the fp32 IR: int8 asymmetric per channel, or int4 asymmetric in groups of 128
    (optimum-cli's default; NNCF adjusts the group of a layer whose width 128 does not divide); the other files are
    copied."""
    with _stage_bar(f"{weight_format} weights", 3) as stage:
        stage("reading the fp32 IR")
        import nncf
        import openvino as ov

        model = ov.Core().read_model(fp32_dir / MODEL_XML)
        stage("compressing weights with NNCF")
        if weight_format == "int8":
            model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
        else:
            from nncf.quantization.advanced_parameters import AdvancedCompressionParameters

            model = nncf.compress_weights(
                model, mode=nncf.CompressWeightsMode.INT4_ASYM, group_size=128, ratio=1.0,
                advanced_parameters=AdvancedCompressionParameters(
                    group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST))
        stage("saving")
        ov.save_model(model, out / MODEL_XML, compress_to_fp16=False)
    for path in fp32_dir.iterdir():
        if path.is_file() and not path.name.startswith("openvino_model.") and path.name != MARKER:
            shutil.copy2(path, out / path.name)
