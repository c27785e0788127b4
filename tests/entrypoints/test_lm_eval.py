"""lm-evaluation-harness against `pagedllm serve`, as its users run it: `local-completions` (loglikelihood and
generate_until requests) and `local-chat-completions` give, request for request, what its `hf` model gives on the
same folder in float32. The tasks are local files: lm-eval reads nothing from the Hub."""

from __future__ import annotations

import json
import signal

import pytest
from server_process import ServerProcess

lm_eval = pytest.importorskip("lm_eval")

MODEL = "tiny"
QUESTIONS = [("Paris is the capital of", [" France", " Germany", " fox", " dog"], 0),
             ("The quick brown fox jumps over the", [" lazy dog", " capital", " cache", " blocks"], 0),
             ("A paged KV cache stores keys and", [" values", " numbers", " emojis", " Paris"], 0),
             ("def add(a, b):\n    return", [" a + b", " a - b", " None", " fox"], 0)]
PROMPTS = ["Paris is", "The quick brown", "Continuous batching schedules", "Numbers like"]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    with open(folder / "choice.jsonl", "w") as f:
        for question, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(folder / "gen.jsonl", "w") as f:
        for prompt in PROMPTS:
            f.write(json.dumps({"question": prompt, "answer": "x"}) + "\n")
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: \"{{question}}\"\n"
    (folder / "choice.yaml").write_text(
        f"task: pagedllm_choice\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'choice.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "gen.yaml").write_text(
        f"task: pagedllm_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(folder), include_defaults=False)  # its own hundreds of tasks unread


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    server = ServerProcess([str(tiny_llama_dir), "--dtype", "float32", "--kv-cache-space", "0.02",
                            "--served-model-name", MODEL, "--enable-prefix-caching"],
                           tmp_path_factory.mktemp("lm-eval") / "server.log")
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.log()


def evaluate(tasks, model: str, model_args: dict, task_names: list[str], chat: bool = False) -> dict:
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=task_names, task_manager=tasks,
                                      log_samples=True, apply_chat_template=chat, batch_size=1, device="cpu")
    return {name: [sample["resps"] for sample in samples] for name, samples in results["samples"].items()}


def test_local_completions_and_chat_equal_the_hf_model(server, tasks, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    reference = evaluate(tasks, "hf", {"pretrained": str(tiny_llama_dir), "dtype": "float32"},
                         ["pagedllm_choice", "pagedllm_gen"])
    api = {"model": MODEL, "tokenizer": str(tiny_llama_dir), "num_concurrent": 2, "max_retries": 1}
    served = evaluate(tasks, "local-completions", {**api, "base_url": server.url + "/v1/completions",
                                                   "tokenized_requests": True}, ["pagedllm_choice", "pagedllm_gen"])
    assert len(served["pagedllm_choice"]) == len(QUESTIONS)
    for ours, theirs in zip(served["pagedllm_choice"], reference["pagedllm_choice"]):
        for (ours_lp, ours_greedy), (their_lp, their_greedy) in (
                (choice[0], other[0]) for choice, other in zip(ours, theirs)):
            assert float(ours_lp) == pytest.approx(float(their_lp), abs=1e-3)
            assert str(ours_greedy) == str(their_greedy)
    assert served["pagedllm_gen"] == reference["pagedllm_gen"]
    chat_reference = evaluate(tasks, "hf", {"pretrained": str(tiny_llama_dir), "dtype": "float32"},
                              ["pagedllm_gen"], chat=True)
    chat = evaluate(tasks, "local-chat-completions", {**api, "base_url": server.url + "/v1/chat/completions"},
                    ["pagedllm_gen"], chat=True)
    assert chat["pagedllm_gen"] == chat_reference["pagedllm_gen"]
