"""The tokens lab's checks pass correct learner code and reject each planted mistake."""

from __future__ import annotations

import codecs
from collections import Counter

import pytest

from labsupport._answers import course_checks_its_answers, unguarded
from labsupport.checks import (
    CheckFailed,
    check_bpe_decode,
    check_bpe_encode,
    check_bpe_merges,
    check_incremental_detokenizer,
    check_stop_strings,
)
from labsupport.checks.framework import Checker
from labsupport.tokenizer import IncrementalDetokenizer, bpe_decode, bpe_encode, bpe_merges, pretokenize

# --- a learner's correct solutions, written as the lab asks -------------------------------------------


def merge(ids, pair, new_id):
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def learner_merges(text, vocab_size, *, across_chunks=False, choose=None, per_chunk_once=False):
    chunks = Counter([text] if across_chunks else pretokenize(text))
    words = [list(c.encode("utf-8")) for c in chunks]
    freqs = [1] * len(words) if per_chunk_once else list(chunks.values())
    merges = []
    while len(merges) < vocab_size - 256:
        counts = Counter()
        for w, f in zip(words, freqs):
            for p in zip(w, w[1:]):
                counts[p] += f
        if not counts:
            break
        pair = choose(counts) if choose else min(counts, key=lambda p: (-counts[p], p))
        if pair is None:  # a planted mistake that stops early
            break
        merges.append(pair)
        words = [merge(w, pair, 255 + len(merges)) for w in words]
    return merges


def learner_encode(text, merges, *, pretokenized=True):
    out = []
    for chunk in pretokenize(text) if pretokenized else [text]:
        ids = list(chunk.encode("utf-8"))
        for k, pair in enumerate(merges):  # in the order learned
            ids = merge(ids, pair, 256 + k)
        out += ids
    return out


def vocab_of(merges):
    vocab = {i: bytes([i]) for i in range(256)}
    for k, (a, b) in enumerate(merges):
        vocab[256 + k] = vocab[a] + vocab[b]
    return vocab


def learner_decode(ids, merges, *, errors="replace", per_token=False, checked=True):
    vocab = vocab_of(merges)
    for i in ids:
        if checked and i not in vocab:
            raise ValueError(f"id {i} is outside the vocabulary 0..{len(vocab) - 1}")
    if per_token:
        return "".join(vocab[i].decode("utf-8", errors) for i in ids)
    return b"".join(vocab[i] for i in ids).decode("utf-8", errors=errors)


class LearnerDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pending = b""

    def push(self, token_id):
        self.pending += self.tokenizer.token_bytes(token_id)
        cut = len(self.pending)
        for back in range(1, min(3, len(self.pending)) + 1):  # the last lead byte, if its character is short
            byte = self.pending[-back]
            if 0x80 <= byte <= 0xBF:
                continue
            need = 2 if 0xC2 <= byte <= 0xDF else 3 if 0xE0 <= byte <= 0xEF else 4 if 0xF0 <= byte <= 0xF4 else 1
            if need > back:
                cut = len(self.pending) - back
            break
        text, self.pending = self.pending[:cut].decode("utf-8", "replace"), self.pending[cut:]
        return text

    def flush(self):
        text, self.pending = self.pending.decode("utf-8", "replace"), b""
        return text


def failure(check, fn):
    with pytest.raises(CheckFailed) as info:
        check(fn)
    return str(info.value)


# --- check_bpe_merges ---------------------------------------------------------------------------------


def test_merges_reference_passes(capsys):
    check_bpe_merges(learner_merges)
    check_bpe_merges(unguarded(bpe_merges))
    assert "PASSED check_bpe_merges" in capsys.readouterr().out


@pytest.mark.parametrize("mutant, message", [
    (lambda t, v: learner_merges(t, v, across_chunks=True), "counted across chunk boundaries"),
    (lambda t, v: learner_merges(t, v, choose=lambda c: c.most_common(1)[0][0]), "ties go to the pair seen first"),
    (lambda t, v: learner_merges(t, v, choose=lambda c: max(c, key=lambda p: (c[p], p))), "ties go to the largest"),
    (lambda t, v: learner_merges(t, v, per_chunk_once=True), "counted once, not once per occurrence"),
    (lambda t, v: learner_merges(t, v + 1), "off-by-one"),
])
def test_merges_mutants_fail(mutant, message):
    assert message in failure(check_bpe_merges, mutant)


