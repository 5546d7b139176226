"""Checks for the tokens lab: the BPE merge loop, encode, decode, and a streaming detokenizer."""

from __future__ import annotations

import codecs
import contextlib
import functools
import numbers
import random
from collections import Counter

from .._answers import unguarded
from ..stop_strings import split_at_stop
from ..tokenizer import (
    END_OF_TEXT,
    BPETokenizer,
    IncrementalDetokenizer,
    apply_merges,
    bpe_decode,
    bpe_encode,
    bpe_merges,
    course_passages,
    course_tokenizer,
    merge_pair,
    pretokenize,
    token_table,
    utf8_incomplete_tail,
)
from .framework import Case, ForbiddenCall, graded

MERGE_RULE = (
    "check the rules one by one: pairs are counted inside each chunk of pretokenize(text), never across two "
    "chunks, and once per occurrence of a chunk; the most frequent pair is merged, and of pairs with the same "
    "count the smallest, comparing pairs as tuples of ids; the k-th merge (counting from 0) gets the id "
    "256 + k and replaces its pair in every chunk, left to right; the loop stops after vocab_size - 256 "
    "merges, or earlier when no chunk has two ids left."
)
ENCODE_RULE = (
    "pretokenize(text), then in each chunk start from its UTF-8 bytes and apply the merges in the order they "
    "were learned (repeatedly merge the adjacent pair with the lowest rank, or go through the merges list "
    "once in order); the k-th merge makes id 256 + k."
)
DECODE_RULE = (
    "build each id's bytes (0-255: the byte itself; 256 + k: the bytes of merges[k]'s two ids joined), join "
    "the bytes of ALL the ids, and decode them once with .decode('utf-8', errors='replace'). An id outside "
    "0 .. 255 + len(merges) must raise ValueError."
)
STREAM_RULE = (
    "keep the bytes you have not emitted; after adding a token's bytes, emit everything except a trailing "
    "incomplete character (a lead byte 0xC2-0xF4 followed by fewer continuation bytes than it needs), "
    "decoded with errors='replace'; flush() decodes and returns whatever is still held, and empties the "
    "buffer."
)
NEVER_LEAD = "0xC0, 0xC1 and 0xF5-0xFF"  # bytes that appear in no UTF-8 text at all


# -- wrong implementations the checks recognise --------------------------------------------------------

def _merges_over(words: list[list[int]], freqs: list[int], n: int, choose) -> list[tuple[int, int]]:
    merges = []
    while len(merges) < n:
        counts: Counter = Counter()
        for w, f in zip(words, freqs):
            for p in zip(w, w[1:]):
                counts[p] += f
        if not counts:
            break
        pair = choose(counts)
        if pair is None:
            break
        merges.append(pair)
        words = [merge_pair(w, pair, 255 + len(merges)) for w in words]
    return merges


def _chunks(text):
    c = Counter(pretokenize(text))
    return [list(k.encode()) for k in c], list(c.values())


def _merge_mistakes(text: str, vocab_size: int) -> dict[str, list]:
    n = vocab_size - 256
    words, freqs = _chunks(text)
    smallest = lambda counts: min(counts, key=lambda p: (-counts[p], p))
    return {
        "pairs are counted across chunk boundaries (the text was not pre-tokenised, or the chunks were "
        "joined)": _merges_over([list(text.encode())], [1], n, smallest),
        "ties go to the pair seen first (as Counter.most_common and max() do), not to the smallest pair":
            _merges_over(words, freqs, n, lambda counts: counts.most_common(1)[0][0]),
        "ties go to the largest pair, not the smallest":
            _merges_over(words, freqs, n, lambda counts: max(counts, key=lambda p: (counts[p], p))),
        "each distinct chunk is counted once, not once per occurrence":
            _merges_over(words, [1] * len(words), n, smallest),
        "vocab_size - 256 + 1 merges were learned (an off-by-one in the loop)":
            _merges_over(words, freqs, n + 1, smallest),
        "merging stops once the most frequent pair occurs only once; a pair seen once is merged too, and the "
        "loop goes on while any chunk has two ids left":
            _merges_over(words, freqs, n, lambda counts: None if max(counts.values()) < 2 else smallest(counts)),
    }


