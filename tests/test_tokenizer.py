"""Byte-level BPE (labsupport.tokenizer): training, encoding, decoding, files, streaming, errors."""

import codecs
import itertools
import json
import random
import time
from collections import Counter

import pytest

from labsupport import tokenizer as T
from labsupport.tokenizer import (
    COURSE_VOCAB_SIZE,
    END_OF_TEXT,
    BPETokenizer,
    IncrementalDetokenizer,
    bpe_merges,
    compression_by_kind,
    course_corpus,
    course_passages,
    course_tokenizer,
    merge_pair,
    pretokenize,
    train_bpe,
    utf8_incomplete_tail,
    vocab_costs,
)

# Characters from many scripts: ASCII, accents (precomposed and combining), Cyrillic, Greek, Arabic,
# Devanagari, CJK, Hangul, emoji with skin tones, ZWJ sequences and variation selectors, controls.
ALPHABET = (
    list("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 _-.,;:!?'\"()[]{}<>|/\\\n\t\r")
    + list("éèçñüßøåÉ") + ["e\u0301", "a\u0308", "\u0301"]
    + list("жщыЖЯαβγΩάمرحباहिन्दी東京語中文ひらがなカタカナ한국어")
    + ["😀", "👍🏽", "👨\u200d👩\u200d👧", "❤️", "🇫🇷", "\x00", "\x7f", "\u2028", "\ufeff", "\U0010ffff", "<|endoftext|>"]
)


def random_text(rng, n):
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def naive_merges(text, vocab_size):
    """Recount every pair inside every chunk at every step: slow and obviously right."""
    words = [list(chunk.encode()) for chunk in pretokenize(text)]
    merges = []
    while len(merges) < vocab_size - 256:
        counts = Counter(p for w in words for p in zip(w, w[1:]))
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        merges.append(pair)
        words = [merge_pair(w, pair, 255 + len(merges)) for w in words]
    return merges


@pytest.fixture(scope="module")
def small():
    return train_bpe("the cat sat on the mat; the hat, the bat. " * 3 + "naïve café 東京 😀😀", 300)


# -- pre-tokenisation -------------------------------------------------------------------------------

def test_pretokenize_examples():
    assert pretokenize("Hello, world!") == ["Hello", ",", " world", "!"]
    assert pretokenize("It's 12345 cafe\u0301s  x") == ["It", "'s", " 123", "45", " cafe\u0301s", " ", " x"]
    assert pretokenize("हिन्दी ❤️ a_b") == ["हिन्दी", " ❤️", " a", "_", "b"]  # marks stay with their letters


def test_pretokenize_loses_nothing():
    rng = random.Random(0)
    for _ in range(200):
        text = random_text(rng, rng.randint(0, 40))
        assert "".join(pretokenize(text)) == text


# -- training -----------------------------------------------------------------------------------------

def test_merge_pair_left_to_right_without_overlap():
    assert merge_pair([97, 97, 97], (97, 97), 256) == [256, 97]
    assert merge_pair([97, 97, 97, 97], (97, 97), 256) == [256, 256]
    assert merge_pair([1, 2, 3, 1, 2], (1, 2), 300) == [300, 3, 300]


def test_ties_go_to_the_smallest_pair():
    # one occurrence of each pair: (97, 98) 'ab' is smaller than (122, 121) 'zy', though seen later
    assert bpe_merges("zy,ab", 257) == [(97, 98)]
    # same first id: the second decides
    assert bpe_merges("ac,ab", 257) == [(97, 98)]
    # a higher count beats a smaller pair
    assert bpe_merges("zz,zz,ab", 257) == [(122, 122)]


def test_merges_stay_inside_chunks():
    # across the whole text ", " occurs 3 times; inside chunks the best pair is " x" (twice)
    assert bpe_merges("x, x, x, y", 257) == [(32, 120)]


def test_incremental_training_matches_the_naive_loop():
    rng = random.Random(1)
    for size in (0, 1, 5, 60, 300):
        text = random_text(rng, size)
        assert bpe_merges(text, 256 + 40) == naive_merges(text, 256 + 40), text
    text = course_passages()["french"]
    assert bpe_merges(text, 400) == naive_merges(text, 400)


def test_training_stops_when_no_pair_is_left():
    tok = train_bpe("aaaa", 1000)
    assert tok.merges == [(97, 97), (256, 256)]
    assert tok.vocab_size == 256 + 2 + 1
    assert tok.encode("aaaa") == [257]
    assert tok.special_tokens == {END_OF_TEXT: 258}


def test_vocab_size_counts_bytes_merges_and_special_tokens():
    tok = train_bpe(course_passages()["german"], 300)
    assert tok.vocab_size == len(tok) == 300
    assert len(tok.merges) == 300 - 256 - 1
    assert tok.end_of_text_id == 299
    assert train_bpe("abc", 256, special_tokens=()).vocab_size == 256


