"""LoRA adapters on the cpu backend against transformers + peft, greedy in float32: each adapter alone and in a batch
mixed with other adapters and the base model, on a tiny Llama (fused q/k/v and gate/up: adapters add to their
slices), a tiny Qwen2 (separate projections with biases) and SmolLM2; under prefix caching, an adapter never reads
the base model's blocks; max_loras holds back a third adapter; what cannot be served is refused by name; in bf16
(A and B in bf16 too) each adapter stays close to float32."""

from __future__ import annotations

import pytest
from lora_adapters import make_adapter, peft_greedy

from pagedllm import LLM, ConfigError, InvalidRequestError, LoRARequest, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23], [100, 101, 102, 103, 104, 105, 106, 107, 108]]
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tiny_model_dirs, tmp_path_factory):
    model = tiny_model_dirs[request.param]
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    a = make_adapter(model, root / "a", seed=1)
    b = make_adapter(model, root / "b", seed=2, rank=4, targets=("q_proj", "v_proj", "down_proj"))
    expected = {name: peft_greedy(model, adapter, PROMPTS, NEW_TOKENS)
                for name, adapter in (("a", a), ("b", b), (None, None))}
    return model, {"a": LoRARequest("a", 1, str(a)), "b": LoRARequest("b", 2, str(b))}, expected


def test_adapters_mixed_in_a_batch_with_the_base_model_equal_peft(case):
    model, loras, expected = case
    llm = LLM(str(model), dtype="float32", enable_lora=True, max_loras=2, kv_cache_space=0.02,
              enable_prefix_caching=True, max_num_batched_tokens=16, max_num_seqs=8)  # chunked prompts
    order = [(i, name) for name in ("a", None, "b") for i in range(len(PROMPTS))]
    outs = llm.generate([PROMPTS[i] for i, _ in order], GREEDY, use_tqdm=False,
                        lora_request=[loras[name] if name else None for _, name in order])
    assert [o.outputs[0].token_ids for o in outs] == [expected[name][i] for i, name in order]
    # alone, and again after the base model cached the same prompts: an adapter never reuses the base's blocks
    for name in ("b", "a"):
        alone = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras[name])
        assert [o.outputs[0].token_ids for o in alone] == expected[name]
    llm.shutdown()


def test_bf16_adapters_agree_with_float32(case):
    """A bf16 model keeps its adapters' A and B in bf16 (the kernel reads half the bytes): each adapter's prompt
    logprobs stay close to float32's, much closer than to the base model's."""
    model, loras, _ = case
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    requests = [loras["a"], loras["b"], None]
    scores = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(model), dtype=dtype, enable_lora=True, max_loras=2, kv_cache_space=0.02)
        outs = llm.generate([PROMPTS[2]] * 3, params, use_tqdm=False, lora_request=requests)
        scores[dtype] = [[entry[token].logprob for entry, token in zip(o.prompt_logprobs[1:], PROMPTS[2][1:])]
                         for o in outs]
        llm.shutdown()
    for adapter in range(2):  # a, b; the third is the base model
        exact, rounded, base = scores["float32"][adapter], scores["bfloat16"][adapter], scores["float32"][2]
        bf16_error = sum(abs(x - y) for x, y in zip(exact, rounded))
        assert bf16_error < 0.2 * sum(abs(x - y) for x, y in zip(exact, base)), (exact, rounded, base)


def test_max_loras_runs_a_third_adapter_after_the_others(case, tmp_path):
    model, loras, expected = case
    llm = LLM(str(model), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2, kv_cache_space=0.02)
    outs = llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False, lora_request=[loras["a"]] * 3 + [loras["b"]] * 3)
    assert [o.outputs[0].token_ids for o in outs] == expected["a"] + expected["b"]
    llm.shutdown()


def test_two_adapters_with_the_default_settings_run_one_after_the_other(case):
    model, loras, expected = case
    llm = LLM(str(model), dtype="float32", enable_lora=True, kv_cache_space=0.02)  # max_loras 1
    outs = llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False, lora_request=[loras["a"], loras["b"]] * 3)
    assert [o.outputs[0].token_ids for o in outs] == [expected[n][i] for i, n in
                                                      zip([0, 1, 2, 0, 1, 2], ["a", "b"] * 3)]
    llm.shutdown()