def _as_pairs(checker, got, case, what):
    try:
        pairs = [tuple(p) for p in got]
        ok = not isinstance(got, (str, bytes)) and all(len(p) == 2 and all(_is_int(x) for x in p) for p in pairs)
    except TypeError:
        ok = False
    if not ok:
        checker.fail(case, f"the {what} is {type(got).__name__} {str(got)[:120]}, expected a list of pairs of "
                           f"ints such as [(101, 32), (256, 116)].", MERGE_RULE)
    return [(int(a), int(b)) for a, b in pairs]


def _ids(checker, got, case, what, hint):
    if not isinstance(got, (list, tuple)) or not all(_is_int(x) for x in got):
        checker.fail(case, f"the {what} is {type(got).__name__} {str(got)[:120]}, expected a list of ints.", hint)
    return [int(x) for x in got]


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _first_difference(got, expected) -> str:
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return f"item {i} is {a!r}, expected {b!r}"
    return f"you returned {len(got)} items, expected {len(expected)}"


# -- the texts the checks use ------------------------------------------------------------------------------

# Pieces of random words: ASCII, accented Latin, Cyrillic, CJK, Hangul, an emoji; digits and punctuation.
_RANDOM_PIECES = list("aeinorstlm") + ["é", "ü", "ж", "ы", "東", "京", "한", "😀"]


def _random_text(seed: int, n_words: int = 90) -> str:
    """Text no answer can have been stored for: words drawn (with repeats, so that pairs recur and
    counts tie) from a vocabulary of random words, digits and punctuation, made from ``seed``."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_RANDOM_PIECES) for _ in range(rng.randint(1, 6))) for _ in range(25)]
    words += [str(rng.randint(0, 99999)), "-", ",", "...", "!"]
    return " ".join(rng.choice(words) for _ in range(n_words))


def _fresh_seed() -> int:
    """A seed drawn when the check runs (shown in the case, so a failure can be replayed)."""
    return random.SystemRandom().randrange(10**6)


@functools.lru_cache(maxsize=1)
def _merge_cases() -> list[tuple[str, str, int]]:
    """(label, text, vocab_size): each exposes one mistake, then real text."""
    passages = course_passages()
    return [
        ("ties: 'mn' seen first, 'zy' largest, 'ab' smallest", "mn,zy,ab", 257),
        ("ties on the second id", "ac,ab", 257),
        ("a higher count beats a smaller pair", "zz,zz,ab", 257),
        ("pairs across chunks: ', ' three times, ' x' twice", "x, x, x, y", 257),
        ("overlapping pairs: 'aaaa'", "aaaa aaaa", 300),
        ("runs out of pairs before vocab_size", "hello", 400),
        ("French passage", passages["french"][:600], 300),
        ("mixed scripts and emoji", "naïve café — Привет мир, こんにちは 世界! 👍🏽👍🏽 e\u0301e\u0301 " * 2, 290),
        ("Python code", passages["python"][:500], 290),
    ]


def _merge_cases_now() -> list[tuple[str, str, int]]:
    """The fixed cases, then one made up as the check runs."""
    seed = _fresh_seed()
    return [*_merge_cases(), (f"random words, seed {seed}", _random_text(seed), 300)]


def _encode_cases() -> list[tuple[str, str, list]]:
    passages = course_passages()
    small = bpe_merges(passages["german"][:800], 300)
    course = course_tokenizer().merges
    return [
        ("empty text", "", small),
        ("one chunk, German merges", " Zusammensetzungen", small),
        ("merges must not cross chunks", "the cat, the hat; the mat.", course),
        ("English prose", passages["english"][2000:2400], course),
        ("Russian", passages["russian"][:200], course),
        ("CJK, emoji and combining marks", "東京 😀👍🏽 e\u0301 ❤️ 한국어", course),
        ("code", passages["c"][:300], course),
        (f"the special token's string is ordinary text here: {END_OF_TEXT}", f"a{END_OF_TEXT}b", course),
        *_random_encode_cases(_fresh_seed()),
    ]


def _random_encode_cases(seed: int) -> list[tuple[str, str, list]]:
    """Merges learned on one random text, applied to another made of the same words."""
    merges = bpe_merges(_random_text(seed, 120), 320)
    return [(f"random words, seed {seed}", _random_text(seed + 1, 60), merges)]


# -- checks ---------------------------------------------------------------------------------------------------

@graded(points=10, bans=(bpe_merges,))
def check_bpe_merges(fn, checker):
    """``fn(text, vocab_size)`` must return the merges (a list of pairs of ids) byte-level BPE learns,
    with the tie rule and pre-tokenisation of :mod:`labsupport.tokenizer`."""
    for label, text, vocab_size in _merge_cases_now():
        case = Case(text=label, vocab_size=vocab_size, chars=len(text))
        got = _as_pairs(checker, checker.call(fn, text, vocab_size, case=case), case, "result")
        expected = bpe_merges(text, vocab_size)
        if got == expected:
            continue
        problem = f"your merges differ from the expected ones: {_first_difference(got, expected)}."
        for description, wrong in _merge_mistakes(text, vocab_size).items():
            if wrong != expected and got == wrong:
                problem += f"\nYour merges match what we get when {description}."
                break
        checker.fail(case, problem, MERGE_RULE)


@graded(points=5, bans=(bpe_encode, apply_merges, token_table))
def check_bpe_encode(fn, checker):
    """``fn(text, merges)`` must return the ids of ``text``; a lone surrogate must raise ValueError.
    The course's tokenizer (its class, its merge loop, its table of ids) may not do the work."""
    for label, text, merges in _encode_cases():
        case = Case(text=label, merges=len(merges))
        got = _ids(checker, checker.call(fn, text, list(merges), case=case), case, "result", ENCODE_RULE)
        expected = bpe_encode(text, merges)
        if got == expected:
            continue
        problem = f"your ids differ from the expected ones: {_first_difference(got, expected)}."
        whole = list(text.encode())
        for k, pair in enumerate(merges):
            whole = merge_pair(whole, pair, 256 + k)
        if got == whole != expected:
            problem += "\nYour ids match what we get when the merges are applied across chunk boundaries " \
                       "(the text was not pre-tokenised)."
        elif got == list(text.encode()):
            problem += "\nYour ids are the raw UTF-8 bytes: no merge was applied."
        checker.fail(case, problem, ENCODE_RULE)
    case = Case(text="'ok \\ud800' (a lone surrogate)")
    try:
        checker.call(fn, "ok \ud800", list(_encode_cases()[1][2]), case=case)
    except Exception as exc:  # a CheckFailed wrapping what the learner's function raised
        if not isinstance(exc.__cause__, ValueError):
            raise
    else:
        checker.fail(case, "your function returned ids for a string UTF-8 cannot encode.",
                     "text.encode('utf-8') raises UnicodeEncodeError (a ValueError) for it: let it propagate.")