def test_training_is_fast():
    text = course_corpus()
    start = time.perf_counter()
    tok = train_bpe(text, 2048)
    elapsed = time.perf_counter() - start
    assert tok.vocab_size == 2048
    assert elapsed < 20, f"training took {elapsed:.1f} s"  # about 0.3 s on the course's CI machine


# -- encoding and decoding --------------------------------------------------------------------------

def test_any_string_round_trips(small):
    rng = random.Random(2)
    for tok in (small, course_tokenizer()):
        for _ in range(300):
            text = random_text(rng, rng.randint(0, 30))
            ids = tok.encode(text)
            assert all(0 <= i < tok.vocab_size for i in ids)
            assert tok.decode(ids) == text
        assert tok.decode(tok.encode(course_corpus())) == course_corpus()
        assert tok.encode("") == [] and tok.decode([]) == ""


def test_encode_reproduces_training():
    text = "low lower lowest newer newest wider " * 5
    tok = train_bpe(text, 280, special_tokens=())
    words = [list(c.encode()) for c in pretokenize(text)]
    for k, pair in enumerate(tok.merges):
        words = [merge_pair(w, pair, 256 + k) for w in words]
    assert tok.encode(text) == [i for w in words for i in w]


def test_course_tokenizer_compresses_and_is_deterministic():
    tok = course_tokenizer()
    assert tok.vocab_size == COURSE_VOCAB_SIZE
    text = course_passages()["english"]
    assert len(text) / len(tok.encode(text)) > 2.5
    # the committed file is what training on the shipped corpus gives
    assert train_bpe(course_corpus(), COURSE_VOCAB_SIZE).merges == tok.merges


def test_decode_replaces_invalid_bytes_and_never_drops_them(small):
    assert small.decode([0xE2, 0x82]) == "\ufffd"  # a character cut short
    assert small.decode([0xFF, ord("A")]) == "\ufffdA"
    assert small.decode([0xE2, 0x82, 0xAC]) == "€"
    assert small.decode([0x80, 0x80]) == "\ufffd\ufffd"


def test_special_tokens_are_text_unless_allowed(small):
    eot = small.end_of_text_id
    text = f"a{END_OF_TEXT}b"
    assert eot not in small.encode(text)
    assert small.decode(small.encode(text)) == text
    ids = small.encode(text, allowed_special="all")
    assert ids.count(eot) == 1 and small.decode(ids) == text
    assert small.encode(text, allowed_special={END_OF_TEXT}) == ids
    with pytest.raises(ValueError, match="not special tokens"):
        small.encode(text, allowed_special={"<|im_start|>"})


# -- files ------------------------------------------------------------------------------------------

def test_save_and_load(tmp_path, small):
    path = small.save(tmp_path / "tok.json")
    data = json.loads(path.read_text())
    assert data["vocab_size"] == small.vocab_size and data["special_tokens"] == {END_OF_TEXT: small.end_of_text_id}
    again = BPETokenizer.load(path)
    assert again.merges == small.merges and again.special_tokens == small.special_tokens
    assert again.encode("the cat 東京") == small.encode("the cat 東京")


def test_bad_files_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer file"):
        BPETokenizer.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        BPETokenizer.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"model": {}}')
    with pytest.raises(ValueError, match="not a labsupport BPE tokenizer"):
        BPETokenizer.load(tmp_path / "other.json")
    with pytest.raises(ValueError, match="may only join ids made before it"):
        BPETokenizer([(97, 98), (300, 97)])
    with pytest.raises(ValueError, match="right after the merges"):
        BPETokenizer([(97, 98)], {END_OF_TEXT: 300})


# -- errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda tok: tok.encode("ok \ud800 no"),
    lambda tok: train_bpe("ok \udcff", 300),
    lambda tok: pretokenize("\ud83d"),
])
def test_lone_surrogates_are_value_errors(small, call):
    with pytest.raises(ValueError, match=r"lone surrogate U\+D[89ABCDEF][0-9A-F]{2} at index \d+.*clean the text"):
        call(small)


def test_vocab_size_errors():
    with pytest.raises(ValueError, match="below 256.*at least 257"):
        train_bpe("abc", 255)
    with pytest.raises(ValueError, match="no room for the 1 special token"):
        train_bpe("abc", 256)
    with pytest.raises(ValueError, match="whole number"):
        train_bpe("abc", 300.5)


def test_ids_outside_the_vocabulary_are_value_errors(small):
    for bad in (small.vocab_size, -1, 10**9):
        with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary \(ids 0 to {small.vocab_size - 1}\)"):
            small.decode([97, bad])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            IncrementalDetokenizer(small).push(bad)
    with pytest.raises(ValueError, match="not a whole number"):
        small.decode([1.5])
    with pytest.raises(ValueError, match="is a bool"):
        small.decode([True])