def test_merges_wrong_types_and_stub():
    assert "list of pairs of ints" in failure(check_bpe_merges, lambda t, v: "nope")

    def stub(text, vocab_size):
        raise NotImplementedError("write the merge loop")

    assert "NotImplementedError" in failure(check_bpe_merges, stub)


def test_the_course_answer_is_refused_to_a_learner():
    with course_checks_its_answers(False):
        assert "course's own answer" in failure(check_bpe_merges, bpe_merges)
        assert "course's own answer" in failure(check_bpe_merges, lambda t, v: bpe_merges(t, v))


# --- check_bpe_encode and check_bpe_decode ---------------------------------------------------------------------


def test_encode_and_decode_references_pass(capsys):
    check_bpe_encode(learner_encode)
    check_bpe_decode(learner_decode)
    out = capsys.readouterr().out
    assert "PASSED check_bpe_encode" in out and "PASSED check_bpe_decode" in out


def test_the_course_answers_meet_their_own_checks():
    """The course's encode and decode are built on the table of ids and the merge loop that their
    checks ban, so they are run through the checks' bodies without the bans."""
    check_bpe_encode.__wrapped__(unguarded(bpe_encode), Checker("check_bpe_encode"))
    check_bpe_decode.__wrapped__(unguarded(bpe_decode), Checker("check_bpe_decode"))


def test_encode_mutants_fail():
    assert "across chunk boundaries" in failure(check_bpe_encode, lambda t, m: learner_encode(t, m, pretokenized=False))
    assert "raw UTF-8 bytes" in failure(check_bpe_encode, lambda t, m: list(t.encode()))
    assert "UTF-8 cannot encode" in failure(
        check_bpe_encode, lambda t, m: learner_encode(t.encode("utf-8", "replace").decode(), m))

    def stub(text, merges):
        raise NotImplementedError

    assert "NotImplementedError" in failure(check_bpe_encode, stub)


def test_decode_mutants_fail():
    assert "invalid bytes are dropped" in failure(check_bpe_decode, lambda i, m: learner_decode(i, m, errors="ignore"))
    assert "each token is decoded on its own" in failure(
        check_bpe_decode, lambda i, m: learner_decode(i, m, per_token=True))
    assert "raised KeyError" in failure(check_bpe_decode, lambda i, m: learner_decode(i, m, checked=False))

    def wraps_negative_ids(ids, merges):  # a list indexed with -1 quietly gives the last token
        vocab = list(vocab_of(merges).values())
        if any(i >= len(vocab) for i in ids):
            raise ValueError("outside")
        return b"".join(vocab[i] for i in ids).decode("utf-8", "replace")

    assert "for id -1" in failure(check_bpe_decode, wraps_negative_ids)

    def stub(ids, merges):
        raise NotImplementedError

    assert "NotImplementedError" in failure(check_bpe_decode, stub)


# --- check_incremental_detokenizer -----------------------------------------------------------------------------


def test_detokenizer_reference_passes(capsys):
    check_incremental_detokenizer(LearnerDetokenizer)
    assert "PASSED check_incremental_detokenizer" in capsys.readouterr().out


class BrokenCharacters(LearnerDetokenizer):
    def push(self, token_id):  # decodes every token at once
        return self.tokenizer.token_bytes(token_id).decode("utf-8", "replace")


class LosesTheTail(LearnerDetokenizer):
    def flush(self):
        self.pending = b""
        return ""


class WaitsForFlush(LearnerDetokenizer):
    def push(self, token_id):
        self.pending += self.tokenizer.token_bytes(token_id)
        return ""


class UsesPythonsDecoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id):
        return self.decoder.decode(self.tokenizer.token_bytes(token_id))

    def flush(self):
        return self.decoder.decode(b"", final=True)


