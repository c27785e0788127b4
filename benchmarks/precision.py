"""How far each precision moves SmolLM2's greedy output from transformers' float32: exact prompts out of 24, mean
matching prefix, teacher-forced top-1 agreement, and the error of the first token's logprob.

``goldens`` writes transformers' float32 greedy continuations (48 tokens of 24 chat prompts, on the default model's
weights as transformers dequantizes its GGUF file) and the logprob of each first token to ``precision_goldens.json``
beside this script. ``measure`` runs pagedllm configurations against them, all 24 prompts in one batch, and prints
a Markdown table for docs/precision.md; configuration ``llama.cpp`` runs llama.cpp on the same GGUF file, each prompt
alone (llama_cpp_precision.py, in the llama.cpp venv of llama_cpp_env.py). ``--gguf-type`` takes the default model
requantized by llama.cpp's quantizer into Q8_0, Q4_0 or Q4_K_M instead (gguf_shapes.py), with goldens of its own:
transformers' float32 on that file's weights, made on first use and cached beside it.

    python benchmarks/precision.py goldens
    python benchmarks/precision.py measure [--configs cpu-bf16-dense,cpu-fp32-u8,...] [--alone] [--output-json PATH]
    python benchmarks/precision.py measure --gguf-type Q4_K_M --configs cpu-fp32-gguf,llama.cpp --alone
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import gguf_shapes

GOLDENS = Path(__file__).with_name("precision_goldens.json")
NEW_TOKENS = 48
PROMPTS = ["Tell me about Paris", "Write a haiku about the sea.", "What is 12 times 13?",
           "Explain photosynthesis briefly.", "List three uses of copper.", "Who wrote Hamlet?",
           "Give me a recipe for pancakes.", "Why is the sky blue?", "What is the capital of Japan?",
           "Describe a cat in one sentence.", "How do airplanes fly?", "Name a prime number above 50.",
           "What does a compiler do?", "Suggest a name for a bakery.", "Translate 'good morning' to French.",
           "What is gravity?", "Summarize the plot of Cinderella.", "How many legs does a spider have?",
           "Write a limerick about a programmer.", "What causes rain?", "Give two tips for learning to swim.",
           "What is the boiling point of water in Fahrenheit?", "Explain what a paged KV cache is.",
           "Write a Python function that reverses a string."]
# name -> (backend, engine arguments); prefix caching off unless a configuration asks for it, so that every prompt
# runs whole, in one batch of 24. "dense" is the GGUF file dequantized (--quantization none); "gguf" its own Q4_1
# and Q8_0 tensors, the default model's default in bf16 on AVX512_BF16.
CONFIGS = {
    "cpu-fp32": ("cpu", dict(dtype="float32", quantization="none")),
    "cpu-bf16-dense": ("cpu", dict(dtype="bfloat16", quantization="none")),
    "cpu-bf16-dense-cached-chunked": ("cpu", dict(dtype="bfloat16", quantization="none", enable_prefix_caching=True,
                                                  enable_chunked_prefill=True, max_num_batched_tokens=64,
                                                  max_num_seqs=32)),
    "cpu-bf16-dense-batch-invariant": ("cpu", dict(dtype="bfloat16", quantization="none", batch_invariant=True)),
    "cpu-fp32-u8": ("cpu", dict(dtype="float32", quantization="none", kv_cache_dtype="u8")),
    "cpu-bf16-dense-u8": ("cpu", dict(dtype="bfloat16", quantization="none", kv_cache_dtype="u8")),
    "cpu-fp32-gguf": ("cpu", dict(dtype="float32", quantization="gguf")),
    "cpu-fp32-gguf-int8-activations": ("cpu", dict(dtype="float32", quantization="gguf", int8_activations=True)),
    "cpu-bf16-gguf": ("cpu", dict(dtype="bfloat16", quantization="gguf")),
    "cpu-bf16-gguf-int8-activations": ("cpu", dict(dtype="bfloat16", quantization="gguf", int8_activations=True)),
    "cpu-bf16-gguf-u8": ("cpu", dict(dtype="bfloat16", quantization="gguf", kv_cache_dtype="u8")),
    "cpu-bf16-q8_0": ("cpu", dict(dtype="bfloat16", quantization="q8_0")),
    "cpu-bf16-q4_0": ("cpu", dict(dtype="bfloat16", quantization="q4_0")),
    "cpu-bf16-int8": ("cpu", dict(dtype="bfloat16", quantization="int8")),
    "openvino-fp32": ("openvino", dict(dtype="float32")),
    "openvino-bf16": ("openvino", dict(dtype="bfloat16")),
    "openvino-fp32-u8": ("openvino", dict(dtype="float32", kv_cache_dtype="u8")),
    "openvino-bf16-int8": ("openvino", dict(dtype="bfloat16", quantization="int8")),
}
LLAMA_CPP = "llama.cpp"  # llama.cpp on the same file: llama_cpp_precision.py
DEFAULT_CONFIGS = ("cpu-fp32", "cpu-bf16-dense", "cpu-bf16-dense-cached-chunked", "cpu-bf16-dense-batch-invariant",
                   "cpu-fp32-u8", "cpu-bf16-dense-u8", "cpu-fp32-gguf", "cpu-bf16-gguf", "cpu-bf16-gguf-u8",
                   "openvino-fp32", "openvino-bf16", "openvino-fp32-u8", "openvino-bf16-int8")


def chat_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in PROMPTS]


def make_goldens(model: Path, path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.models.source import resolve_model

    source = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(source.hf_dir, dtype=torch.float32).eval()
    goldens = []
    with torch.inference_mode():
        for ids in chat_prompts(tokenizer):
            tokens, first = greedy_past_eos(model, ids)
            goldens.append({"prompt_token_ids": ids, "token_ids": tokens, "first_logprob": first})
    path.write_text(json.dumps({"model": source.name, "new_tokens": NEW_TOKENS, "goldens": goldens}) + "\n")
    print(f"wrote {len(goldens)} goldens to {path}")


def greedy_past_eos(model, ids: list[int]) -> tuple[list[int], float]:
    """NEW_TOKENS greedy tokens, going on past EOS as pagedllm's ignore_eos does (transformers' generate stops
    there), and the first token's logprob."""
    import torch

    out = model(torch.tensor([ids]), use_cache=True)
    tokens, first = [], None
    for _ in range(NEW_TOKENS):
        logits = out.logits[0, -1].float()
        tokens.append(int(logits.argmax()))
        if first is None:
            first = torch.log_softmax(logits, -1)[tokens[0]].item()
        out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, first


def matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def teacher_forced(llm, goldens: list[dict], alone: bool) -> float:
    """Top-1 agreement with float32 along float32's own continuation: each golden prefix (prompt and the first i
    golden tokens) is given, and the next greedy token compared with the golden one. With prefix caching on, each
    request computes one new token, so a one-row step's path is what ``alone`` measures."""
    from pagedllm import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1)
    prefixes = [{"prompt_token_ids": g["prompt_token_ids"] + g["token_ids"][:i]}
                for g in goldens for i in range(NEW_TOKENS)]
    wanted = [g["token_ids"][i] for g in goldens for i in range(NEW_TOKENS)]
    if alone:
        outs = [llm.generate(prefix, one, use_tqdm=False)[0] for prefix in prefixes]
    else:
        outs = llm.generate(prefixes, one, use_tqdm=False)
    return sum(o.outputs[0].token_ids[0] == w for o, w in zip(outs, wanted)) / len(wanted)


def measure_config(name: str, goldens: list[dict], alone: bool = False, model: Path | None = None) -> dict:
    from pagedllm import LLM, SamplingParams

    backend, args = CONFIGS[name]
    args = {"model": model, "enable_prefix_caching": False, **args}
    llm = LLM(backend=backend, max_model_len=1024, kv_cache_space=0.5, **args)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": g["prompt_token_ids"]} for g in goldens]
    if alone:  # batch-1 decoding: the paths a one-row step takes (a quantized model's decode kernel, say)
        outs = [llm.generate(prompt, greedy, use_tqdm=False)[0] for prompt in prompts]
    else:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
    # The golden first token's logprob, teacher-forced: the prompt plus that token, scored as a prompt.
    forced = llm.generate([{"prompt_token_ids": g["prompt_token_ids"] + g["token_ids"][:1]} for g in goldens],
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    llm.shutdown()
    cached = LLM(backend=backend, max_model_len=1024, kv_cache_space=0.5, **{**args, "enable_prefix_caching": True})
    agreement = teacher_forced(cached, goldens, alone)
    cached.shutdown()
    prefixes = [matching_prefix(o.outputs[0].token_ids, g["token_ids"]) for o, g in zip(outs, goldens)]
    errors = []
    for f, g in zip(forced, goldens):
        entry = f.prompt_logprobs[-1]
        errors.append(abs(entry[g["token_ids"][0]].logprob - g["first_logprob"]))
    return {"config": name + (" (one prompt at a time)" if alone else ""),
            "exact": sum(p == NEW_TOKENS for p in prefixes), "prompts": len(goldens),
            "mean_prefix": sum(prefixes) / len(prefixes), "teacher_forced_top1": agreement,
            "first_logprob_error": sum(errors) / len(errors), "max_first_logprob_error": max(errors)}


def measure_llama_cpp(model: Path, goldens: Path) -> dict:
    """llama.cpp's row, on the same GGUF file (its own quantized tensors, llama.cpp's int8 activations)."""
    import subprocess

    import llama_cpp_env

    venv = llama_cpp_env.default_venv_dir()
    llama_cpp_env.ensure_venv(venv)
    out = subprocess.run([str(llama_cpp_env.venv_python(venv)), str(Path(__file__).with_name("llama_cpp_precision.py")),
                          "--model", str(model), "--goldens", str(goldens)],
                         check=True, capture_output=True, text=True).stdout
    return {"config": f"llama.cpp {llama_cpp_env.LLAMA_CPP_PYTHON_VERSION}, the same file (one prompt at a time)",
            **json.loads(out.splitlines()[-1])}


def table(rows: list[dict]) -> list[str]:
    lines = ["| configuration | exact (of 24) | mean matching prefix (of 48) | teacher-forced top-1 agreement | "
             "first-token logprob error, mean (max) |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['exact']}/{r['prompts']} | {r['mean_prefix']:.1f} | "
                     f"{r['teacher_forced_top1']:.3f} | "
                     f"{r['first_logprob_error']:.2g} ({r['max_first_logprob_error']:.2g}) |")
    return lines


def model_and_goldens(gguf_type: str | None) -> tuple[Path, Path]:
    """The GGUF file and its goldens: the default model's own file and the repo's goldens, else the requantized file
    and goldens cached beside it."""
    from pagedllm.models.source import cache_dir, default_model_path

    if gguf_type is None:
        return default_model_path(), GOLDENS

    model = gguf_shapes.shaped_gguf(gguf_shapes.DEFAULT_MODEL, gguf_type, cache_dir())
    return model, model.with_suffix(".precision-goldens.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("goldens", help="write transformers' float32 goldens")
    run = sub.add_parser("measure", help="compare pagedllm configurations with the goldens")
    for command in (make, run):
        command.add_argument("--gguf-type", choices=gguf_shapes.FILE_TYPES,
                             help="the default model requantized into this type (default: its own Q4_1 file)")
    run.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                     help=f"comma-separated, of: {', '.join(CONFIGS)}, {LLAMA_CPP}")
    run.add_argument("--output-json", type=Path)
    run.add_argument("--alone", action="store_true",
                     help="decode each prompt alone (batch 1) instead of all 24 in one batch")
    args = parser.parse_args()
    model, goldens_path = model_and_goldens(args.gguf_type)
    if args.command == "goldens" or not goldens_path.is_file():
        make_goldens(model, goldens_path)
    if args.command == "goldens":
        return
    goldens = json.loads(goldens_path.read_text())["goldens"]
    rows = []
    for name in args.configs.split(","):
        if name not in CONFIGS and name != LLAMA_CPP:
            parser.error(f"unknown configuration {name!r}")
        rows.append(measure_llama_cpp(model, goldens_path) if name == LLAMA_CPP
                    else measure_config(name, goldens, args.alone, model))
        print(json.dumps(rows[-1]), flush=True)
    print("\n".join(table(rows)))
    if args.output_json:
        args.output_json.write_text(json.dumps(rows, indent=1) + "\n")
    assert all(math.isfinite(r["first_logprob_error"]) for r in rows)


if __name__ == "__main__":
    main()
