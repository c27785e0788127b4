"""Quantized weights on the cpu backend: GGUF's blocks repacked without loss (against gguf's own dequantize), the
kernels against the pure torch reference on every ISA kind, and whole models quantized at load equal to
transformers running the same dequantized weights, token for token in float32 (one process and two ranks)."""

import gguf
import numpy as np
import pytest
import torch
from tiny_models import hf_greedy, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.backends.cpu.layers import quant_formats as qf
from pagedllm.backends.cpu.runner.kernels import load_kernels
from pagedllm.errors import ConfigError

ROWS = [1, 3, 4, 5, 16]


def gguf_blocks(type_name: str, rows: int, in_features: int, seed: int = 0) -> np.ndarray:
    """A GGUF tensor's raw blocks: gguf's own quantizer where it has one, else random bits with sane scales."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("Q8_0", "Q4_0", "Q4_1"):
        return gguf.quants.quantize(rng.standard_normal((rows, in_features)).astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, in_features // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    scale = (rng.standard_normal((blocks.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":
        blocks[:, 208:210] = scale
    else:  # d and dmin
        blocks[:, 0:2] = scale
        blocks[:, 2:4] = scale
    return raw


def gguf_dequantized(raw: np.ndarray, type_name: str, rows: int, in_features: int) -> torch.Tensor:
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(values.reshape(rows, in_features).astype(np.float32))


@pytest.fixture(scope="module")
def kernels():
    module, _ = load_kernels("kernel")
    return module


@pytest.mark.parametrize("type_name", qf.GGUF_FORMATS)
def test_gguf_blocks_repack_without_loss(type_name):
    raw = gguf_blocks(type_name, 8, 512)
    weight = qf.from_gguf(raw, type_name, 8, 512)
    torch.testing.assert_close(weight.dequantize(), gguf_dequantized(raw, type_name, 8, 512), rtol=1e-6, atol=0)


def test_a_damaged_tensor_is_refused_clearly():
    raw = gguf_blocks("Q4_K", 4, 512)
    with pytest.raises(ValueError, match="truncated or damaged"):
        qf.from_gguf(raw[:, :-10], "Q4_K", 4, 512)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        qf.from_gguf(raw, "Q4_K", 4, 300)


@pytest.mark.parametrize("rows_per_pass", [qf.ROWS_PER_PASS, 5])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_quantized_at_load_as_gguf_quantizes(fmt, rows_per_pass, monkeypatch):
    monkeypatch.setattr(qf, "ROWS_PER_PASS", rows_per_pass)  # 5: the weight in passes, the last one short
    w = torch.randn(16, 256)
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[fmt.upper()])
    expected = gguf_dequantized(raw, fmt.upper(), 16, 256)
    torch.testing.assert_close(qf.quantize(w, fmt).dequantize(), expected, rtol=0, atol=0)


def test_int8_is_symmetric_per_row(monkeypatch):
    monkeypatch.setattr(qf, "ROWS_PER_PASS", 3)
    torch.manual_seed(0)
    w = torch.randn(8, 64)
    weight = qf.quantize(w, "int8")
    assert weight.format == "int8"
    scale = w.abs().amax(-1, keepdim=True) / 127
    torch.testing.assert_close(weight.dequantize(), torch.round(w / scale) * scale, rtol=1e-5, atol=1e-6)


def test_rows_columns_widening_and_concatenation_keep_the_values():
    a = qf.from_gguf(gguf_blocks("Q4_K", 6, 512), "Q4_K", 6, 512)
    b = qf.from_gguf(gguf_blocks("Q6_K", 4, 512, seed=1), "Q6_K", 4, 512)
    c = qf.from_gguf(gguf_blocks("Q8_0", 2, 512, seed=2), "Q8_0", 2, 512)
    both = qf.concatenate([a, b])
    assert (both.bits, both.group, both.format) == (6, 16, "Q4_K+Q6_K")
    torch.testing.assert_close(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    wider = qf.concatenate([b, c])
    assert (wider.bits, wider.group) == (8, 16)
    torch.testing.assert_close(wider.dequantize(), torch.cat([b.dequantize(), c.dequantize()]))
    for weight in (a, b):
        torch.testing.assert_close(weight.rows(torch.tensor([3, 0])).dequantize(), weight.dequantize()[[3, 0]])
        torch.testing.assert_close(weight.columns(64, 256).dequantize(), weight.dequantize()[:, 64:256])
    # the K-quants' multipliers go along where whole super-blocks do, and are dropped where one is split
    assert both.multipliers.shape == (10, 2, 2) and wider.multipliers is None
    assert a.columns(256, 512).multipliers.shape == (6, 1, 2) and a.columns(64, 256).multipliers is None
    with pytest.raises(ValueError, match="whole chunks"):
        a.columns(16, 256)
    # Q5_K's values take 5 bits, widened to 6 beside Q6_K's
    d = qf.from_gguf(gguf_blocks("Q5_K", 3, 512, seed=3), "Q5_K", 3, 512)
    assert d.bits == 5 and d.values.shape == (3, 512 * 5 // 8)
    for others, layout in (([a], (5, 32, "Q4_K+Q5_K")), ([b], (6, 16, "Q5_K+Q6_K"))):
        fused = qf.concatenate([d, *others])
        assert (fused.bits, fused.group, fused.format) == layout
        torch.testing.assert_close(fused.dequantize(), torch.cat([d.dequantize(), *(w.dequantize() for w in others)]))
    torch.testing.assert_close(d.columns(32, 288).dequantize(), d.dequantize()[:, 32:288])


def test_k_quant_scales_that_do_not_factor_stay_float():
    weight = qf.from_gguf(gguf_blocks("Q4_K", 16, 512), "Q4_K", 16, 512)
    assert qf.to_panels(weight).scales.dtype == torch.int8
    weight.multipliers[3, 1, 0] *= 1.37  # no longer a divisor of row 3's scales in its second super-block
    panels = qf.to_panels(weight)
    assert panels.scales.dtype == torch.float32 and panels.multipliers.numel() == 0


def integer_reference(x: torch.Tensor, weight: qf.QuantizedWeight, bits: int = 8) -> torch.Tensor:
    """What the int8 and int16 paths compute: the weight times x quantized per 32 inputs to int8 or int16."""
    chunks = x.float().reshape(x.shape[0], -1, 32)
    d = chunks.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
    q = torch.round(chunks * torch.where(d > 0, 1 / d, 0)) * d
    return q.reshape(x.shape) @ weight.dequantize().T


@pytest.mark.cpu_isa
@pytest.mark.parametrize("type_name", qf.GGUF_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("piece_bytes", [qf.PIECE_BYTES, 1])
def test_kernels_equal_the_torch_reference(kernels, type_name, dtype, piece_bytes, monkeypatch):
    """Both dot-product paths, rows in and across the kernel's tiles of 4, an input width of 3 chunks of 32 (odd
    pairs), a bias, float32 and bf16 output; the panels made in one piece, or in pieces of one panel (the last one
    padded), as a large LM head's are."""
    monkeypatch.setattr(qf, "PIECE_BYTES", piece_bytes)
    in_features = 768 if type_name.endswith("_K") else 96
    raw = gguf_blocks(type_name, 40, in_features)
    weight = qf.from_gguf(raw, type_name, 40, in_features)
    dense = gguf_dequantized(raw, type_name, 40, in_features)
    bias = torch.randn(40)
    panels = qf.to_panels(weight)
    if type_name in ("Q8_0", "Q4_0", "Q4_1"):  # their scales and offsets are exact in float16
        assert panels.scales.dtype == panels.offsets.dtype == torch.float16
    if type_name.endswith("_K"):  # as the file keeps them: integer factors of a multiplier per 256 inputs
        assert panels.scales.dtype == torch.int8 and panels.multipliers.shape == (3, in_features // 256, 2, 16)
    # symmetric formats store a zero point instead of offsets
    assert panels.zero == {"Q4_0": 8, "Q8_0": 128, "Q6_K": 32}.get(type_name, 0)
    assert panels.offsets.numel() == 0 if panels.zero else panels.offsets.shape == panels.scales.shape
    args = (*panels.arguments, bias)
    assert torch.equal(kernels.dequantize_weight(*args[:8], False), weight.dequantize())
    assert torch.equal(kernels.dequantize_weight(*args[:8], True), weight.dequantize().bfloat16())
    ids = torch.tensor([[39, 0], [17, 17]])  # an embedding lookup in these rows: last panel, repeats
    assert torch.equal(kernels.dequantize_rows(*args[:8], ids.flatten(), False), weight.dequantize()[ids.flatten()])
    assert torch.equal(kernels.dequantize_rows(*args[:8], ids.flatten(), True), weight.dequantize()[ids.flatten()]
                       .bfloat16())
    with pytest.raises(RuntimeError, match="outside"):
        kernels.dequantize_rows(*args[:8], torch.tensor([40]), False)
    for rows in ROWS:
        x = torch.randn(rows, in_features).to(dtype)
        exact = x.float() @ dense.T + bias
        got = {bits: kernels.quantized_linear(x, *args, float_output=True, activation_bits=bits) for bits in (8, 16)}
        for bits, sums in got.items():
            expected = integer_reference(x, weight, bits) + bias
            torch.testing.assert_close(sums, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
        # int16 activations: within 1 part in 65534 of each chunk's largest of the exact sums
        torch.testing.assert_close(got[16], exact, rtol=1e-3, atol=1e-3 * exact.abs().max().item())
        with pytest.raises(RuntimeError, match="8 or 16 bits"):
            kernels.quantized_linear(x, *args, float_output=True, activation_bits=32)
        for bits, sums in got.items():  # x's dtype out: the same sums, rounded once
            rounded = kernels.quantized_linear(x, *args, float_output=False, activation_bits=bits)
            assert rounded.dtype == dtype
            torch.testing.assert_close(rounded.float(), sums.to(dtype).float(), rtol=0, atol=0)


@pytest.mark.cpu_isa
@pytest.mark.parametrize("type_name", qf.GGUF_FORMATS)
def test_bf16_kernels_equal_the_dense_bf16_linear(kernels, type_name):
    """The tiles equal the dense brgemm linear over the dequantized weight bit for bit, at any row count, and so does
    their SwiGLU form ([gate; up] rows) the unfused product and SiLU kernel; the few-row kernel sums the bf16 inputs'
    products with the unrounded weights, as float32 would."""
    if not kernels.quantized_linear_bf16_available():
        pytest.skip("the bf16 quantized kernels need AVX512_BF16")
    torch.manual_seed(0)
    in_features = 768 if type_name.endswith("_K") else 96
    out_features = 288  # as gate and up: two blocks of 64 columns each and 16 of a third (SiLU kernel: no tail)
    raw = gguf_blocks(type_name, out_features, in_features, seed=1)
    weight = qf.from_gguf(raw, type_name, out_features, in_features)
    packed = kernels.pack_linear_weight_bf16(weight.dequantize().bfloat16())
    bias = torch.randn(out_features)
    args = (*qf.to_panels(weight).arguments, bias)
    for rows in (1, 3, 4, 5, 64, 70, 130):
        x = torch.randn(rows, in_features).bfloat16()
        for float_output in (False, True):
            dense = kernels.linear_bf16(x, packed, bias, out_features, float_output)
            assert torch.equal(kernels.quantized_linear_bf16(x, *args, float_output), dense)
        both = kernels.quantized_linear_bf16(x, *args, False)
        fused = kernels.quantized_linear_silu_and_mul_bf16(x, *args[:7], bias, out_features // 2)
        # equal but for subnormal outputs, which the GEMM's epilogue flushes to zero (oneDNN sets FTZ)
        unfused = kernels.silu_and_mul(both[:, :out_features // 2], both[:, out_features // 2:])
        torch.testing.assert_close(fused, unfused, rtol=0, atol=torch.finfo(torch.bfloat16).tiny)
        if rows <= 4:  # the weights are not rounded to bf16 here
            exact = x.float() @ weight.dequantize().T + bias
            torch.testing.assert_close(kernels.quantized_gemv_bf16(x, *args, True), exact, rtol=1e-5,
                                       atol=1e-5 * exact.abs().max().item())
            assert kernels.quantized_gemv_bf16(x, *args, False).dtype == torch.bfloat16


@pytest.mark.cpu_isa
@pytest.mark.parametrize("type_name", qf.GGUF_FORMATS)
def test_float32_tiles_equal_the_gemm_over_the_dequantized_weight(kernels, type_name):
    """Many rows of a float32 model: blocks of 64 columns dequantized as dequantize_weight does, then the register
    tiles (row tails, a last panel of 8 columns) or, above 256 rows, torch's GEMM; one block (split over the rows to
    keep both threads busy), several and a short last one, a bias; bf16 rows are widened and the output rounded
    back."""
    torch.manual_seed(0)
    in_features = 768 if type_name.endswith("_K") else 96
    for out_features in (40, 288):
        raw = gguf_blocks(type_name, out_features, in_features, seed=2)
        weight = qf.from_gguf(raw, type_name, out_features, in_features)
        bias = torch.randn(out_features)
        args = (*qf.to_panels(weight).arguments, bias)
        for rows in (17, 64, 130):  # x [2, rows, in]: 34 to 260 rows
            x = torch.randn(2, rows, in_features)
            expected = x @ weight.dequantize().T + bias
            with torch.inference_mode():  # as a model's step runs it: the threads' GEMMs write inference tensors
                got = kernels.quantized_linear_tiles_f32(x, *args)
            assert got.shape == (2, rows, out_features) and got.dtype == torch.float32
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
            rounded = kernels.quantized_linear_tiles_f32(x.bfloat16(), *args)
            assert rounded.dtype == torch.bfloat16
            wide = kernels.quantized_linear_tiles_f32(x.bfloat16(), *args, float_output=True)
            assert wide.dtype == torch.float32 and torch.equal(rounded, wide.bfloat16())


def test_kept_kernel_arguments_follow_replaced_buffers(kernels):
    """The layer keeps its kernels' weight arguments between calls; replacing a buffer or converting the module
    (.to, .double: new tensors) makes them again, so a call never reads a dropped tensor."""
    from pagedllm.backends.cpu.layers.quantized_linear import QuantizedLinear

    raw = gguf_blocks("Q4_0", 32, 64, seed=3)
    bias = torch.randn(32)
    layer = QuantizedLinear(qf.from_gguf(raw, "Q4_0", 32, 64), bias, kernels, bf16=False)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        first = layer(x)
        assert layer.kernel_weight()[0] is layer.values and layer.kernel_weight()[-1] is layer.bias
        layer.bias = torch.zeros(32)
        assert layer.kernel_weight()[-1] is layer.bias
        torch.testing.assert_close(layer(x), first - bias, rtol=1e-5, atol=1e-5)
    before = layer.kernel_weight()
    layer.double()  # _apply: the float buffers (scales, offsets, bias) become new tensors
    assert layer.scales is not before[1] and layer.kernel_weight()[1] is layer.scales
    assert layer.kernel_weight()[-1] is layer.bias


@pytest.mark.cpu_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_quantize_and_scale_as_torch(kernels, dtype):
    """W8A8's passes around oneDNN's GEMM: per-row int8 (round half to even, as torch.round) offset by 128 as uint8,
    and the scale back with the bias; widths with and without a vector tail, a zero row."""
    for width in (100, 2048):
        x = (torch.randn(6, width) * 3).to(dtype)
        x[2] = 0
        q, scales = kernels.quantize_rows_uint8(x)
        amax = x.float().abs().amax(-1, keepdim=True)
        assert torch.equal(scales, amax / 127)
        inverse = torch.where(amax > 0, 1 / (amax / 127), 0)
        assert torch.equal(q, (torch.round(x.float() * inverse) + 128).to(torch.uint8))
        out, bias = torch.randn(6, width).to(dtype), torch.randn(width)
        expected = (out.float() * scales + bias).to(dtype)
        kernels.scale_rows(out, scales, bias)
        step = 1e-6 if dtype == torch.float32 else 2 ** -8  # one rounding of a fused multiply-add apart
        torch.testing.assert_close(out, expected, rtol=step, atol=step)


def skip_without_int8_gemm():
    """Skip where the backend does not take oneDNN's int8 GEMM (no oneDNN quantized linear in torch, or no VNNI)."""
    from pagedllm.backends.cpu.layers.int8_gemm import exact_int8_products, int8_gemm_available

    if not int8_gemm_available():
        pytest.skip("torch has no oneDNN quantized linear here")
    if not exact_int8_products():
        pytest.skip("oneDNN's int8 GEMM saturates without VNNI (the backend keeps the panels' kernels there)")


def test_int8_gemm_is_w8a8_and_batch_invariant(kernels):
    """``int8`` weights of a bf16 model through oneDNN's int8 GEMM: x quantized per row times the int8 weight,
    scaled by both; its integer sums are exact, so a row's output does not depend on the rows beside it."""
    from pagedllm.backends.cpu.layers.int8_gemm import Int8GemmLinear, Int8GemmSiluAndMul

    skip_without_int8_gemm()
    weight = qf.quantize(torch.randn(48, 256) * 0.05, "int8")
    bias = torch.randn(48)
    layer = Int8GemmLinear(weight, bias, kernels)
    x = torch.randn(37, 256).bfloat16()
    q, scales = kernels.quantize_rows_uint8(x)
    q = q.double() - 128
    w_int8 = qf.unpack_values(weight.values, 8).double() - 128
    expected = (q @ w_int8.T) * scales.double() * weight.scales[:, :1].T.double() + bias.double()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (37, 48)
    # oneDNN rounds its output to bf16 before the row scales and the bias: a bf16 step of the largest sums
    torch.testing.assert_close(got.double(), expected, rtol=2 ** -7, atol=2 ** -8 * expected.abs().max().item())
    for rows in (1, 4, 16):
        assert torch.equal(layer(x[:rows]), got[:rows])
    layer.float_output = True
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # a SwiGLU's [gate; up]: the row scales applied inside the SiLU's pass
    swiglu = Int8GemmSiluAndMul(weight, None, kernels)
    both = (q @ w_int8.T) * scales.double() * weight.scales[:, :1].T.double()
    silu = torch.nn.functional.silu(both[:, :24]) * both[:, 24:]
    torch.testing.assert_close(swiglu(x).double(), silu, rtol=2 ** -7, atol=2 ** -8 * silu.abs().max().item())


def test_int8_gemm_takes_a_jit_kernel_of_onednn(kernels, capfd):
    """oneDNN falls back to its scalar reference int8 matmul for activations its vectorized kernels here
    cannot multiply (signed bytes on AVX512_VNNI without AMX); its verbose log names the kernel each call ran."""
    from pagedllm.backends.cpu.layers.int8_gemm import Int8GemmLinear

    skip_without_int8_gemm()
    layer = Int8GemmLinear(qf.quantize(torch.randn(64, 256) * 0.05, "int8"), None, kernels)
    x = torch.randn(4, 256).bfloat16()
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        layer(x)
    calls = [line.split(",") for line in capfd.readouterr().out.splitlines() if ",exec,cpu,matmul," in line]
    assert calls, "oneDNN logged no matmul"
    assert not any(fields[6].startswith("ref") for fields in calls), [fields[6] for fields in calls]


def dequantized_copy(model_dir, out_dir, fmt: str):
    """The model with its linears' weights replaced by what quantization at load makes of them, dequantized
    (the head as runner/quantization.py treats it): transformers' view of the same weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    head = model.get_output_embeddings()
    with torch.no_grad():
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                kind = "q8_0" if module is head and fmt != "int8" else fmt
                module.weight.copy_(qf.quantize(module.weight, kind).dequantize())
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([1, 9, 33, 70], seed=4)


def quantized_layers(llm) -> list:
    from pagedllm.backends.cpu.layers.quantized_linear import QuantizedLinear

    return [m for m in llm.engine.backend.runner.model.modules() if isinstance(m, QuantizedLinear)]


def greedy(llm, prompts, tokens=12):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8"])
def test_quantized_at_load_equals_transformers_on_the_same_weights(tiny_llama, tmp_path, prompts, fmt):
    """Prefix caching and chunked prefill on, float32 (the exact dot products)."""
    expected = hf_greedy(dequantized_copy(tiny_llama, tmp_path / fmt, fmt), prompts, 12)
    llm = LLM(str(tiny_llama), dtype="float32", quantization=fmt, max_model_len=256, kv_cache_space=0.05,
              enable_prefix_caching=True, max_num_batched_tokens=32, max_num_seqs=4)
    layers = quantized_layers(llm)
    # 2 layers x (q/k/v, o, gate/up, down), and the head
    assert len(layers) == 9 and not any(m.int8_activations for m in layers)
    assert {m.format for m in layers} == ({fmt} if fmt != "q4_0" else {"q4_0", "q8_0"})
    assert greedy(llm, prompts) == expected


@pytest.mark.parametrize("fmt,restart", [("q8_0", True), ("int8", False)])
def test_two_ranks_shard_quantized_weights(tiny_llama, tmp_path, prompts, fmt, restart, monkeypatch,
                                           isolated_cache_dir):
    """Each rank quantizes the weights out of the memory-mapped files layer by layer and keeps its shares: the whole
    rows' int8 scales, as one process's. Each keeps them in a panel cache entry of its own, which a second start
    (``restart``: one format is enough, the entries hold panels alike) reads: the entries are left as they were (a
    miss would write them again)."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(isolated_cache_dir))
    expected = hf_greedy(dequantized_copy(tiny_llama, tmp_path / fmt, fmt), prompts, 12)

    def start():
        return LLM(str(tiny_llama), dtype="float32", quantization=fmt, tensor_parallel_size=2, max_model_len=256,
                   kv_cache_space=0.05)

    def entries():
        return {path: path.stat().st_mtime_ns for path in (isolated_cache_dir / "panels").glob("*.safetensors")}

    assert greedy(start(), prompts) == expected
    kept = entries()
    assert len(kept) == 2
    if restart:
        assert greedy(start(), prompts) == expected
        assert entries() == kept


@pytest.mark.parametrize("int8_activations", [False, True])
def test_bf16_dot_products_close_to_float32(tiny_llama, prompts, kernels, int8_activations):
    """bf16 models keep bf16 activations (weights dequantized to bf16), or quantize them to int8 for a decode step's
    rows when asked (and always without AVX512_BF16): the first tokens agree with the float32 path's."""
    exact = greedy(LLM(str(tiny_llama), dtype="float32", quantization="q8_0", max_model_len=256,
                       kv_cache_space=0.05), prompts, 4)
    bf16 = LLM(str(tiny_llama), dtype="bfloat16", quantization="q8_0", max_model_len=256, kv_cache_space=0.05,
               int8_activations=int8_activations)
    layers = quantized_layers(bf16)
    int8 = int8_activations or not kernels.quantized_linear_bf16_available()
    assert len(layers) == 9 and all(m.int8_activations == int8 for m in layers)
    fast = greedy(bf16, prompts, 4)
    assert sum(a[0] == b[0] for a, b in zip(exact, fast)) >= len(prompts) - 1


def test_int8_on_a_bf16_model_takes_the_int8_gemm(tiny_llama, prompts, kernels):
    """``--quantization int8`` on a bf16 model is W8A8 through oneDNN (vLLM CPU's): its first tokens agree with the
    float32 path's on the same int8 weights."""
    from pagedllm.backends.cpu.layers.int8_gemm import Int8GemmLinear

    skip_without_int8_gemm()
    exact = greedy(LLM(str(tiny_llama), dtype="float32", quantization="int8", max_model_len=256,
                       kv_cache_space=0.05), prompts, 4)
    llm = LLM(str(tiny_llama), dtype="bfloat16", quantization="int8", max_model_len=256, kv_cache_space=0.05,
              enable_prefix_caching=True, max_num_batched_tokens=32, max_num_seqs=4)
    layers = [m for m in llm.engine.backend.runner.model.modules() if isinstance(m, Int8GemmLinear)]
    assert len(layers) == 9 and not quantized_layers(llm)  # the head too
    fast = greedy(llm, prompts, 4)
    assert sum(a[0] == b[0] for a, b in zip(exact, fast)) >= len(prompts) - 1


def test_gguf_quantization_needs_a_gguf_file(tiny_llama):
    with pytest.raises(ConfigError, match="q8_0, q4_0 or int8"):
        LLM(str(tiny_llama), quantization="gguf", max_model_len=256, kv_cache_space=0.05)
