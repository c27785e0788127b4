"""pagedllm's GGUF reader against gguf's own GGUFReader: the same metadata and the same tensor views, read in a
fraction of the time; a damaged file refused by name."""

import struct

import gguf
import numpy as np
import pytest

from pagedllm.errors import ModelNotFoundError, UnsupportedModelError
from pagedllm.models.gguf_file import open_gguf


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A GGUF file with every metadata kind and float, integer and quantized tensors, written by gguf's writer."""
    path = tmp_path_factory.mktemp("gguf") / "every-kind.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("k.u8", 7)
    writer.add_int32("k.i32", -5)
    writer.add_uint64("k.u64", 1 << 40)
    writer.add_float32("k.f32", 0.5)
    writer.add_float64("k.f64", 1e-300)
    writer.add_bool("k.bool", True)
    writer.add_string("k.text", "héllo ✓")
    writer.add_array("k.ints", [1, 2, 3])
    writer.add_array("k.floats", [0.25, -1.5])
    writer.add_array("tokenizer.ggml.tokens", ["a", "", "Ġthe", "日本"])
    writer.add_array("k.nested", [["x", "y"], ["z"]])
    rng = np.random.default_rng(0)
    writer.add_tensor("dense.weight", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("half.weight", rng.standard_normal((2, 8)).astype(np.float16))
    writer.add_tensor("ids", np.arange(6, dtype=np.int32))
    q4 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
    writer.add_tensor("quant.weight", q4, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_and_tensors_equal_ggufs_reader(written):
    ours, theirs = open_gguf(written), gguf.GGUFReader(str(written))
    expected = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert expected.pop("k.nested") == ["x", "y", "z"]  # gguf's reader flattens arrays of arrays; they stay nested
    assert ours.fields.pop("k.nested") == [["x", "y"], ["z"]]
    assert ours.fields == expected and ours.fields["k.text"] == "héllo ✓"
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert (mine.tensor_type, mine.shape, mine.n_bytes, mine.data_offset) == \
            (reference.tensor_type, tuple(reference.shape.tolist()), reference.n_bytes, reference.data_offset)
        assert mine.data.dtype == reference.data.dtype and not mine.data.flags.writeable
        np.testing.assert_array_equal(mine.data, reference.data)


def test_skipped_keys_are_stepped_over(written):
    contents = open_gguf(written, skip_prefixes=("tokenizer.",))
    assert "tokenizer.ggml.tokens" not in contents.fields and contents.fields["k.nested"] == [["x", "y"], ["z"]]
    assert [t.name for t in contents.tensors] == ["dense.weight", "half.weight", "ids", "quant.weight"]


@pytest.mark.parametrize("keep", [3, 40, 520, None], ids=["magic", "metadata", "tensor-index", "last-tensor"])
def test_a_file_cut_anywhere_is_refused_naming_it(written, tmp_path, keep):
    if keep is None:
        last = open_gguf(written).tensors[-1]
        keep = last.data_offset + last.n_bytes - 1
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(written.read_bytes()[:keep])
    with pytest.raises(ModelNotFoundError, match="damaged.gguf is truncated"):
        open_gguf(damaged)


def test_a_tensor_type_gguf_does_not_know_asks_for_a_newer_gguf(tmp_path):
    header = struct.pack("<4sIQQ", b"GGUF", 3, 1, 0)  # one tensor, no metadata
    info = struct.pack("<Q1sIQIQ", 1, b"t", 1, 32, 9999, 0)  # name "t", one dimension of 32, type 9999, offset 0
    path = tmp_path / "future.gguf"
    path.write_bytes(header + info + bytes(-len(header + info) % 32) + bytes(64))
    with pytest.raises(UnsupportedModelError, match="tensor t has GGML type 9999.*upgrade"):
        open_gguf(path)