def _decode_cases() -> list[tuple[str, list, list]]:
    course = course_tokenizer()
    merges = course.merges
    german = bpe_merges(course_passages()["german"][:800], 300)  # not the course tokenizer's merges
    euro = list("€".encode())
    seed = _fresh_seed()
    rng = random.Random(seed)
    return [
        ("empty", [], merges),
        ("ASCII and merged tokens", bpe_encode("the tokens of a prompt", merges), merges),
        ("merges of a small German tokenizer", bpe_encode(" Zusammensetzungen und Übergänge", german), german),
        ("a character split over three byte tokens: €", [ord("a"), *euro, ord("b")], merges),
        ("emoji and CJK", bpe_encode("東京 👍🏽 한국어 ❤️", merges), merges),
        ("invalid: a character cut short", [ord("a"), euro[0], euro[1], ord("b")], merges),
        ("invalid: stray bytes 0xFF and 0x80", [0xFF, ord("x"), 0x80], merges),
        ("invalid: three invalid sequences in a row (a cut €, 0xFF, 0xC0)", [euro[0], euro[1], 0xFF, 0xC0, ord("z")],
         merges),
        ("no merges at all", [104, 105], []),
        (f"random ids of the German tokenizer, seed {seed}", [rng.randrange(256 + len(german)) for _ in range(40)],
         german),
    ]


