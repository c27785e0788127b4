"""The offline Python API: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tqdm import tqdm

from pagedllm.config import EngineArgs, setting_value
from pagedllm.engine.input_processing import PromptType, render_chat
from pagedllm.engine.sync_client import make_engine_client
from pagedllm.errors import ConfigError
from pagedllm.lora_request import LoRARequest
from pagedllm.models.generation_defaults import generation_defaults
from pagedllm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.scoring import pair_scores, score_pairs, unique_texts
from pagedllm.sampling_params import SamplingParams


class LLM:
    """An engine plus a loop that runs a batch of prompts to completion.

    ``model`` is a Hugging Face folder, a GGUF file or an OpenVINO export (default: SmolLM2-135M-Instruct);
    ``backend`` defaults to ``cpu`` (or PAGEDLLM_BACKEND); other keyword arguments are engine settings
    (``dtype``, ``max_model_len``, ``enable_prefix_caching``, ``kv_cache_space``, ...). ``engine_process=True``
    runs the scheduler and the model in an engine-core process of their own, as ``pagedllm serve`` does, and
    detokenizes in this one.
    """

    def __init__(self, model: str | None = None, backend: str | None = None, engine_process: bool = False,
                 **engine_args) -> None:
        args = EngineArgs.from_kwargs(model=model, backend=backend, **engine_args)
        if args.data_parallel_rank is None and setting_value(args, "data_parallel_size") > 1:
            raise ConfigError("data_parallel_size runs replicas behind `pagedllm serve`; LLM runs one engine (give "
                              "it the CPUs of all, or run one LLM per CPU set)")
        self.engine = make_engine_client(args, engine_process)
        self._default_params: SamplingParams | None = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a generate call without SamplingParams uses: the model's generation_config.json defaults
        (--generation-config auto), as vLLM's."""
        if self._default_params is None:
            self._default_params = SamplingParams(**generation_defaults(self.engine.source,
                                                                        self.engine.config.generation_config))
        return self._default_params

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A single string or token-id list is one prompt. ``priority``, one
        per prompt, orders them under ``scheduling_policy="priority"`` (lower first). ``lora_request``: the adapter
        of every prompt, or one per prompt (None for the base model), with ``enable_lora=True``."""
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        if lora_request is not None:
            loras = [lora_request] * len(prompts) if isinstance(lora_request, LoRARequest) else list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
            params_list = [dataclasses.replace(p, lora_request=lora) for p, lora in zip(params_list, loras)]
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priorities)} priorities")
        return self._run(prompts, params_list, use_tqdm, priorities)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = True, continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"}) or to several, as vLLM's
        ``LLM.chat``: ``tools`` (OpenAI's shape) and ``chat_template_kwargs`` reach the chat template;
        ``continue_final_message`` goes on writing the last (assistant) message."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conv, chat_template, add_generation_prompt, continue_final_message,
                                            tools, chat_template_kwargs) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embeddings of the prompts (a model run with ``runner="pooling"``), in their order, as vLLM's: each
        output's ``outputs.embedding``."""
        prompts = _prompt_list(prompts)
        if prompts and all(isinstance(p, str) for p in prompts):  # one tokenizer call for the batch: short texts
            ids = self.engine.tokenizer(prompts).input_ids      # cost more to tokenize one by one than to embed
            prompts = [{"prompt": p, "prompt_token_ids": i} for p, i in zip(prompts, ids)]
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params_list)} pooling params")
        outputs = self._run(prompts, params_list, use_tqdm, [0] * len(prompts))
        failed = next((o for o in outputs if o.error is not None), None)
        if failed is not None:
            raise RuntimeError(failed.error)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.embedding))
                for o in outputs]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """Similarity scores of text pairs, as vLLM's ``LLM.score`` for embedding models: the cosine of their
        embeddings. One ``text_1`` against each ``text_2``, or the lists pairwise (of equal length)."""
        first, second = score_pairs(text_1, text_2)
        unique = unique_texts(first, second)
        embedded = dict(zip(unique, self.embed(unique, use_tqdm=use_tqdm)))
        scores = pair_scores(first, second, {text: o.outputs.embedding for text, o in embedded.items()})
        return [ScoringRequestOutput(str(i), embedded[b].prompt_token_ids, ScoringOutput(score))
                for i, (b, score) in enumerate(zip(second, scores))]

    def apply_chat_template(self, conversation: list[dict], chat_template: str | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> dict:
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        if continue_final_message:
            kwargs["continue_final_message"] = True
        return render_chat(self.engine.tokenizer, conversation, chat_template, add_generation_prompt, **kwargs)

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams] | list[PoolingParams], use_tqdm: bool,
             priorities: list[int]) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for prompt, params, priority in zip(prompts, params_list, priorities):
                ids.append(engine.add_request(None, prompt, params, priority=priority))
        except BaseException:
            engine.abort_request(ids)
            raise
        results: dict[str, RequestOutput] = {}
        latest: dict[str, dict[int, CompletionOutput]] = {i: {} for i in ids}  # per request: index -> newest
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    sequences = latest[output.request_id]
                    for completion in output.outputs:
                        sequences[completion.index] = completion
                    if output.finished:
                        output.outputs = [sequences[i] for i in sorted(sequences)]
                        results[output.request_id] = output
                        bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
            engine.release_thread()  # the caller's thread is the user's: not left pinned to one CPU
        return [results[i] for i in ids]

    def shutdown(self) -> None:
        self.engine.shutdown()


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """A single string, dict or token-id list is one prompt."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)

