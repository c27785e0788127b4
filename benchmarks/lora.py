"""LoRA cost in a batch: W1 (64 prompts x 256 tokens -> 128, greedy, EOS ignored) on the base model alone against
the same with --enable-lora and the prompts spread evenly over 4 adapters of rank 16 on all seven projections
(random, made with peft). Base and LoRA runs alternate (base first, then LoRA first: this VM's speed drifts within
minutes), each in a process of its own; prints the medians of output tok/s and their ratio (the issue's bar: at
least 0.8x).

    python benchmarks/lora.py                                    # SmolLM2 (its GGUF, quantized as by default)
    python benchmarks/lora.py --model-shape llama-1b --prompts 16 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ADAPTERS = 4


def make_adapters(model_dir: str, gguf_file: str | None, out: Path, rank: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(ADAPTERS):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"]))
        model.save_pretrained(out / f"adapter-{i}")
        paths.append(out / f"adapter-{i}")
    return paths


def run_once(args) -> float:
    """One measurement in this process: output tok/s."""
    import numpy as np

    from pagedllm import LLM, LoRARequest, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 20000, args.input_len).tolist() for _ in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    kwargs = dict(enable_lora=True, max_loras=ADAPTERS, max_lora_rank=args.rank) if args.adapters else {}
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, enable_prefix_caching=False, **kwargs)
    loras = None
    if args.adapters:
        loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(args.adapters)]
        loras = [loras[i % ADAPTERS] for i in range(len(prompts))]
        llm.generate(prompts[:ADAPTERS], SamplingParams(max_tokens=1), use_tqdm=False, lora_request=loras[:ADAPTERS])
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", help="what LLM takes (default: SmolLM2's GGUF)")
    parser.add_argument("--model-shape", help="a random model of this shape (model_shapes.py), bf16")
    parser.add_argument("--runs", type=int, default=4, help="an even number: as many runs with each first")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--adapters", nargs="*", help=argparse.SUPPRESS)  # a measuring child's adapters
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_once(args)))
        return 0
    from pagedllm.models.source import cache_dir, resolve_model

    if args.model_shape:
        sys.path.insert(0, str(Path(__file__).parent))
        import model_shapes

        args.model = str(model_shapes.shaped_model(args.model_shape, resolve_model(None).config_dir, cache_dir()))
    source = resolve_model(args.model)
    gguf = source.path.name if source.kind == "gguf" else None
    model_dir = str(source.path.parent if gguf else source.path)
    with tempfile.TemporaryDirectory(prefix="pagedllm-lora-") as work:
        return measure(args, source, make_adapters(model_dir, gguf, Path(work), args.rank))


def measure(args, source, adapters: list[Path]) -> int:
    from pagedllm.backends.common.cpu_features import describe

    common = [sys.executable, __file__, "--child", "--prompts", str(args.prompts), "--input-len", str(args.input_len),
              "--output-len", str(args.output_len), "--rank", str(args.rank), "--dtype", args.dtype,
              *(["--model", args.model] if args.model else [])]
    results: dict[str, list[float]] = {"base": [], "lora": []}
    for run in range(args.runs):
        for kind in ("base", "lora") if run % 2 == 0 else ("lora", "base"):  # ABBA: a drifting box favours neither
            cmd = common + (["--adapters", *map(str, adapters)] if kind == "lora" else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"run {run} {kind}: {results[kind][-1]:.1f} output tok/s", flush=True)
    base, lora = statistics.median(results["base"]), statistics.median(results["lora"])
    print(json.dumps({"cpu": describe(), "model": source.name, "base_tok_s": round(base, 1),
                      "lora_tok_s": round(lora, 1), "ratio": round(lora / base, 3), "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
