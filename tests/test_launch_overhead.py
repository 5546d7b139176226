"""The decode-step profile: shares that add up, a fixed operator count, labelled by device."""

from __future__ import annotations

import pytest

from labsupport.launch_overhead import profile_decode_step
from labsupport.models import get_model
from labsupport.phases import cpu_threads
from labsupport.transformer import Transformer


def test_profile_of_a_decode_step():
    model = Transformer(get_model("tiny-2m"), seed=0)
    with cpu_threads(1):
        a = profile_decode_step(model, context=16, steps=5)
        b = profile_decode_step(model, context=8, steps=4, warmup=0)
    assert a["device"] == "cpu" and a["device_type"] == "cpu"
    assert 0 < a["op_share"] <= 1 and a["python_share"] == pytest.approx(1 - a["op_share"])
    assert a["step_s"] > 0 and a["profiled_step_s"] > 0
    # the same operators run whatever the context: one count per layer's work, plus the head
    assert a["ops_per_step"] == b["ops_per_step"] >= 10 * model.cfg.n_layers


def test_bad_input():
    with pytest.raises(ValueError, match="Transformer"):
        profile_decode_step("tiny-2m")
    with pytest.raises(ValueError, match="steps"):
        profile_decode_step(Transformer(get_model("tiny-2m")), steps=0)
