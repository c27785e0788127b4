"""Llama decoder layers fused into one forward: which layers qualify, and what the bf16 residual stream modes do."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.backends.cpu.layers.fused_layers import use_fused_decoder_layers
from pagedllm.backends.cpu.runner.kernels import load_kernels

kernels, _ = load_kernels("auto")
pytestmark = [pytest.mark.skipif(kernels is None, reason="the C++ kernels could not be built here"),
              pytest.mark.cpu_isa]


@pytest.mark.parametrize("arch, expected", [("llama", True), ("mistral", False), ("qwen2", False), ("qwen3", False),
                                            ("gemma", False)])
def test_only_llamas_own_layers_are_fused(tiny_model_dirs, arch, expected):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch], dtype=torch.float32)
    layers = model.config.num_hidden_layers
    assert use_fused_decoder_layers(model, kernels, torch.float32) == (layers if expected else 0)
    if expected:
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert not hasattr(attn, "q_proj") and attn.qkv_proj.out_features == (
            model.config.num_attention_heads + 2 * model.config.num_key_value_heads) * attn.head_dim
        assert not hasattr(mlp, "up_proj") and mlp.gate_up_proj.out_features == 2 * mlp.intermediate_size


@pytest.mark.parametrize("residual", ["model", "float32"])
def test_bf16_runs_with_either_residual_stream(tiny_llama, residual):
    llm = LLM(str(tiny_llama), dtype="bfloat16", residual_dtype=residual, max_model_len=128, kv_cache_space=0.01)
    assert llm.engine.config.backend_options["residual_dtype"] == residual
    if kernels.linear_bf16_available():  # gate/up and SiLU-and-multiply as one brgemm call
        assert type(llm.engine.backend.runner.model.model.layers[0].mlp.gate_up_proj).__name__ == "BrgemmSiluAndMul"
    reference = LLM(str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_space=0.01)
    prompts = [[5 + i, 9, 33, 71, 100 + i, 7, 8] for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy, use_tqdm=False)]
    assert sum(g[0] == w[0] for g, w in zip(got, want)) >= 3  # first tokens of a random tiny model mostly agree
    llm.shutdown()
    reference.shutdown()


def test_each_layer_leaves_its_mlp_output_to_the_next_fused_one(tiny_model_dirs):
    from pagedllm.backends.cpu.layers.fused_layers import _followed_by_fused

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)
    layers = list(model.model.layers)
    assert len(layers) == 2
    assert _followed_by_fused(model, layers) == {id(layers[0]): id(layers[1])}  # the last one adds its own output
    assert _followed_by_fused(model, layers[:1]) == {}  # nor does a layer hand it to one that is not fused


def test_a_step_hands_each_mlp_output_to_the_next_norm(tiny_llama):
    """Every layer but the first adds the previous MLP output in its input norm: add + RMSNorm twice per layer but
    once in the first, plain RMSNorm only there and in the model's final norm."""
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_space=0.01)
    layers = llm.engine.model_info.num_layers
    counts = {"add_rms_norm": 0, "rms_norm": 0}
    originals = {name: getattr(kernels, name) for name in counts}

    def counted(name):
        def call(*args):
            counts[name] += 1
            return originals[name](*args)
        return call

    try:
        for name in counts:
            setattr(kernels, name, counted(name))
        llm.generate([[5, 9, 33, 71]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    finally:
        for name, fn in originals.items():
            setattr(kernels, name, fn)
    assert counts == {"add_rms_norm": 2 * layers - 1, "rms_norm": 2}
    llm.shutdown()


def test_a_failed_step_leaves_the_next_steps_unchanged(tiny_llama):
    """A step that raises inside a layer's MLP fails its request; the next steps compute what they did before."""
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_space=0.01)
    prompts = [[5, 9, 33, 71, 100, 7, 8]]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate(prompts, greedy, use_tqdm=False)[0].outputs[0].token_ids
    mlp = llm.engine.backend.runner.model.model.layers[1].mlp
    down = mlp.down_proj

    class Boom(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("injected")

    mlp.down_proj = Boom()
    failed = llm.generate(prompts, greedy, use_tqdm=False)
    assert not any(completion.token_ids for output in failed for completion in output.outputs)
    mlp.down_proj = down
    assert llm.generate(prompts, greedy, use_tqdm=False)[0].outputs[0].token_ids == want
    llm.shutdown()