# -- streaming -----------------------------------------------------------------------------------------

def test_a_character_split_across_tokens_waits_for_its_last_byte(small):
    detok = IncrementalDetokenizer(small)
    euro = "€".encode()  # three bytes, pushed as three byte tokens
    assert [detok.push(b) for b in euro] == ["", "", "€"]
    emoji = "😀".encode()
    assert [detok.push(b) for b in b"a" + emoji[:2]] == ["a", "", ""]
    assert detok.pending_bytes == emoji[:2]
    assert [detok.push(b) for b in emoji[2:]] == ["", "😀"]
    assert detok.flush() == ""


def test_flush_returns_the_tail(small):
    detok = IncrementalDetokenizer(small)
    assert detok.push(0xE2) == "" and detok.push(0x82) == ""
    assert detok.flush() == "\ufffd"  # a truncated character is replaced, not lost
    assert detok.flush() == ""


def test_pieces_join_to_decode_and_are_never_broken():
    rng = random.Random(3)
    tok = course_tokenizer()
    for trial in range(300):
        if trial % 2:
            ids = tok.encode(random_text(rng, rng.randint(1, 25)))
        else:  # any ids at all, raw bytes included: invalid UTF-8 must stream like decode
            ids = [rng.choice([rng.randrange(256), rng.randrange(tok.vocab_size)]) for _ in range(rng.randint(1, 12))]
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.push(i) for i in ids] + [detok.flush()]
        assert "".join(pieces) == tok.decode(ids)
        if "\ufffd" not in tok.decode(ids):
            assert all("\ufffd" not in p for p in pieces)


def _completes(prefix):
    """Whether some continuation bytes turn ``prefix`` into exactly one valid character."""
    fills = (0x80, 0x90, 0xA0, 0xBF)
    for k in (1, 2, 3):
        for extra in itertools.product(fills, repeat=k):
            try:
                text = (prefix + bytes(extra)).decode("utf-8")
            except UnicodeDecodeError:
                continue
            if len(text) == 1:
                return True
    return False


def test_incomplete_tail_holds_exactly_the_bytes_that_can_still_become_a_character():
    rng = random.Random(4)
    interesting = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1,
                   0xEC, 0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFF]
    for _ in range(3000):
        data = bytes(rng.choice(interesting) for _ in range(rng.randint(0, 6)))
        tail = utf8_incomplete_tail(data)
        if tail:
            assert _completes(data[-tail:]), data
        for k in range(tail + 1, min(3, len(data)) + 1):  # nothing longer could still complete
            assert not _completes(data[-k:]), data
        # Python's incremental decoder never emits what we hold (it may hold a little more, as for ED BF)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decoder.decode(data, final=False)
        assert tail <= len(decoder.getstate()[0]), data


def test_module_names_its_pattern():
    assert "{MARK}" in T.PRETOKENIZE_PATTERN
    assert T.course_passages().keys() == set(T.PASSAGE_KINDS)


# -- what tokens cost -----------------------------------------------------------------------------------

def test_vocab_costs_on_the_8b_shape():
    from labsupport.costs import param_count
    from labsupport.models import get_model

    m8 = get_model("llama-3.1-8b")
    big = vocab_costs(m8)
    assert big.vocab_size == 128_256 and big.output_params == 4096 * 128_256 == big.embedding_params
    assert big.output_bytes == 2 * big.output_params and big.output_flops_per_token == 2 * 4096 * 128_256
    assert big.model_params == param_count(m8) == 8_030_261_248
    small = vocab_costs(m8, 32_000, weight_dtype_bytes=1)
    assert small.model_params == param_count(m8) - 2 * 4096 * (128_256 - 32_000)
    assert small.output_bytes == 4096 * 32_000
    assert small.output_share == pytest.approx(4096 * 32_000 / small.model_params)
    assert small.vocab_share == pytest.approx(2 * small.output_share)
    tied = vocab_costs("tiny-2m")
    assert tied.embedding_params == 0 and tied.vocab_share == tied.output_share
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_costs(m8, 0)
    with pytest.raises(ValueError, match="weight_dtype_bytes"):
        vocab_costs(m8, 1000, weight_dtype_bytes=0)


def test_compression_by_kind():
    out = compression_by_kind(lambda text: list(text.encode()), {"ascii": "abcd", "cjk": "東京"})
    assert (out["ascii"].chars, out["ascii"].utf8_bytes, out["ascii"].tokens) == (4, 4, 4)
    assert out["cjk"].chars_per_token == pytest.approx(2 / 6) and out["cjk"].bytes_per_token == 1
    course = compression_by_kind(course_tokenizer().encode)
    assert list(course) == list(T.PASSAGE_KINDS)
    assert course["english"].chars_per_token > course["chinese"].chars_per_token
