"""The one adapter over OpenVINO's private SDPA -> PagedAttention transformation.

openvino 2026.4 exposes this pass to Python only as ``openvino._offline_transformations``
(the module vLLM's OpenVINO backend used too). Its keyword arguments have grown from release to
release, so it is called with keywords only; every optional input and output stays off, which gives
the inputs ``execute`` fills: input_ids, position_ids, past_lens, subsequence_begins,
block_indices, block_indices_begins, max_context_len and key_cache.N / value_cache.N.
"""

from __future__ import annotations

from pagedllm.errors import ConfigError


def to_paged_attention(model) -> None:
    """Rewrite the stateful model's SDPA into PagedAttentionExtension nodes, in place."""
    from openvino._offline_transformations import paged_attention_transformation

    try:
        paged_attention_transformation(
            model, use_block_indices_inputs=False, use_score_outputs=False, allow_score_aggregation=False,
            allow_cache_rotation=False, allow_xattention=False, allow_adaptive_rkv=False, allow_qq_bias=False)
    except RuntimeError as exc:
        if "stateful" in str(exc):
            raise ConfigError(
                "the OpenVINO model is stateless; paged attention needs a stateful export. Export it again with "
                "`optimum-cli export openvino --task text-generation-with-past` (without --disable-stateful), "
                "or pass the Hugging Face folder and let pagedllm export it") from exc
        raise
