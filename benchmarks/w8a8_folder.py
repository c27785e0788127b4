"""A compressed-tensors W8A8 folder (vLLM's int8 format: int8 weights per output channel, int8 activations per token,
dynamic) holding the very int8 weights that ``pagedllm --quantization int8`` makes at load, so vLLM's W8A8 path and
pagedllm's run the same bits. The LM head stays dense in both.

    python benchmarks/w8a8_folder.py HF_FOLDER [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedllm.backends.cpu.layers.int8_gemm import signed_int8
from pagedllm.backends.cpu.layers.quant_formats import quantize

# the decoder's linear projections, as Llama-family checkpoints name them
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True},
    }},
}


def is_projection(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], float32 scale [out, 1]) exactly as pagedllm's ``int8`` quantization makes them."""
    values, scales = signed_int8(quantize(weight, "int8"))
    return values, scales.reshape(-1, 1)


def w8a8_folder(hf_dir: Path, out: Path) -> Path:
    """Write (once) ``out`` from ``hf_dir``: config with the quantization_config, tokenizer files, int8 weights."""
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in hf_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            shutil.copy2(path, tmp / path.name)
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for index, path in enumerate(sorted(hf_dir.glob("*.safetensors"))):
        tensors = {}
        with safe_open(path, "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if is_projection(name, tensor):
                    tensors[name], tensors[name + "_scale"] = int8_weight(tensor)
                else:
                    tensors[name] = tensor
        save_file(tensors, tmp / f"model-{index:05d}.safetensors", metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="default: HF_FOLDER-w8a8 beside it")
    args = parser.parse_args()
    print(w8a8_folder(args.hf_dir, args.out or args.hf_dir.with_name(args.hf_dir.name + "-w8a8")))


if __name__ == "__main__":
    main()