class Stub:
    def __init__(self, tokenizer):
        pass

    def push(self, token_id):
        raise NotImplementedError("write push")

    def flush(self):
        raise NotImplementedError("write flush")


class Inherits(IncrementalDetokenizer):
    pass


@pytest.mark.parametrize("mutant, message", [
    (BrokenCharacters, "a broken character"),
    (LosesTheTail, "flush() returned '' but should return the held bytes"),
    (WaitsForFlush, "must be emitted at once"),
    (UsesPythonsDecoder, "codecs.getincrementaldecoder"),
    (Stub, "NotImplementedError"),
    (Inherits, "inherits from, the course's"),
])
def test_detokenizer_mutants_fail(mutant, message):
    assert message in failure(check_incremental_detokenizer, mutant)


def test_codecs_is_restored_after_the_check():
    failure(check_incremental_detokenizer, UsesPythonsDecoder)
    assert codecs.getincrementaldecoder("utf-8")().decode(b"\xe2\x82\xac") == "€"


def test_numpy_integers_are_accepted(capsys):
    import numpy as np

    check_bpe_merges(lambda t, v: [(np.int64(a), np.int64(b)) for a, b in learner_merges(t, v)])
    check_bpe_encode(lambda t, m: np.array(learner_encode(t, m), dtype=np.int64).tolist())
    assert capsys.readouterr().out.count("PASSED") == 2


# --- shortcuts and mistakes found in review (issue 10) -----------------------------------------------------


def test_memorised_merges_fail_on_the_text_made_up_at_check_time():
    from labsupport.checks.lab01_tokens import _merge_cases

    stored = {(text, v): learner_merges(text, v) for _, text, v in _merge_cases()}  # the fixed cases, answered
    assert "random words, seed" in failure(check_bpe_merges, lambda t, v: stored[(t, v)])


def test_the_course_tokenizer_cannot_encode_or_decode_for_the_learner():
    from labsupport.tokenizer import BPETokenizer, course_tokenizer

    def through_the_class(text, merges):
        return BPETokenizer(merges, {}).encode(text)

    def through_its_merge_loop(text, merges):  # a private method, skipping bpe_encode
        tok = BPETokenizer(merges, {})
        return [i for chunk in pretokenize(text) for i in tok._encode_chunk(chunk)]

    def through_the_course_tokenizer(ids, merges):  # its table of ids fits the course's merges only
        return b"".join(course_tokenizer().token_bytes(i) for i in ids).decode("utf-8", "replace")

    def through_a_fresh_table(ids, merges):
        return b"".join(BPETokenizer(merges, {}).token_bytes(i) for i in ids).decode("utf-8", "replace")

    with course_checks_its_answers(False):
        assert "course's own answer" in failure(check_bpe_encode, through_the_class)
        assert "token_table" in failure(check_bpe_encode, through_its_merge_loop)
        assert "small German tokenizer" in failure(check_bpe_decode, through_the_course_tokenizer)
        assert "token_table" in failure(check_bpe_decode, through_a_fresh_table)


def test_decode_that_collapses_replacement_characters_fails():
    import re

    assert "three invalid sequences in a row" in failure(
        check_bpe_decode, lambda i, m: re.sub("\ufffd+", "\ufffd", learner_decode(i, m)))


