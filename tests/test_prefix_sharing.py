"""labsupport.prefix_sharing: what a replay of chats finds in the prefix cache."""

import pytest

from labsupport.prefix_sharing import Request, first_difference, hit_rate, replay

SYSTEM = list(range(1000, 1040))  # 40 shared tokens: two whole blocks of 16


def test_shared_system_prompt_hits_whole_blocks_only():
    a = Request(tuple(SYSTEM + [1, 2, 3]), (7, 8, 99), 0, 0)
    b = Request(tuple(SYSTEM + [4, 5]), (9, 99), 1, 0)
    out = replay([a, b], 16)
    assert [r.cached_tokens for r in out] == [0, 32]
    assert hit_rate(out) == pytest.approx(32 / (43 + 42))


def test_next_turn_reuses_the_answer_but_not_its_last_token():
    first = list(range(30))
    answer = list(range(100, 110))  # ends with an end-of-turn id, sampled but never run
    follow = first + answer + [200, 201, 202]  # the template renders the answer back exactly
    out = replay([Request(tuple(first), tuple(answer)), Request(tuple(follow), (), 0, 1)], 8)
    computed = 30 + 9  # prompt + answer but its last token
    assert out[1].cached_tokens == computed // 8 * 8
    changed = first + [555] + answer[1:] + [200]  # an answer re-rendered differently: reuse stops there
    out = replay([Request(tuple(first), tuple(answer)), Request(tuple(changed), (), 0, 1)], 8)
    assert out[1].cached_tokens == 24


def test_an_identical_prompt_still_computes_its_last_token():
    p = tuple(range(32))
    out = replay([Request(p), Request(p)], 16)
    assert out[1].cached_tokens == 16  # not 32: the last prompt token's logits are needed


def test_first_difference_and_errors():
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2 and first_difference([1, 2], [1, 2, 3]) == 2
    with pytest.raises(ValueError, match="empty prompt"):
        replay([Request(())], 16)