@graded(points=5, bans=(bpe_decode, token_table))
def check_bpe_decode(fn, checker):
    """``fn(ids, merges)`` must return the text; invalid bytes become U+FFFD, never dropped; an id
    outside the vocabulary raises ValueError. The course's tokenizer may not build the table of ids."""
    for label, ids, merges in _decode_cases():
        case = Case(ids=label, n_ids=len(ids), merges=len(merges))
        got = checker.call(fn, list(ids), list(merges), case=case)
        if not isinstance(got, str):
            checker.fail(case, f"the result is a {type(got).__name__}, expected a str.", DECODE_RULE)
        expected = bpe_decode(ids, merges)
        if got == expected:
            continue
        data = b"".join(BPETokenizer(merges, {}).token_bytes(i) for i in ids)
        problem = f"the text is {got!r}, expected {expected!r}."
        if got == data.decode("utf-8", errors="ignore"):
            problem += "\nYour text matches what we get when invalid bytes are dropped (errors='ignore'); " \
                       "they must become U+FFFD (errors='replace'), so that broken output is visible."
        elif got == "".join(BPETokenizer(merges, {}).token_bytes(i).decode("utf-8", "replace") for i in ids):
            problem += "\nYour text matches what we get when each token is decoded on its own: a character " \
                       "whose bytes span several tokens then breaks. Join all the bytes, then decode once."
        checker.fail(case, problem, DECODE_RULE)
    merges = course_tokenizer().merges
    for bad in (256 + len(merges), -1):
        case = Case(ids=f"[104, {bad}]", merges=len(merges))
        wrong_error = None
        try:
            got = checker.call(fn, [104, bad], list(merges), case=case)
        except Exception as exc:
            if isinstance(exc.__cause__, ValueError):
                continue
            if not isinstance(exc.__cause__, (KeyError, IndexError)):
                raise
            wrong_error = exc.__cause__
        if wrong_error is not None:  # failed outside the except block: one message, not two chained
            checker.fail(case, f"your function raised {type(wrong_error).__name__}: {wrong_error} for id {bad}, "
                               f"which is outside the vocabulary (0 to {255 + len(merges)}); it must raise "
                               f"ValueError, saying which id and the valid range (check every id first: "
                               f"`raise ValueError(...)`).", DECODE_RULE)
        checker.fail(case, f"your function returned {got!r} for id {bad}, which is outside the vocabulary "
                           f"(0 to {255 + len(merges)}); raise ValueError instead.", DECODE_RULE)


# -- the streaming detokenizer -----------------------------------------------------------------------------

@contextlib.contextmanager
def _no_incremental_decoder():
    """Python's own incremental decoder is what the exercise builds: it may not be used."""
    original = codecs.getincrementaldecoder

    def refused(*args, **kwargs):
        raise ForbiddenCall("codecs.getincrementaldecoder is Python's own incremental decoder, which this "
                            "exercise asks you to write: track the bytes of an unfinished character yourself.")

    codecs.getincrementaldecoder = refused
    try:
        yield
    finally:
        codecs.getincrementaldecoder = original


def _run_stream(cls, tokenizer, ids):
    """Instantiate the learner's class, push every id, flush; what was emitted after each call."""
    with _no_incremental_decoder():
        detok = cls(tokenizer)
        pieces = []
        for i in ids:
            pieces.append(detok.push(i))
        pieces.append(detok.flush())
    return pieces


def _stream_cases(tok) -> list[tuple[str, list, bool]]:
    """(label, ids, valid): valid streams are the bytes of real text."""
    enc = lambda text: bpe_encode(text, tok)
    byte_ids = lambda text: list(text.encode())
    return [
        ("ASCII", enc("Hello, world"), True),
        ("€ as three byte tokens", byte_ids("a€b"), True),
        ("emoji (4 bytes) as byte tokens, then text", byte_ids("😀👍🏽") + enc(" ok"), True),
        ("Hindi, Korean, Chinese", enc("हिन्दी 한국어 東京"), True),
        ("CJK as byte tokens", byte_ids("東京"), True),
        ("merged tokens with a character's bytes split between them", _split_char_ids(tok), True),
        ("the end-of-text token after a character", byte_ids("é") + [tok.end_of_text_id], True),
        ("ends in the middle of a character (flush must return it)", byte_ids("ab") + byte_ids("€")[:2], False),
        ("invalid bytes in the middle", [ord("a"), 0xFF, 0xE2, 0x82, ord("b"), 0x80, *enc(" and then more text")],
         False),
        ("bytes that never start a character (0xC0, 0xC1, 0xF5, 0xF7) between letters",
         [ord("a"), 0xC0, ord("b"), 0xC1, 0x80, ord("c"), 0xF5, ord("d"), 0xF7, 0x80, 0x80, ord("e")], False),
        ("lead bytes whose next byte rules the character out (E0 80, ED A0, F0 80, F4 90): held or not",
         [ord("a"), 0xE0, 0x80, ord("b"), 0xED, 0xA0, ord("c"), 0xF0, 0x80, ord("d"), 0xF4, 0x90, 0x80, ord("e")],
         False),
        ("empty stream", [], True),
        *_random_streams(tok, _fresh_seed()),
    ]