class StallsOnInvalidBytes:
    """Right on valid text; after a byte that can never be valid it waits for flush (a frozen stream)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pending = b""

    def push(self, token_id):
        self.pending += self.tokenizer.token_bytes(token_id)
        try:
            text, self.pending = self.pending.decode(), b""
            return text
        except UnicodeDecodeError as error:
            if error.reason == "unexpected end of data" and error.end == len(self.pending):
                text, self.pending = self.pending[:error.start].decode(), self.pending[error.start:]
                return text
            return ""

    def flush(self):
        text, self.pending = self.pending.decode("utf-8", "replace"), b""
        return text


class FlushKeepsItsBuffer(LearnerDetokenizer):
    def flush(self):
        return self.pending.decode("utf-8", "replace")


@pytest.mark.parametrize("mutant, message", [
    (StallsOnInvalidBytes, "must come out as U+FFFD, not wait"),
    (FlushKeepsItsBuffer, "flush() must empty the buffer"),
])
def test_detokenizer_review_mutants_fail(mutant, message):
    assert message in failure(check_incremental_detokenizer, mutant)


def test_the_random_cases_are_new_each_run():
    from labsupport.checks.lab01_tokens import _decode_cases, _merge_cases_now

    assert len({_merge_cases_now()[-1][1] for _ in range(5)}) > 1
    assert len({_decode_cases()[-1][0] for _ in range(5)}) > 1


# --- the red team's cases (issue 26) ------------------------------------------------------------------------


def _lead_byte_rule(lead_bytes):
    """A learner's detokenizer that holds a trailing lead byte from ``lead_bytes`` (byte -> length)."""

    class Detokenizer(LearnerDetokenizer):
        def push(self, token_id):
            self.pending += self.tokenizer.token_bytes(token_id)
            keep = 0
            for back in range(1, min(4, len(self.pending)) + 1):
                byte = self.pending[-back]
                if 0x80 <= byte <= 0xBF:
                    continue
                need = lead_bytes(byte)
                keep = back if need and back < need else 0
                break
            cut = len(self.pending) - keep
            text, self.pending = self.pending[:cut].decode("utf-8", "replace"), self.pending[cut:]
            return text

    return Detokenizer


# lead bytes read off the bit patterns (110xxxxx, 1110xxxx, 11110xxx): holds C0, C1 and F5-F7, which never start one
BitPatternLeadBytes = _lead_byte_rule(lambda b: 2 if 0xC0 <= b <= 0xDF else 3 if 0xE0 <= b <= 0xEF
                                      else 4 if 0xF0 <= b <= 0xF7 else 0)


class HoldsWhileItEndsInReplacement(LearnerDetokenizer):
    """vLLM's older rule: decode everything not yet emitted, emit nothing while it ends in U+FFFD."""

    def push(self, token_id):
        self.pending += self.tokenizer.token_bytes(token_id)
        text = self.pending.decode("utf-8", "replace")
        if text.endswith("\ufffd"):
            return ""
        self.pending = b""
        return text


class ReleasesImpossibleSecondBytes(LearnerDetokenizer):
    """The chapter's (and Python's decoder's) stricter rule: E0 80, F4 90 and the like come out at once."""

    def push(self, token_id):
        from labsupport.tokenizer import utf8_incomplete_tail

        self.pending += self.tokenizer.token_bytes(token_id)
        cut = len(self.pending) - unguarded(utf8_incomplete_tail)(self.pending)
        text, self.pending = self.pending[:cut].decode("utf-8", "replace"), self.pending[cut:]
        return text


def test_either_rule_for_impossible_second_bytes_passes(capsys):
    check_incremental_detokenizer(LearnerDetokenizer)  # the lab's rule: held until the next byte
    check_incremental_detokenizer(ReleasesImpossibleSecondBytes)
    assert capsys.readouterr().out.count("PASSED") == 2


def test_a_detokenizer_holding_bytes_that_never_start_a_character_fails():
    message = failure(check_incremental_detokenizer, BitPatternLeadBytes)
    assert "0xC0" in message and "can never start a character" in message and "not wait" in message


def test_holding_complete_characters_with_an_unfinished_one_is_named():
    message = failure(check_incremental_detokenizer, HoldsWhileItEndsInReplacement)
    assert "already complete, and the start of a character after it" in message
    assert "waits for flush" not in message


def test_a_trainer_that_stops_at_count_one_is_named():
    def stops_at_count_one(text, vocab_size):
        return learner_merges(text, vocab_size, choose=lambda c: min(c, key=lambda p: (-c[p], p))
                              if max(c.values()) > 1 else None)

    assert "a pair seen once is merged too" in failure(check_bpe_merges, stops_at_count_one)


