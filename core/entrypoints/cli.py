"""The ``pagedllm`` command: generate, serve, bench, backends."""

from __future__ import annotations

import argparse
import sys

from pagedllm.engine.arg_utils import add_cli_args, from_cli_args


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts",
                       description="Generate text for prompts (positional, or one per line on stdin with '-').")
    p.add_argument("prompts", nargs="*", help="prompt texts; '-' reads one prompt per line from stdin")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate per prompt (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of this generation's sampling")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap each prompt as a user message in the model's chat template "
                        "(default: on when the model has one)")
    p.add_argument("--engine-process", action="store_true",
                   help="run the scheduler and the model in an engine-core process of their own, as serve does")
    add_cli_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedllm.engine.llm import LLM
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.utils import freeze_startup_heap

    prompts = list(args.prompts)
    if prompts == ["-"]:
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("pagedllm generate: give at least one prompt", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    llm = LLM(**vars(from_cli_args(args)), engine_process=args.engine_process)
    freeze_startup_heap()  # this process lives as long as its engine: its exit need not collect what start-up made
    chat = args.chat if args.chat is not None else bool(getattr(llm.tokenizer, "chat_template", None))
    if chat:
        inputs = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    else:
        inputs = prompts
    if len(inputs) == 1:
        _stream_one(llm, inputs[0], params)
    else:
        for prompt, output in zip(prompts, llm.generate(inputs, params)):
            print(f"### {prompt}\n{output.text}\n")
    llm.shutdown()
    return 0


def _stream_one(llm, prompt, params) -> None:
    """Print the reply as it is generated."""
    engine = llm.engine
    request_id = engine.add_request(None, prompt, params)
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                sys.stdout.write(output.outputs[0].delta_text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        raise
    sys.stdout.write("\n")


def _add_serve(sub) -> None:
    from pagedllm.entrypoints.openai.cli_args import add_serve_args

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                                   "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /version, "
                                   "/metrics) until SIGTERM or Ctrl-C.")
    add_serve_args(p)
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server

    return run_server(args)


def _add_bench(sub) -> None:
    from pagedllm.bench import add_bench_parser

    add_bench_parser(sub)


def _add_backends(sub) -> None:
    p = sub.add_parser("backends", help="list backends and whether they can run here")
    p.add_argument("--help-settings", action="store_true",
                   help="print every engine setting, the backends' own included, as a Markdown table")
    p.set_defaults(func=_run_backends)


def _run_backends(args: argparse.Namespace) -> int:
    from pagedllm.plugins.manager import list_backends

    if args.help_settings:
        from pagedllm.engine.arg_utils import settings_table

        print("\n".join(settings_table()))
        return 0

    infos = list_backends()
    if not infos:
        print("no backends installed")
        return 1
    width = max(len(i.name) for i in infos)
    for info in infos:
        state = "available" if info.available else f"unavailable: {info.reason}"
        print(f"{info.name:<{width}}  ({info.package})  {state}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference and serving on CPUs")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_serve(sub)
    _add_bench(sub)
    _add_backends(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagedllm.entrypoints.config_file import expand_config_file
    from pagedllm.errors import ConfigError

    parser = build_parser()
    try:
        argv = expand_config_file(list(sys.argv[1:] if argv is None else argv), parser)
    except ConfigError as exc:
        print(f"pagedllm: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.version:
        from pagedllm.version import __version__

        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    from pagedllm.bench.serving import ServerError
    from pagedllm.bench.workload import WorkloadError
    from pagedllm.errors import (
        BackendNotFoundError,
        InvalidRequestError,
        ModelNotFoundError,
        UnsupportedModelError,
    )

    try:
        return args.func(args)
    except (BackendNotFoundError, ConfigError, InvalidRequestError, ModelNotFoundError,
            UnsupportedModelError, ServerError, WorkloadError) as exc:
        print(f"pagedllm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