def _random_streams(tok, seed: int) -> list[tuple[str, list, bool]]:
    """Random words, as the course tokenizer's ids and as single bytes; and random bytes."""
    text = _random_text(seed, 30)
    rng = random.Random(seed)
    return [
        (f"random words, seed {seed}", bpe_encode(text, tok), True),
        (f"random words as byte tokens, seed {seed}", list(text.encode()), True),
        (f"random bytes, seed {seed}", [rng.randrange(256) for _ in range(40)], False),
    ]


def _split_char_ids(tok) -> list[int]:
    """Ids of the course tokenizer where a token ends in the middle of a multi-byte character."""
    for text in ("Привет мир", "naïve café", "東京タワー", "हिन्दी"):
        ids = bpe_encode(text, tok)
        for i in ids:
            try:
                tok.token_bytes(i).decode("utf-8")
            except UnicodeDecodeError:
                return ids
    return list("é".encode())


@graded(points=10, bans=(utf8_incomplete_tail,))
def check_incremental_detokenizer(cls, checker):
    """``cls(tokenizer)`` must give an object whose ``push(id)`` returns the text completed by that
    token (never half a character) and whose ``flush()`` returns what is left; joined, the pieces
    equal ``tokenizer.decode(ids)``."""
    if isinstance(cls, type) and issubclass(cls, IncrementalDetokenizer):
        checker.fail(Case(cls=cls.__name__), "your class is, or inherits from, the course's "
                     "labsupport.tokenizer.IncrementalDetokenizer. Write your own.", STREAM_RULE)
    tok = course_tokenizer()
    for label, ids, _valid in _stream_cases(tok):
        case = Case(stream=label, ids=ids if len(ids) <= 12 else f"{len(ids)} ids")
        runner = functools.partial(_run_stream, cls, tok)
        runner.__name__ = f"{getattr(cls, '__name__', 'your class')}.push"
        pieces = checker.call(runner, ids, case=case)
        if not all(isinstance(p, str) for p in pieces):
            checker.fail(case, f"push/flush returned {[type(p).__name__ for p in pieces if not isinstance(p, str)][0]}"
                               f", expected str every time (an empty string when nothing is complete).", STREAM_RULE)
        expected = _run_stream(IncrementalDetokenizer, tok, ids)
        whole = tok.decode(ids)
        for k, piece in enumerate(pieces[:-1]):
            if "\ufffd" in piece and "\ufffd" not in "".join(expected[:k + 1]):
                checker.fail(case, f"push of id {ids[k]} (call {k + 1}) returned {piece!r}: a broken character. "
                                   f"Its bytes were not all there yet; hold them until they are.", STREAM_RULE)
        if "".join(pieces) != whole:
            problem = f"your pieces join to {''.join(pieces)!r}, but decode(ids) is {whole!r}."
            if pieces[-1] == "" and expected[-1]:
                problem += f"\nflush() returned '' but should return the held bytes, decoded: {expected[-1]!r}."
            checker.fail(case, problem, STREAM_RULE)
        data = [b"".join(tok.token_bytes(i) for i in ids[:k + 1]) for k in range(len(ids))]
        lenient = _run_stream(_LeadByteRule, tok, ids)  # the lab's rule; `expected` is the stricter one
        for k in range(len(ids)):
            sent, due, also = "".join(pieces[:k + 1]), "".join(expected[:k + 1]), "".join(lenient[:k + 1])
            if sent in (due, also):
                continue
            held = _held_back(data[k], sent)
            checker.fail(case, f"after {k + 1} push(es) you had emitted {sent!r}, expected {due!r}"
                               + (f" (or {also!r}: the lab's rule may hold a lead byte whose next byte already rules "
                                  f"its character out)" if also != due else "")
                               + f": {_what_was_held(held)}", STREAM_RULE)
    _check_reuse(cls, tok, checker)