def test_a_decoder_raising_key_error_is_told_to_raise_value_error():
    def key_error(ids, merges):
        vocab = vocab_of(merges)
        return b"".join(vocab[i] for i in ids).decode("utf-8", "replace")

    message = failure(check_bpe_decode, key_error)
    assert "raised KeyError" in message and "must raise ValueError" in message


# --- check_stop_strings ---------------------------------------------------------------------------------


class LearnerStops:
    """Exercise 4 as the lab asks: hold exactly what may still begin a stop string."""

    def __init__(self, stops):
        self.stops, self.held = list(stops), ""

    def push(self, text):
        buf = self.held + text
        hits = [buf.find(s) for s in self.stops if s in buf]
        if hits:
            self.held = ""
            return buf[:min(hits)], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self):
        text, self.held = self.held, ""
        return text


def _stop_found(self, buf):
    hits = [buf.find(s) for s in self.stops if s in buf]
    return min(hits) if hits else None


def _hold(self, buf, keep):
    self.held = buf[len(buf) - keep:]
    return buf[:len(buf) - keep], False


def _no_hold(self, text):
    buf, self.held = self.held + text, ""
    i = _stop_found(self, buf)
    return (buf[:i], True) if i is not None else (buf, False)


def _piece_only(self, text):  # looks for a stop in the new piece alone
    i = _stop_found(self, text)
    if i is not None:
        out, self.held = self.held + text[:i], ""
        return out, True
    buf = self.held + text
    keep = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
    return _hold(self, buf, keep)


def _fixed_tail(self, text):  # holds len(longest stop) - 1 characters whatever they are
    buf = self.held + text
    i = _stop_found(self, buf)
    if i is not None:
        self.held = ""
        return buf[:i], True
    return _hold(self, buf, min(len(buf), max(map(len, self.stops), default=1) - 1))


def _first_listed(self, text):
    buf = self.held + text
    for s in self.stops:
        if s in buf:
            self.held = ""
            return buf[:buf.find(s)], True
    return LearnerStops.push(self, text)


def _with_the_stop(self, text):
    buf = self.held + text
    hits = [(buf.find(s), s) for s in self.stops if s in buf]
    if hits:
        i, s = min(hits)
        self.held = ""
        return buf[:i + len(s)], True
    return LearnerStops.push(self, text)


def _longest_prefix_only(self, text):  # holds only an end equal to all of a stop but its last character
    buf = self.held + text
    i = _stop_found(self, buf)
    if i is not None:
        self.held = ""
        return buf[:i], True
    keep = max((len(s) - 1 for s in self.stops if len(s) > 1 and buf.endswith(s[:-1])), default=0)
    return _hold(self, buf, keep)