def test_an_adapter_that_fails_to_load_after_an_eviction_leaves_the_others_serving(case, tmp_path):
    model, loras, expected = case
    wide = make_adapter(model, tmp_path / "wide", seed=5, rank=32)
    llm = LLM(str(model), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2, kv_cache_space=0.02)
    for name in ("a", "b"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=loras[name])
    with pytest.raises(InvalidRequestError, match="rank 32"):  # evicts b, then cannot load
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("wide", 3, str(wide)))
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[loras["a"], None, loras["b"]])
    assert [o.outputs[0].token_ids for o in outs] == [expected["a"][0], expected[None][1], expected["b"][2]]
    llm.shutdown()


def test_refusals_name_what_is_wrong(tiny_llama, tmp_path):
    adapter = make_adapter(tiny_llama, tmp_path / "wide", seed=3, rank=32)
    plain = LLM(str(tiny_llama), dtype="float32", kv_cache_space=0.01)
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        plain.generate([[5, 6]], GREEDY, lora_request=LoRARequest("wide", 1, str(adapter)))
    plain.shutdown()
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_space=0.01, enable_lora=True)
    with pytest.raises(InvalidRequestError, match="rank 32 is above --max-lora-rank 16"):
        llm.generate([[5, 6]], GREEDY, lora_request=LoRARequest("wide", 1, str(adapter)))
    with pytest.raises(InvalidRequestError, match="cannot be loaded from"):
        llm.generate([[5, 6]], GREEDY, lora_request=LoRARequest("nowhere", 2, str(tmp_path / "nowhere")))
    assert llm.generate([[5, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # the engine serves on
    llm.shutdown()
    with pytest.raises(ConfigError, match="drop --tensor-parallel-size"):
        LLM(str(tiny_llama), dtype="float32", enable_lora=True, tensor_parallel_size=2, kv_cache_space=0.01)
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        LLM(str(tiny_llama), enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ConfigError, match="--batch-invariant does not go with --enable-lora"):
        LLM(str(tiny_llama), dtype="float32", enable_lora=True, batch_invariant=True, kv_cache_space=0.01)


@pytest.mark.parametrize("arch", ["phi3", "gpt2"])
def test_models_of_other_layouts_refuse_adapters(tiny_model_dirs, arch):
    with pytest.raises(ConfigError, match="adapters run on Llama-family decoder layers"):
        LLM(str(tiny_model_dirs[arch]), dtype="float32", enable_lora=True, kv_cache_space=0.01)


def test_smollm2_adapter_equals_peft(tmp_path):
    from pagedllm.models.source import default_model_path, gguf_to_hf

    dense = gguf_to_hf(default_model_path())  # its GGUF dequantized, made once into the cache
    adapter = make_adapter(dense, tmp_path / "smollm2", seed=4)
    prompts = PROMPTS[:2]
    expected = peft_greedy(dense, adapter, prompts, NEW_TOKENS)
    llm = LLM(str(dense), dtype="float32", enable_lora=True, kv_cache_space=0.05, max_model_len=512)
    outs = llm.generate(prompts + prompts, GREEDY, use_tqdm=False,
                        lora_request=[LoRARequest("s", 1, str(adapter))] * 2 + [None] * 2)
    assert [o.outputs[0].token_ids for o in outs[:2]] == expected
    assert [o.outputs[0].token_ids for o in outs[2:]] != expected  # the base model writes something else
    llm.shutdown()


def test_the_openvino_backend_refuses_adapters_saying_why(tiny_llama):
    from pagedllm.plugins import list_backends

    if not any(b.name == "openvino" and b.available for b in list_backends()):
        pytest.skip("openvino is not installed")
    with pytest.raises(ConfigError, match="serves no LoRA adapters: its exported graph holds the weights"):
        LLM(str(tiny_llama), backend="openvino", enable_lora=True, kv_cache_space=0.01)