class _LeadByteRule(IncrementalDetokenizer):
    """The lab's rule exactly: hold a trailing lead byte (0xC2-0xF4) with fewer continuation bytes than
    it needs, whatever those bytes are. The course's own class also releases at once a lead byte whose
    second byte is already out of range (E0 80, ED A0, F0 80, F4 90); the check accepts both."""

    def push(self, token_id: int) -> str:
        self._pending += self.tokenizer.token_bytes(token_id)
        cut = len(self._pending)
        for back in range(1, min(3, len(self._pending)) + 1):
            byte = self._pending[-back]
            if 0x80 <= byte <= 0xBF:
                continue
            need = 2 if 0xC2 <= byte <= 0xDF else 3 if 0xE0 <= byte <= 0xEF else 4 if 0xF0 <= byte <= 0xF4 else 1
            if need > back:
                cut -= back
            break
        text, self._pending = self._pending[:cut].decode("utf-8", errors="replace"), self._pending[cut:]
        return text


def _held_back(data: bytes, sent: str) -> bytes | None:
    """The bytes not yet emitted, when what was emitted is the decoding of a prefix of ``data``."""
    for cut in range(len(data), -1, -1):
        if data[:cut].decode("utf-8", "replace") == sent:
            return data[cut:]
    return None


def _what_was_held(held: bytes | None) -> str:
    """What the learner's detokenizer held back, and why that is wrong, in words."""
    if held is None:
        return "what you emitted is not the decoding of the bytes received so far, minus some held at the end."
    if not held:
        return "you emitted more than the bytes received so far decode to."
    shown = " ".join(f"{b:02X}" for b in held)
    freeze = ("must come out as U+FFFD, not wait: a model that emits one bad byte would otherwise freeze the "
              "stream until its end.")
    if held[0] in (0xC0, 0xC1) or held[0] >= 0xF5:
        return (f"you are holding back the bytes {shown}, which start with 0x{held[0]:02X}, a byte that can never "
                f"start a character: UTF-8's lead bytes are 0xC2-0xDF (2 bytes), 0xE0-0xEF (3) and 0xF0-0xF4 (4), "
                f"and {NEVER_LEAD} appear in no valid text (0xC0 and 0xC1 would be overlong, 0xF5 and up beyond "
                f"U+10FFFF). Such a byte {freeze}")
    tail = utf8_incomplete_tail(held)
    complete = held[:len(held) - tail]
    if tail and complete:
        return (f"you are holding back the bytes {shown}: {complete.decode('utf-8', 'replace')!r}, already "
                f"complete, and the start of a character after it. Only that unfinished character's own bytes "
                f"may wait; emit the complete characters before it now (a token can end in the middle of one "
                f"character and still carry whole characters before it).")
    if len(held) > 3 and "\ufffd" in held.decode("utf-8", "replace"):
        return (f"you are holding back {len(held)} bytes ({shown}), more than the 3 an unfinished character can "
                f"have. Bytes that can never complete a character {freeze}")
    return (f"you are holding back the bytes {shown}, which decode to {held.decode('utf-8', 'replace')!r} as they "
            f"are: every character whose bytes have all arrived must be emitted at once (a stream that waits "
            f"for flush is no stream).")


def _check_reuse(cls, tok, checker) -> None:
    """One object, two streams: what flush() returned must not come back in the second stream."""
    first, second = list("ab€".encode())[:-1], bpe_encode(" ok", tok)
    case = Case(stream="one object for two streams: flush() after a cut-off €, then ' ok'",
                ids=f"{first} then flush, then {second}")

    def two_streams(ids_a, ids_b):
        with _no_incremental_decoder():
            detok = cls(tok)
            for i in ids_a:
                detok.push(i)
            detok.flush()
            return [detok.push(i) for i in ids_b] + [detok.flush()]

    two_streams.__name__ = f"{getattr(cls, '__name__', 'your class')}.push"
    pieces = checker.call(two_streams, first, second, case=case)
    if "".join(pieces) != tok.decode(second):
        checker.fail(case, f"the second stream came out as {''.join(pieces)!r}, expected {tok.decode(second)!r}: "
                           f"flush() must empty the buffer as well as return it.", STREAM_RULE)


# --- stop strings in a stream (exercise 4) ---------------------------------------------------------------

STOP_RULE = (
    "keep the text you have not sent; after adding a piece, look for every stop string in the held text plus "
    "the piece: if one occurs, send what comes before the earliest occurrence and return stopped=True; otherwise "
    "hold the longest end of that text that is the beginning of some stop string and send the rest. flush() "
    "returns what is still held and empties it."
)