def _first_stop_held_only(self, text):  # holds back for the first stop string only
    buf = self.held + text
    i = _stop_found(self, buf)
    if i is not None:
        self.held = ""
        return buf[:i], True
    first = self.stops[:1]
    keep = max((k for s in first for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
    return _hold(self, buf, keep)


def _stopped_as_text(self, text):
    sent, stopped = LearnerStops.push(self, text)
    return sent, ("stop" if stopped else None)


def _flush_keeps(self):
    return ""


def _case_blind(self, text):
    buf = self.held + text
    low = buf.lower()
    hits = [low.find(s.lower()) for s in self.stops if s.lower() in low]
    if hits:
        self.held = ""
        return buf[:min(hits)], True
    return LearnerStops.push(self, text)


def _flush_keeps_it(self):
    return self.held


def _held_after_the_stop(self, text):
    buf = self.held + text
    hits = [(buf.find(s), s) for s in self.stops if s in buf]
    if hits:
        i, s = min(hits)
        self.held = buf[i + len(s):]
        return buf[:i], True
    return LearnerStops.push(self, text)


def _held_kept_at_the_stop(self, text):  # what was held before the stop is never emptied
    buf = self.held + text
    i = _stop_found(self, buf)
    if i is not None:
        return buf[:i], True
    return LearnerStops.push(self, text)


def _first_complete(self, text):  # one character at a time: the stop completed first, not the one begun first
    sent = ""
    for ch in text:
        sent_part, stopped = LearnerStops.push(self, ch)
        sent += sent_part
        if stopped:
            return sent, True
    return sent, False


STOP_MUTANTS = {
    "letter_case_ignored": ({"push": _case_blind}, "no stop string of ['STOP'] occurs in 'please stop here'"),
    "flush_does_not_empty": ({"flush": _flush_keeps_it}, "flush() once more returned 'E'"),
    "text_after_the_stop_held": ({"push": _held_after_the_stop}, "flush() after the stop returned"),
    "held_text_kept_at_the_stop": ({"push": _held_kept_at_the_stop},
                                   "flush() after a stop that completed held text returned 'ST'"),
    "the_stop_completed_first": ({"push": _first_complete}, "a stop that starts first but is completed last"),
    "no_hold_back": ({"push": _no_hold}, "could still become the start of a stop string"),
    "the_new_piece_alone": ({"push": _piece_only}, "look in the held text plus the piece"),
    "a_fixed_tail": ({"push": _fixed_tail}, "send the rest now; a client is waiting"),
    "the_first_stop_listed": ({"push": _first_listed}, "the first stop string in the list that occurs"),
    "the_stop_string_sent": ({"push": _with_the_stop}, "the stop string is not part of the answer"),
    "only_a_whole_stop_but_one": ({"push": _longest_prefix_only}, "could still become the start"),
    "held_for_the_first_stop_only": ({"push": _first_stop_held_only}, "could still become the start"),
    "stopped_as_a_string": ({"push": _stopped_as_text}, "expected a tuple (text to send: str, stopped: bool)"),
    "flush_returns_nothing": ({"flush": _flush_keeps}, "the text you still hold belongs to the answer"),
}


def test_stop_strings_reference_passes(capsys):
    check_stop_strings(LearnerStops)
    assert "PASSED check_stop_strings" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(STOP_MUTANTS))
def test_stop_strings_mistakes_are_named(name):
    methods, message = STOP_MUTANTS[name]
    assert message in failure(check_stop_strings, type(name, (LearnerStops,), methods))


class StopsOnAFlag:
    """Another correct filter: a flag remembers the stop, flush() answers from it, the hold is a loop."""

    def __init__(self, stops):
        self.stops, self.pending, self.done = [s for s in stops if s], "", False

    def push(self, text):
        self.pending += text
        cut = min((self.pending.index(s) for s in self.stops if s in self.pending), default=None)
        if cut is not None:
            self.done = True
            return self.pending[:cut], True
        start = 0
        while start < len(self.pending) and not any(s.startswith(self.pending[start:]) for s in self.stops):
            start += 1
        sent, self.pending = self.pending[:start], self.pending[start:]
        return sent, False

    def flush(self):
        out = "" if self.done else self.pending
        self.pending = ""
        return out


def test_stop_strings_correct_variant_passes(capsys):
    check_stop_strings(StopsOnAFlag)
    assert "PASSED check_stop_strings" in capsys.readouterr().out


def test_stop_strings_stub_and_course_answer_are_refused():
    from labsupport.stop_strings import split_at_stop

    class Stub:
        def __init__(self, stops):
            pass

        def push(self, text):
            raise NotImplementedError("exercise 4")

        def flush(self):
            raise NotImplementedError("exercise 4")

    assert "still raises NotImplementedError" in failure(check_stop_strings, Stub)

    class CourseAnswer(LearnerStops):
        def push(self, text):
            sent, self.held, stopped = split_at_stop(self.held + text, self.stops)
            return sent, stopped

    assert "the course's own answer" in failure(check_stop_strings, CourseAnswer)


def test_the_servers_stop_strings_are_the_rule():
    """The course server's back ends hold back text by the same rule the check grades."""
    from labsupport.serve.backend import _StopStrings

    out = _StopStrings(("\n\nUser:",))
    assert out.push("Sure.") == ("Sure.", False) and out.push("\n") == ("", False)
    assert out.push("\nUs") == ("", False) and out.push("er: more") == ("", True)
