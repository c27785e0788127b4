"""Offline throughput of OpenVINO GenAI's continuous-batching pipeline on a pagedllm workload file.

The baseline for pagedllm's openvino backend: the same IR (pagedllm's cached export of the model), the same token
ids, greedy with EOS ignored, the same KV-cache precision, token budget and threads; the results JSON uses
``pagedllm bench throughput``'s field names. GenAI needs the tokenizer as OpenVINO IR next to the model:
``prepare_model`` makes such a folder once (links to the export plus the converted tokenizer), outside the timing,
as a user of GenAI would have it ready.

    python openvino_genai_offline.py --model GENAI_FOLDER --workload W.json --output-json out.json \
        [--enable-prefix-caching] [--dtype float32] [--kv-cache-precision f16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rates import rate_fields, write_results

GENAI_PACKAGE = "openvino-genai"
_INFERENCE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def unavailable_reason() -> str | None:
    """None if openvino_genai imports; else what to install."""
    import importlib.metadata

    try:
        import openvino_genai  # noqa: F401
    except ImportError as exc:
        try:
            ov = importlib.metadata.version("openvino")
        except importlib.metadata.PackageNotFoundError:
            return f"openvino is not installed ({exc}); install pagedllm's [openvino] extra first"
        return f"`import openvino_genai` fails ({exc}); install it with `pip install {GENAI_PACKAGE}=={ov}.0`"
    return None


def prepare_model(ir_dir: Path, hf_dir: Path, out: Path) -> Path:
    """A folder GenAI can load: links to the files of ``ir_dir`` plus the tokenizer of ``hf_dir`` as IR."""
    out.mkdir(parents=True, exist_ok=True)
    for source in ir_dir.iterdir():
        link = out / source.name
        if not link.exists():
            link.symlink_to(source.resolve())
    if not (out / "openvino_detokenizer.xml").is_file():
        import openvino as ov
        from openvino_tokenizers import convert_tokenizer
        from transformers import AutoTokenizer

        tokenizer, detokenizer = convert_tokenizer(AutoTokenizer.from_pretrained(hf_dir), with_detokenizer=True)
        ov.save_model(tokenizer, out / "openvino_tokenizer.xml")
        ov.save_model(detokenizer, out / "openvino_detokenizer.xml")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a folder made by prepare_model")
    parser.add_argument("--workload", required=True, help="pagedllm workload file (pagedllm bench --save-workload)")
    parser.add_argument("--output-json", required=True)
    parser.add_argument("--dtype", default="float32", choices=sorted(_INFERENCE), help="inference precision")
    parser.add_argument("--kv-cache-precision", default="f16", help="KV_CACHE_PRECISION: f32, f16, bf16 or u8")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--threads", type=int, default=2, help="INFERENCE_NUM_THREADS (pinned)")
    parser.add_argument("--kv-cache-space", type=float, default=4, help="GiB for the KV cache")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args()

    workload = json.loads(Path(args.workload).read_text())
    requests = workload["requests"]
    start = time.perf_counter()
    import numpy as np
    import openvino as ov
    import openvino_genai

    scheduler = openvino_genai.SchedulerConfig()
    scheduler.cache_size = max(1, round(args.kv_cache_space))
    scheduler.enable_prefix_caching = args.enable_prefix_caching
    scheduler.dynamic_split_fuse = True  # chunked prefill, as pagedllm's default
    scheduler.max_num_batched_tokens = args.max_num_batched_tokens
    scheduler.max_num_seqs = args.max_num_seqs
    properties = {"INFERENCE_PRECISION_HINT": _INFERENCE[args.dtype], "KV_CACHE_PRECISION": args.kv_cache_precision,
                  "INFERENCE_NUM_THREADS": args.threads, "ENABLE_CPU_PINNING": True}
    pipe = openvino_genai.ContinuousBatchingPipeline(args.model, scheduler, "CPU", properties)
    startup = time.perf_counter() - start

    input_ids = [ov.Tensor(np.array([r["prompt_token_ids"]], dtype=np.int64)) for r in requests]
    configs = []
    for r in requests:
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens = r["output_len"]
        config.ignore_eos = True
        config.do_sample = False
        configs.append(config)
    start = time.perf_counter()
    outputs = pipe.generate(input_ids, configs)
    elapsed = time.perf_counter() - start

    num_prompt = sum(len(r["prompt_token_ids"]) for r in requests)
    num_output = sum(len(o.m_generation_ids[0]) for o in outputs)
    metrics = pipe.get_metrics()
    results = {
        **rate_fields(workload["name"], len(outputs), num_prompt, num_output, elapsed, startup),
        "max_cache_usage_percent": metrics.max_cache_usage,
        "first_output_token_ids": list(outputs[0].m_generation_ids[0][:16]),
        "engine": {"name": "openvino-genai", "version": openvino_genai.__version__, "model": args.model,
                   "dtype": args.dtype, "kv_cache_precision": args.kv_cache_precision,
                   "enable_prefix_caching": args.enable_prefix_caching},
    }
    write_results(args.output_json, results, f"OpenVINO GenAI {openvino_genai.__version__}")


if __name__ == "__main__":
    main()
