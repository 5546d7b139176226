"""labsupport.gguf_blocks: the Q8_0 / Q4_1 readers and the tensor table, against the gguf package."""

import gguf
import numpy as np
import pytest
import torch

from labsupport import gguf_blocks as GB

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A small GGUF file written by the gguf package: metadata of every shape the table must skip
    (strings, a string array, a float array, an alignment), one tensor of each type."""
    rng = np.random.default_rng(0)
    weights = {"a.q8": (rng.standard_normal((4, 64)) * 0.1).astype(np.float32),
               "b.q4": (rng.standard_normal((3, 96)) * 0.3 + 0.05).astype(np.float32),
               "c.f32": rng.standard_normal((2, 5)).astype(np.float32)}
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "<|im_end|>", "ü"] * 50)
    writer.add_array("tokenizer.ggml.scores", [0.5] * 200)
    writer.add_uint32("general.alignment", 64)
    writer.add_tensor("a.q8", gguf.quants.quantize(weights["a.q8"], Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.add_tensor("b.q4", gguf.quants.quantize(weights["b.q4"], Q.Q4_1), raw_dtype=Q.Q4_1)
    writer.add_tensor("c.f32", weights["c.f32"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, weights


def test_table_and_rows_equal_the_gguf_reader(tiny_gguf):
    path, weights = tiny_gguf
    reader = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    table = GB.tensor_table(path)
    assert list(table) == ["a.q8", "b.q4", "c.f32"]
    for name, entry in table.items():
        assert entry.type_name == reader[name].tensor_type.name
        assert list(entry.dims) == [int(d) for d in reader[name].shape]
        assert entry.rows == weights[name].shape[0]
    for name in ("a.q8", "b.q4"):
        rows = list(range(weights[name].shape[0]))[::-1]
        raw, kind = GB.gguf_rows(path, name, rows)
        assert np.array_equal(raw.numpy(), np.asarray(reader[name].data)[rows]), name
        assert kind == table[name].type_name


@pytest.mark.parametrize("name, fn, levels", [("a.q8", GB.dequantize_q8_0, 254), ("b.q4", GB.dequantize_q4_1, 15)])
def test_dequantisers_equal_gguf_and_recover_the_weights(tiny_gguf, name, fn, levels):
    path, weights = tiny_gguf
    raw, kind = GB.gguf_rows(path, name, range(weights[name].shape[0]))
    got = fn(raw)
    assert got.dtype == torch.float32 and got.shape == weights[name].shape
    assert torch.equal(got, GB.reference_dequantize(raw, kind))
    w = torch.from_numpy(weights[name])
    step = float(w.max() - w.min()) / levels  # no block's grid step is coarser than this
    assert 0 < float((got - w).abs().max()) <= step / 2 + 1e-6  # rounded to the grid, not garbage


def test_q4_1_nibble_order_and_minimum():
    # one block: d = 1, m = -8, byte j = (15 - j) << 4 | j: weight j = j - 8, weight j + 16 = 7 - j
    d_m = torch.tensor([1.0, -8.0], dtype=torch.float16).view(torch.uint8)
    qs = torch.tensor([(15 - j) << 4 | j for j in range(16)], dtype=torch.uint8)
    got = GB.dequantize_q4_1(torch.cat([d_m, qs])[None])
    want = [j - 8.0 for j in range(16)] + [7.0 - j for j in range(16)]
    assert got[0].tolist() == want


def test_bad_input_is_named(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    with pytest.raises(ValueError, match="2-D uint8"):
        GB.dequantize_q8_0(torch.zeros(34, dtype=torch.int8))
    with pytest.raises(ValueError, match="whole number of 20-byte blocks"):
        GB.dequantize_q4_1(torch.zeros(1, 30, dtype=torch.uint8))
    with pytest.raises(ValueError, match="no tensor 'nope'"):
        GB.gguf_rows(path, "nope", [0])
    with pytest.raises(ValueError, match="out of range"):
        GB.gguf_rows(path, "a.q8", [4])
    other = tmp_path / "not.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GB.tensor_table(other)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:300])
    with pytest.raises(ValueError, match="truncated"):
        GB.tensor_table(cut)
