"""Benchmark workloads as token ids, so every engine under test gets exactly the same input.

A workload is a list of (prompt token ids, output length). It is made deterministically from a seed and a
tokenizer (random tokens, optionally behind one shared prefix) or from a ShareGPT-format conversation file, and
saved as JSON that any engine's runner can read without pagedllm: ``{"requests": [{"prompt_token_ids": [...],
"output_len": N}, ...], ...}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path

FORMAT = "pagedllm-workload/1"

# ShareGPT conversations kept, as in vLLM's throughput benchmark: both sides at least this long ...
SHAREGPT_MIN_TOKENS = 4
# ... a prompt at most this long, and prompt plus reply at most this long.
SHAREGPT_MAX_PROMPT_TOKENS = 1024
SHAREGPT_MAX_TOTAL_TOKENS = 2048
_HUMAN_ROLES = ("human", "user")


@dataclasses.dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclasses.dataclass
class Workload:
    name: str  # what it is, for reports: "random 256->128 x64 seed 0"
    requests: list[BenchRequest]
    tokenizer: str  # the tokenizer the ids belong to (its model's name)
    seed: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def max_len(self) -> int:
        """The longest prompt plus output: the engine's max_model_len must be at least this."""
        return max(len(r.prompt_token_ids) + r.output_len for r in self.requests)

    def save(self, path: str | Path) -> None:
        data = {"format": FORMAT, "name": self.name, "tokenizer": self.tokenizer, "seed": self.seed,
                "requests": [dataclasses.asdict(r) for r in self.requests]}
        Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path: str | Path) -> "Workload":
        try:
            data = json.loads(Path(path).read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, expected {FORMAT!r}")
            requests = [BenchRequest(list(map(int, r["prompt_token_ids"])), int(r["output_len"]))
                        for r in data["requests"]]
            workload = cls(data["name"], requests, data["tokenizer"], data["seed"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WorkloadError(f"cannot read the workload file {path}: {exc!r}. Make one with --save-workload") \
                from None
        if not requests or any(not r.prompt_token_ids or r.output_len < 1 for r in requests):
            raise WorkloadError(f"the workload file {path} has no requests, or one with an empty prompt or an "
                                f"output length below 1")
        return workload


class WorkloadError(ValueError):
    """The workload options or file cannot give requests; the message says what to change."""


def ordinary_token_ids(tokenizer) -> list[int]:
    """Every token id of the vocabulary except special tokens, sorted (what random prompts draw from)."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def random_workload(tokenizer, tokenizer_name: str, num_prompts: int, input_len: int, output_len: int,
                    seed: int = 0, prefix_len: int = 0) -> Workload:
    """``num_prompts`` prompts of ``prefix_len`` shared random tokens plus ``input_len`` own random tokens."""
    for name, value, low in (("num_prompts", num_prompts, 1), ("input_len", input_len, 1),
                             ("output_len", output_len, 1), ("prefix_len", prefix_len, 0)):
        if value < low:
            raise WorkloadError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
    rng = random.Random(seed)
    vocab = ordinary_token_ids(tokenizer)
    prefix = rng.choices(vocab, k=prefix_len)
    requests = [BenchRequest(prefix + rng.choices(vocab, k=input_len), output_len) for _ in range(num_prompts)]
    shared = f"{prefix_len} shared + " if prefix_len else ""
    return Workload(f"random {shared}{input_len} -> {output_len} tokens x{num_prompts}, seed {seed}", requests,
                    tokenizer_name, seed)


def sharegpt_workload(path: str | Path, tokenizer, tokenizer_name: str, num_prompts: int, seed: int = 0,
                      output_len: int | None = None) -> Workload:
    """Prompts from a ShareGPT-format file: each conversation's first human turn, and the next turn's token
    count as the output length (or ``output_len``). Conversations are shuffled with ``seed``; too short or too
    long ones are skipped."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"cannot read the ShareGPT file {path}: {exc}") from None
    if not isinstance(data, list):
        raise WorkloadError(f"{path} is not in the ShareGPT format: expected a JSON list of "
                            f"{{'conversations': [{{'from': ..., 'value': ...}}, ...]}}")
    pairs = [pair for entry in data if (pair := _first_exchange(entry)) is not None]
    random.Random(seed).shuffle(pairs)
    requests = []
    for prompt, reply in pairs:
        if len(requests) == num_prompts:
            break
        prompt_ids = tokenizer(prompt).input_ids
        n_out = len(tokenizer(reply).input_ids) if output_len is None else output_len
        if len(prompt_ids) < SHAREGPT_MIN_TOKENS or n_out < SHAREGPT_MIN_TOKENS:
            continue
        if len(prompt_ids) > SHAREGPT_MAX_PROMPT_TOKENS or len(prompt_ids) + n_out > SHAREGPT_MAX_TOTAL_TOKENS:
            continue
        requests.append(BenchRequest(prompt_ids, n_out))
    if len(requests) < num_prompts:
        raise WorkloadError(f"{path} has only {len(requests)} usable conversations (a human turn and a reply, "
                            f"{SHAREGPT_MIN_TOKENS}..{SHAREGPT_MAX_PROMPT_TOKENS} prompt tokens, at most "
                            f"{SHAREGPT_MAX_TOTAL_TOKENS} in all); ask for --num-prompts {len(requests)} or fewer")
    return Workload(f"sharegpt {Path(path).name} x{num_prompts}, seed {seed}", requests, tokenizer_name, seed)


def _first_exchange(entry) -> tuple[str, str] | None:
    """The first human turn and the turn after it, or None if the conversation has no such pair."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for i, turn in enumerate(turns[:-1]):
        if isinstance(turn, dict) and turn.get("from") in _HUMAN_ROLES:
            reply = turns[i + 1]
            if isinstance(reply, dict) and isinstance(turn.get("value"), str) and isinstance(reply.get("value"), str):
                return turn["value"], reply["value"]
            return None
    return None


# -- command-line options ------------------------------------------------------------------------------------
def add_workload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", metavar="PATH", help="read the requests from a workload file (made with "
                       "--save-workload); the other workload options are then ignored")
    group.add_argument("--dataset", metavar="PATH", help="a ShareGPT-format JSON file: first human turn = prompt, "
                       "the reply's token count = output length")
    group.add_argument("--dataset-name", choices=("random", "sharegpt"), default=None,
                       help="random token prompts, or sharegpt (needs --dataset); default: sharegpt when --dataset "
                            "is given, else random")
    group.add_argument("--num-prompts", type=int, default=64, help="number of requests (default 64)")
    group.add_argument("--input-len", type=int, default=256,
                       help="random: prompt tokens per request, after the shared prefix (default 256)")
    group.add_argument("--output-len", type=int, default=None,
                       help="output tokens per request (random: default 128; sharegpt: overrides the reply length)")
    group.add_argument("--prefix-len", type=int, default=0,
                       help="random: tokens of one prefix shared by all prompts (default 0)")
    group.add_argument("--save-workload", metavar="PATH", help="also write the requests to a workload file")


def workload_from_args(args: argparse.Namespace, tokenizer, tokenizer_name: str, seed: int) -> Workload:
    """The workload the options ask for; ``seed`` (the command's --seed) draws random prompts or shuffles
    ShareGPT conversations."""
    if args.workload:
        return Workload.load(args.workload)
    name = args.dataset_name or ("sharegpt" if args.dataset else "random")
    if name == "sharegpt":
        if not args.dataset:
            raise WorkloadError("--dataset-name sharegpt needs --dataset PATH (a ShareGPT-format JSON file)")
        if args.prefix_len:
            raise WorkloadError("--prefix-len applies to random prompts only; drop it or --dataset")
        return sharegpt_workload(args.dataset, tokenizer, tokenizer_name, args.num_prompts, seed, args.output_len)
    if args.dataset:
        raise WorkloadError("--dataset is a ShareGPT file; use it with --dataset-name sharegpt (or alone)")
    output_len = 128 if args.output_len is None else args.output_len
    return random_workload(tokenizer, tokenizer_name, args.num_prompts, args.input_len, output_len, seed,
                           args.prefix_len)
