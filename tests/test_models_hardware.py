import pytest

from labsupport.hardware import GPUS, get_gpu, match_device_name
from labsupport.models import ModelConfig, get_model, list_models


def test_llama_shapes():
    m = get_model("Llama-3.1-8B")
    assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.group_size) == (32, 4096, 32, 8, 128, 4)
    assert get_model("llama-3.1-70b").head_dim == 128
    assert get_model("llama-3.1-405b").n_layers == 126
    assert {"llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b"} <= set(list_models())


def test_unknown_model_lists_the_accepted_names():
    with pytest.raises(ValueError, match="unknown model 'gpt-5'.*llama-3.1-8b"):
        get_model("gpt-5")
    with pytest.raises(ValueError, match="string"):
        get_model(8)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"n_layers": 0}, "n_layers"),
        ({"d_model": 66}, "divisible by n_heads"),
        ({"n_kv_heads": 3}, "multiple of n_kv_heads"),
        ({"vocab_size": -1}, "vocab_size"),
    ],
)
def test_model_config_validates(kwargs, match):
    base = dict(name="x", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=100)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ModelConfig(**base)


def test_gpu_table_has_the_required_rows_with_sources():
    for name in ("H100 SXM", "H200", "A100 40GB", "A100 80GB", "L4", "T4"):
        gpu = get_gpu(name)
        assert gpu.peak_flops > 1e13 and gpu.hbm_bandwidth > 1e11 and gpu.memory_bytes > 1e10
        assert gpu.source
    assert round(get_gpu("h100").ridge_point) == 295
    assert round(get_gpu("A100 40GB").ridge_point) == 201
    assert get_gpu("a100-40gb") is GPUS["A100 40GB"]
    four = get_gpu("A100 40GB").times(4)
    assert four.peak_flops == 4 * 312e12 and four.ridge_point == pytest.approx(get_gpu("A100 40GB").ridge_point)


def test_unknown_gpu_and_bad_count():
    with pytest.raises(ValueError, match="unknown GPU 'B300'.*H100 SXM"):
        get_gpu("B300")
    with pytest.raises(ValueError, match="count"):
        get_gpu("H100").times(0)


@pytest.mark.parametrize(
    "device_name,row",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
        ("NVIDIA L4", "L4"),
        ("Tesla T4", "T4"),
    ],
)
def test_match_device_name(device_name, row):
    assert match_device_name(device_name).name == row


@pytest.mark.parametrize(
    "device_name",
    [
        "NVIDIA GeForce RTX 4090",
        "NVIDIA H100 PCIe",  # 2.0 TB/s, not the SXM row's 3.35
        "NVIDIA H100 NVL",
        "NVIDIA H200 NVL",
        "NVIDIA GH200 480GB",
        "NVIDIA A100 80GB PCIe",  # 1.94 TB/s, not the SXM row's 2.04
        "NVIDIA L40S",  # not an L4
        "NVIDIA L40",
    ],
)
def test_match_device_name_gives_no_wrong_datasheet(device_name):
    assert match_device_name(device_name) is None


def test_a100_40gb_pcie_shares_the_40gb_row():
    assert match_device_name("NVIDIA A100-PCIE-40GB").name == "A100 40GB"


def test_reported_memory_is_what_the_cards_really_hold():
    """The datasheet labels are rounded: every card reports more bytes than '80GB' in decimal,
    except those whose label is already in binary units (A100s), and the H200 holds 150.8e9."""
    h100, h200 = get_gpu("H100 SXM"), get_gpu("H200")
    assert h100.usable_bytes == 81_559 * 2**20 and round(h100.usable_bytes / 1e9, 1) == 85.5
    assert round(h200.usable_bytes / 1e9, 1) == 150.8 and h200.usable_bytes > 141.11e9  # the 70B's weights fit
    assert h100.times(4).usable_bytes == 4 * h100.usable_bytes
    for gpu in GPUS.values():
        assert 0.9 < gpu.usable_bytes / gpu.memory_bytes < 1.1, gpu.name


def test_swiglu_widths_are_what_models_py_says():
    from labsupport.models import get_model

    ratios = {name: get_model(name).d_ff / get_model(name).d_model for name in
              ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "tiny-2m", "tiny-20m", "small-63m")}
    assert ratios["llama-3.1-8b"] == ratios["llama-3.1-70b"] == 3.5
    assert ratios["llama-3.1-405b"] == 3.25
    assert ratios["tiny-2m"] == ratios["small-63m"] == 3.5
    assert ratios["tiny-20m"] == pytest.approx(8 / 3)


def test_memory_capacities_are_binary():
    from labsupport.hardware import GPUS

    for name, label in (("H100 SXM", 80), ("H200", 141), ("A100 40GB", 40), ("A100 80GB", 80), ("L4", 24), ("T4", 16)):
        assert GPUS[name].memory_bytes == label * 2**30, name
    # an A100 80GB reports exactly its 80 GiB; an H100 a little less than its label
    assert GPUS["A100 80GB"].reported_bytes == GPUS["A100 80GB"].memory_bytes
    assert GPUS["H100 SXM"].reported_bytes < GPUS["H100 SXM"].memory_bytes


def test_fp8_peaks_and_host_links_agree_with_the_datasheets():
    from labsupport.published import H100_FP8_DENSE_FLOPS, PCIE_GEN5_X16_BYTES_PER_S

    for name in ("H100 SXM", "H200"):  # Hopper: dense FP8 twice dense bf16
        gpu = get_gpu(name)
        assert gpu.fp8_peak_flops == H100_FP8_DENSE_FLOPS.value
        assert gpu.fp8_peak_flops == pytest.approx(2 * gpu.peak_flops, rel=1e-3)
        assert gpu.host_link_bandwidth == PCIE_GEN5_X16_BYTES_PER_S.value / 2  # one direction
    assert get_gpu("L4").fp8_peak_flops == pytest.approx(2 * get_gpu("L4").peak_flops, rel=1e-2)
    assert get_gpu("A100 80GB").fp8_peak_flops == get_gpu("T4").fp8_peak_flops == 0  # no FP8 tensor cores
    assert all(g.host_link_bandwidth > 0 for g in GPUS.values())
    assert get_gpu("H200").times(2).fp8_peak_flops == 2 * get_gpu("H200").fp8_peak_flops
