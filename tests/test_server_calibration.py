"""labsupport.server_calibration's prediction (lab 15, section 8): the highest rate that fits, and no
higher. (calibrate itself needs a running server: the solution notebook of lab 15 runs it.)"""

from __future__ import annotations

import pytest

from labsupport import costs
from labsupport.serve.engine import course_model_config
from labsupport.server_calibration import ServerCalibration, calibrate, predicted_rate
from labsupport.tokenizer import course_tokenizer

CFG = course_model_config(course_tokenizer().vocab_size)
MEMORY = costs.param_count(CFG) * 4 + 1100 * 16 * costs.kv_bytes_per_token(CFG, 4)


def calibration(admission_s=0.05, overhead_s=0.005, per_sequence_s=0.0004):
    return ServerCalibration(batches=(1, 4), step_s=(overhead_s + per_sequence_s, overhead_s + 4 * per_sequence_s),
                             overhead_s=overhead_s, per_sequence_s=per_sequence_s, compute_efficiency=0.5,
                             admission_s=admission_s, context_tokens=36, copy_bandwidth=5e9, matmul_rate=5e9)


def test_the_predicted_rate_is_the_highest_that_fits():
    cal, target = calibration(), 3 * (0.005 + 0.0004)
    rate = predicted_rate(cal, CFG, target, 12, memory_bytes=MEMORY)
    assert 0 < rate < 1 / cal.admission_s  # admissions alone cannot take the whole server
    finer = [r / 20 for r in range(1, 400)]
    fine = predicted_rate(cal, CFG, target, 12, memory_bytes=MEMORY, rates=finer)
    assert rate <= fine < rate + 0.5  # the default grid is in halves
    # a looser target or cheaper admissions sustain more; a target below one step sustains nothing
    assert predicted_rate(cal, CFG, 2 * target, 12, memory_bytes=MEMORY) > rate
    assert predicted_rate(calibration(admission_s=0.01), CFG, target, 12, memory_bytes=MEMORY) > rate
    assert predicted_rate(cal, CFG, 0.004, 12, memory_bytes=MEMORY) == 0.0


def test_calibrate_needs_batch_one_and_another():
    with pytest.raises(ValueError, match="batch 1 and at least one other"):
        calibrate("http://127.0.0.1:9", "m", CFG, copy_bandwidth=1e9, matmul_rate=1e9, batches=(2, 4))
    with pytest.raises(ValueError, match="batch 1 and at least one other"):
        calibrate("http://127.0.0.1:9", "m", CFG, copy_bandwidth=1e9, matmul_rate=1e9, batches=(1, 1))
