"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) made from float weights, which the ``gguf`` package cannot make (it only
reads them) and llama.cpp's quantizer takes minutes to build: a plain min/max quantizer, laid out as ``gguf``'s
dequantize reads them, so that a test can write a real model's tensors as K-quants."""

import numpy as np

SUPER = 256  # inputs per K-quant super-block


def quantize(weight: np.ndarray, type_name: str) -> np.ndarray:
    """``weight`` [rows, in] (in a multiple of 256) as the raw bytes of GGUF's ``type_name`` blocks, [rows, bytes]."""
    rows = weight.shape[0]
    blocks = weight.astype(np.float32).reshape(-1, SUPER)
    packed = _q6_k(blocks) if type_name == "Q6_K" else _q4_k_or_q5_k(blocks, 5 if type_name == "Q5_K" else 4)
    return packed.reshape(rows, -1)


def _half(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float16 super-block multipliers (1 where a block is all zero), as bytes and as the float32 they stand for."""
    half = np.where(values > 0, values, 1).astype(np.float16)
    return half.reshape(-1, 1).view(np.uint8), half.astype(np.float32)[:, None]


def _q4_k_or_q5_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    """Per 32 inputs a 6-bit step and a 6-bit minimum, times the super-block's d and dmin."""
    levels = 2**bits - 1
    sub = blocks.reshape(-1, 8, 32)
    low, high = np.minimum(sub.min(-1), 0), sub.max(-1)
    d_bytes, d = _half((high - low).max(-1) / levels / 63)
    dmin_bytes, dmin = _half(-low.min(-1) / 63)
    sc = np.clip(np.round((high - low) / levels / d), 0, 63).astype(np.uint8)
    mins = np.clip(np.round(-low / dmin), 0, 63).astype(np.uint8)
    step, offset = (d * sc)[..., None], (dmin * mins)[..., None]
    q = np.clip(np.round((sub + offset) / np.where(step > 0, step, 1)), 0, levels).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, mins[:, :4] | (mins[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 0xF) | (mins[:, 4:] & 0xF) << 4], axis=1)
    nibbles = ((q[:, 0::2] & 0xF) | (q[:, 1::2] & 0xF) << 4).reshape(-1, 128)
    parts = [d_bytes, dmin_bytes, scales]
    if bits == 5:  # bit 4 of sub-block i's value l is bit i of byte l
        parts.append(((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8))
    return np.concatenate(parts + [nibbles], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Per 16 inputs a signed 8-bit step times the super-block's d; values -32..31."""
    sub = blocks.reshape(-1, 16, 16)
    step = np.abs(sub).max(-1) / 31
    d_bytes, d = _half(step.max(-1) / 127)
    sc = np.clip(np.round(step / d), 0, 127).astype(np.int8)
    effective = (d * sc)[..., None]
    u = (np.clip(np.round(sub / np.where(effective > 0, effective, 1)), -32, 31) + 32).astype(np.uint8)
    u = u.reshape(-1, 256)
    low, high = (u & 0xF).reshape(-1, 2, 2, 64), (u >> 4).reshape(-1, 2, 4, 32)
    ql = (low[:, :, 0] | low[:, :, 1] << 4).reshape(-1, 128)
    qh = (high << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2, dtype=np.uint8).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=1)
