"""A Gather before the LM head, so the model computes logits only for the rows the core samples.

Without it the paged model returns logits for every scheduled token ([T, 1, vocab]); a long prefill
would then pay T x vocab in the LM head for one sampled row.
"""

from __future__ import annotations

SAMPLED_INDICES = "sampled_tokens_indices"


def gather_before_lm_head(model) -> None:
    """Add an i64 input ``sampled_tokens_indices`` [S]; the ``logits`` output becomes [S, 1, vocab]."""
    import openvino as ov
    import openvino.opset13 as ops

    lm_head = _lm_head_matmul(model)
    # The activations are the operand whose token dimension is dynamic; the weights are static.
    port = next(p for p in lm_head.inputs() if p.get_partial_shape()[0].is_dynamic)
    indices = ops.parameter(ov.PartialShape([-1]), ov.Type.i64, name=SAMPLED_INDICES)
    indices.output(0).get_tensor().set_names({SAMPLED_INDICES})
    gathered = ops.gather(port.get_source_output(), indices, ops.constant(0, ov.Type.i64))
    port.replace_source_output(gathered.output(0))
    model.add_parameters([indices])
    model.validate_nodes_and_infer_types()


def _lm_head_matmul(model):
    """The MatMul that produces ``logits``, past any element-wise ops after it (scaling, soft-capping)."""
    from pagedllm.errors import UnsupportedModelError

    node = model.output("logits").get_node().input_value(0).get_node()
    while node.get_type_name() != "MatMul":
        if node.get_input_size() == 0:
            raise UnsupportedModelError("no MatMul (LM head) found before the model's logits output")
        node = node.input_value(0).get_node()
    return node