def _run_stops(cls, stops, pieces):
    """Push ``pieces`` into ``cls(stops)`` until it reports a stop, then flush if it never did: what
    each call returned, as returned."""
    filt = cls(list(stops))
    out = []
    for piece in pieces:
        out.append(filt.push(piece))
        if isinstance(out[-1], tuple) and len(out[-1]) == 2 and out[-1][1] is True:
            return out
    out.append(filt.flush())
    return out


def _reference_stops(stops, pieces) -> list[tuple[str, bool]]:
    """The rule, call by call: ``(text sent, stopped)``; a last ``(flush, False)`` when no stop came."""
    held, out = "", []
    for piece in pieces:
        send, held, stopped = unguarded(split_at_stop)(held + piece, stops)
        out.append((send, stopped))
        if stopped:
            return out
    out.append((held, False))
    return out


def _stop_cases(tok) -> list[tuple[str, list[str], list[str]]]:
    """(label, stops, pieces): hand-made streams, a real one from the course tokenizer, random ones."""
    detok = IncrementalDetokenizer(tok)
    text = "The answer is 4.\n\nUser: and then?"
    real = [detok.push(i) for i in bpe_encode(text, tok)] + [detok.flush()]
    cases = [
        ("a stop split over three pieces", ["\n\nUser:"], ["Sure.", "\n", "\nUs", "er:", " more"]),
        ("a false start, then the stop", ["</s>"], ["a <", "/b> c", "</", "s>"]),
        ("the earliest occurrence wins, not the first stop listed", ["world", "o"], ["hell", "o world"]),
        ("a stop whose start repeats", ["aab"], ["xa", "a", "a", "b!"]),
        ("two stops, each partly held in turn", ["###", "\nQ:"], ["A", "#", "\n", "Q", "uite"]),
        ("no stop strings", [], ["a", "b", ""]),
        ("the stop and text after it in one piece", ["STOP"], ["go STOP and more"]),
        ("the stop at the very start", ["<|im_end|>"], ["<|im", "_end|>", "ignored"]),
        ("no stop comes: flush sends what is held", ["END"], ["the E", "N"]),
        ("empty pieces", ["ab"], ["", "a", "", "b"]),
        ("characters beyond ASCII", ["。\n"], ["東京。", "\n次"]),
        ("the course tokenizer's pieces", ["\n\nUser:"], real),
        ("the longer hold of two stops wins", ["\nA", "\n\nUser:"], ["hi\n\n", "User: x"]),
        ("letter case matters", ["STOP"], ["please stop here"]),
        ("a stop that starts first but is completed last", ["abcd", "bc"], ["abcd"]),
    ]
    rng = random.Random(1)  # fixed: a failure names the same case every run
    for n in range(120):
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 2))]
        text = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 12)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 5))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        cases.append((f"random stream {n}", stops, pieces))
    return cases


def _stop_problem(stops, pieces, got, want) -> str | None:
    """What is wrong with the learner's calls ``got`` (``(text, stopped)`` each), or None."""
    sent_got = sent_want = ""
    for k, ((g_text, g_stop), (w_text, w_stop)) in enumerate(zip(got, want)):
        call = f"push {k + 1}" if k < len(pieces) else "flush()"
        sent_got, sent_want = sent_got + g_text, sent_want + w_text
        so_far = "".join(pieces[:k + 1])
        if w_stop and not g_stop:
            found = min((s for s in stops if s in so_far), key=so_far.find)
            where = ("it is inside this piece alone" if found in pieces[k]
                     else "it began in text you held from earlier pieces: look in the held text plus the piece")
            return f"after {call} the text so far is {so_far!r}: the stop string {found!r} is complete ({where}), " \
                   f"but you did not return stopped=True."
        if g_stop and not w_stop:
            return f"you returned stopped=True at {call}, but no stop string of {stops} occurs in {so_far!r}."
        if sent_got == sent_want:
            continue
        if w_stop:
            firsts = [so_far[:so_far.find(s)] for s in stops if s in so_far]
            listed = next(iter(firsts))
            if sent_got == listed:
                return (f"at {call} you cut {so_far!r} at the first stop string in the list that occurs, but another "
                        f"occurs earlier: send {sent_want!r}, what comes before the earliest occurrence.")
            if sent_got.startswith(sent_want) and any(sent_got[len(sent_want):].startswith(s) for s in stops):
                return f"at {call} you sent {sent_got!r}: the stop string is not part of the answer; send {sent_want!r}."
            return f"at {call} (a stop string completed) you had sent {sent_got!r} in all, expected {sent_want!r}."
        if call == "flush()":
            return (f"flush() returned {g_text!r}, expected {w_text!r}: when no stop string came, the text you "
                    f"still hold belongs to the answer.")
        if sent_got.startswith(sent_want):
            extra = sent_got[len(sent_want):]
            return (f"after {call} you had sent {sent_got!r}, but {extra!r} at its end could still become the start "
                    f"of a stop string ({stops}): hold it until a later piece says whether it does.")
        if sent_want.startswith(sent_got):
            held = so_far[len(sent_got):]
            return (f"after {call} you were holding {held!r}, but only {so_far[len(sent_want):]!r} can still begin a "
                    f"stop string of {stops}: send the rest now; a client is waiting for it.")
        return f"after {call} you had sent {sent_got!r} in all, expected {sent_want!r}."
    return None


@graded(points=8, bans=(split_at_stop,))
def check_stop_strings(cls, checker):
    """``cls(stops)`` must give an object whose ``push(text)`` returns ``(text to send, stopped)`` and
    whose ``flush()`` returns what is held: it holds back exactly the text that may still begin a stop
    string, and ends the answer before the earliest stop string."""
    tok = course_tokenizer()
    for label, stops, pieces in _stop_cases(tok):
        shown = pieces if sum(map(len, pieces)) <= 40 else f"{len(pieces)} pieces"
        case = Case(stream=label, stops=stops, pieces=shown)
        runner = functools.partial(_run_stops, cls)
        runner.__name__ = f"{getattr(cls, '__name__', 'your class')}.push"
        raw = checker.call(runner, stops, pieces, case=case)
        want = _reference_stops(stops, pieces)
        got = []
        for k, value in enumerate(raw):
            is_flush = k == len(raw) - 1 and not (isinstance(value, tuple) and len(value) == 2 and value[1] is True)
            if is_flush and k == len(pieces):
                if not isinstance(value, str):
                    checker.fail(case, f"flush() returned {type(value).__name__}, expected str (the text held).",
                                 STOP_RULE)
                got.append((value, False))
            elif (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str)
                  and isinstance(value[1], bool)):
                got.append(value)
            else:
                checker.fail(case, f"push returned {value!r}, expected a tuple (text to send: str, stopped: bool).",
                             STOP_RULE)
        problem = _stop_problem(stops, pieces, got, want)
        if problem is None and len(got) != len(want):
            problem = f"your filter made {len(got)} calls' worth of output, expected {len(want)}."
        if problem:
            checker.fail(case, problem, STOP_RULE)
    _check_nothing_left(cls, checker)


def _check_nothing_left(cls, checker) -> None:
    """flush() empties what it returns, and after a stop nothing is held: neither what followed the stop
    string nor what was held before it (that held text was the stop string's start, or was sent)."""
    for label, pieces, extra in (("a second flush()", ["the E"], "flush() once more"),
                                 ("flush() after a stop", ["go STOP and more"], "flush() after the stop"),
                                 ("flush() after a stop that completed held text", ["go ST", "OP and more"],
                                  "flush() after a stop that completed held text"),
                                 ("flush() after a stop, other text held before it", ["wait E", "x STOP"],
                                  "flush() after a stop that followed held text")):
        case = Case(stream=label, stops=["END", "STOP"], pieces=pieces)

        def run(pieces=pieces, label=label):
            filt = cls(["END", "STOP"])
            for piece in pieces:
                filt.push(piece)
            if label == "a second flush()":
                filt.flush()
            return filt.flush()

        run.__name__ = f"{getattr(cls, '__name__', 'your class')}.flush"
        left = checker.call(run, case=case)
        if left != "":
            if label.startswith("flush() after a stop") and len(pieces) > 1:
                why = ("after a stop nothing is held: empty what you held before the stop when you return "
                       "stopped=True (that text was sent, or was the stop string's start).")
            else:
                why = "flush() empties what it returns, and the text after a stop string is dropped, never held."
            checker.fail(case, f"{extra} returned {left!r}, expected '': {why}", STOP_RULE)
