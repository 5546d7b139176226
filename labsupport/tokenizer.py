"""Byte-level BPE: the course's tokenizer, its training, and streaming detokenisation (chapter 01).

What is here:

* :func:`train_bpe` learns a byte-level BPE tokenizer from text; :class:`BPETokenizer` encodes,
  decodes, saves and loads it (a small JSON file);
* :class:`IncrementalDetokenizer` turns a stream of token ids into text piece by piece, never
  emitting half a character;
* :func:`course_corpus` and :func:`course_passages` are the text the course ships for training
  (its own chapters plus passages in other languages and scripts, emoji and code, labelled by kind),
  and :func:`course_tokenizer` is the tokenizer trained on it (the course server of chapter 03 uses it).

Conventions, fixed so that a check can test them:

* **Ids.** Ids 0-255 are the 256 byte values. The merge learned ``k``-th (counting from 0) gets id
  ``256 + k``. Special tokens come after the merges, so
  ``vocab_size = 256 + len(merges) + len(special_tokens)``.
* **Pre-tokenisation.** Before counting pairs, text is split into chunks by
  :data:`PRETOKENIZE_PATTERN` (Python's standard ``re``; the course's package depends on nothing that
  Colab lacks, and ``regex`` is not among its dependencies). A chunk is one of: an English
  contraction suffix (``'s``, ``'t``, ``'re``, ``'ve``, ``'m``, ``'ll``, ``'d``); a run of letters and
  combining marks with at most one space in front (``" naïve"``, ``" हिन्दी"``, ``"東京"``); one to
  three digits with at most one space in front; a run of other symbols (punctuation, emoji,
  underscores) with at most one space in front; or whitespace (a run of spaces keeps its last space
  for the word that follows). Merges never cross a chunk boundary: ``" the"`` can become one token,
  ``"e t"`` never can. Joined, the chunks are the text exactly. Letters and digits are what
  Python's ``str.isalnum``/``\\d`` say; combining marks are the Unicode categories Mn, Mc and Me
  of the running Python's ``unicodedata``.
* **Training.** Pairs of adjacent ids are counted inside chunks, each distinct chunk weighted by how
  often it occurs. Each step merges the pair with the **highest count; ties go to the smallest pair**
  ``(a, b)`` compared as a tuple of ids (first ``a``, then ``b``). Every occurrence in a chunk is
  replaced left to right without overlap (``a a a`` with the pair ``(a, a)`` becomes ``aa a``).
  Training stops at the requested size or when no chunk has two tokens left.
* **Encoding** a chunk applies the learned merges in the order they were learned (repeatedly merge
  the adjacent pair with the lowest rank), which reproduces training's split of the training text.
* **Special tokens** (by default one, :data:`END_OF_TEXT` ``"<|endoftext|>"``) are never produced by
  ``encode(text)``: the string ``"<|endoftext|>"`` inside text is encoded as ordinary characters, so
  text from a user cannot end a document or fake a chat turn. Pass
  ``allowed_special={"<|endoftext|>"}`` (or ``"all"``) to turn the strings into their ids, as the
  course does when it builds a prompt itself. They decode to their strings.
* **Decoding** joins the tokens' bytes and decodes them as UTF-8 with invalid sequences replaced by
  U+FFFD, the replacement character (one per maximal invalid subpart, Python's and the WHATWG
  rule), as real tokenizers do: a model can emit ids whose bytes are not valid UTF-8, and dropping
  them silently would hide that.

Errors are ``ValueError`` with what was wrong and what to do: text that UTF-8 cannot encode (a lone
surrogate), a vocabulary size below 256 (or too small for the special tokens), an id outside the
vocabulary, a malformed tokenizer file.

Speed: :func:`train_bpe` counts pairs once over the table of distinct chunks and updates the counts
incrementally after each merge (only the chunks holding the merged pair are touched), choosing the
next pair from a heap. On the course corpus (about 107 KB of UTF-8) it learns the 767 merges of
the course tokenizer in about 0.2 s, and 1,791 (a vocabulary of 2,048) in about 0.3 s, on one core
of the machine the course was written on (``tests/test_tokenizer.py`` bounds it).

The shipped tokenizer is ``labsupport/data/course_tokenizer.json``; :func:`write_course_tokenizer`
retrains it from :func:`course_corpus` (``python -m labsupport.tokenizer``). Its vocabulary size is
:data:`COURSE_VOCAB_SIZE`.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import json
import operator
import os
import re
import sys
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

from ._answers import answer
from ._validate import positive_int, positive_number
from .costs import param_count
from .models import as_model

__all__ = [
    "END_OF_TEXT",
    "COURSE_VOCAB_SIZE",
    "PRETOKENIZE_PATTERN",
    "pretokenize",
    "merge_pair",
    "bpe_merges",
    "bpe_encode",
    "bpe_decode",
    "token_table",
    "apply_merges",
    "utf8_incomplete_tail",
    "train_bpe",
    "BPETokenizer",
    "IncrementalDetokenizer",
    "course_passages",
    "course_corpus",
    "course_tokenizer",
    "write_course_tokenizer",
    "Compression",
    "compression_by_kind",
    "VocabCosts",
    "vocab_costs",
]

END_OF_TEXT = "<|endoftext|>"
COURSE_VOCAB_SIZE = 1024  # 256 bytes + 767 merges + <|endoftext|>
DATA_DIR = Path(__file__).parent / "data"
PASSAGES_DIR = DATA_DIR / "passages"
COURSE_TOKENIZER_PATH = DATA_DIR / "course_tokenizer.json"
FILE_FORMAT = "labsupport-bpe"
PRETOKENIZER_NAME = "course-v1"


# -- pre-tokenisation ------------------------------------------------------------------------------

def _combining_marks_class() -> str:
    """The combining marks (Mn, Mc, Me) as the inside of a ``re`` character class, in ranges.
    They live in planes 0, 1 and 14 (variation selectors), so only those are scanned."""
    ranges: list[list[int]] = []
    for start, stop in ((0, 0x20000), (0xE0000, 0xE1000)):
        for cp in range(start, stop):
            if unicodedata.category(chr(cp))[0] == "M":
                if ranges and ranges[-1][1] == cp - 1:
                    ranges[-1][1] = cp
                else:
                    ranges.append([cp, cp])
    return "".join(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)


# The pattern, readable: {MARK} stands for the combining marks (see _combining_marks_class).
PRETOKENIZE_PATTERN = (
    r"'(?:s|t|re|ve|m|ll|d)"  # an English contraction's suffix
    r"| ?(?:[^\W\d_]|[{MARK}])+"  # a word: letters and combining marks, one optional space before
    r"| ?\d{1,3}"  # one to three digits
    r"| ?(?:[^\s\w]|_)+"  # punctuation, symbols, emoji (with their variation selectors), underscores
    r"|\s+(?!\S)"  # whitespace that does not precede a word (keeps the last space for the word)
    r"|\s+"  # whatever whitespace is left
)


@functools.lru_cache(maxsize=1)
def _pretokenizer() -> re.Pattern:
    return re.compile(PRETOKENIZE_PATTERN.replace("{MARK}", _combining_marks_class()))


def pretokenize(text: str) -> list[str]:
    """Split ``text`` into the chunks that merges stay inside (see the module docstring); joined,
    they are ``text``. ``pretokenize("Hello, world!")`` is ``['Hello', ',', ' world', '!']``."""
    _check_text(text)
    return _pretokenizer().findall(text)


# -- validation --------------------------------------------------------------------------------------

def _check_text(text) -> str:
    """``text`` if UTF-8 can encode it, else a ValueError saying where it cannot and what to do."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}; decode bytes first, "
                         f"e.g. data.decode('utf-8')")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = text[error.start]
        raise ValueError(
            f"the text holds a lone surrogate U+{ord(bad):04X} at index {error.start}, which UTF-8 cannot "
            f"encode, so it has no bytes to tokenize. It usually comes from bytes decoded with "
            f"errors='surrogateescape' or a broken \\ud8xx escape in JSON; clean the text first, e.g. "
            f"text.encode('utf-8', 'replace').decode('utf-8') turns it into '?'"
        ) from None
    return text


def _check_vocab_size(vocab_size, n_special: int) -> int:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        try:
            vocab_size = operator.index(vocab_size)
        except TypeError:
            raise ValueError(f"vocab_size must be a whole number, got {vocab_size!r}") from None
    if vocab_size < 256:
        raise ValueError(f"vocab_size {vocab_size} is below 256: byte-level BPE starts from the 256 byte "
                         f"values and adds merges on top, so ask for at least {256 + n_special} "
                         f"(for example 1024)")
    if vocab_size < 256 + n_special:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the {n_special} special token(s): "
                         f"it counts the 256 bytes, the merges and the special tokens, so ask for at "
                         f"least {256 + n_special}")
    return vocab_size


def _check_id(token_id, vocab_size: int) -> int:
    if isinstance(token_id, bool):
        raise ValueError(f"token id {token_id!r} is a bool, not an id; ids are whole numbers 0 to {vocab_size - 1}")
    try:
        value = operator.index(token_id)
    except TypeError:
        raise ValueError(f"token id {token_id!r} ({type(token_id).__name__}) is not a whole number; ids are "
                         f"0 to {vocab_size - 1}") from None
    if not 0 <= value < vocab_size:
        raise ValueError(f"token id {value} is outside the vocabulary (ids 0 to {vocab_size - 1}): was it made "
                         f"by another tokenizer, or by a model with a larger vocabulary?")
    return value


# -- the merge loop ----------------------------------------------------------------------------------

def merge_pair(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """``ids`` with every occurrence of ``pair`` replaced by ``new_id``, left to right, no overlap."""
    a, b = pair
    out: list[int] = []
    i, n = 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == a and ids[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


@answer
def bpe_merges(text: str, vocab_size: int) -> list[tuple[int, int]]:
    """The merges byte-level BPE learns from ``text`` for a vocabulary of ``vocab_size`` ids (256
    bytes plus the merges, no special tokens): at most ``vocab_size - 256`` pairs, in the order
    learned. Highest count first, ties to the smallest pair; counted inside pre-tokenised chunks.

    Incremental: pair counts are kept for the table of distinct chunks (weighted by frequency), and
    after a merge only the chunks that held the pair are recounted. The best pair comes from a heap
    whose stale entries are skipped when popped.
    """
    _check_text(text)
    vocab_size = _check_vocab_size(vocab_size, 0)
    chunk_counts = Counter(pretokenize(text))
    words = [list(chunk.encode("utf-8")) for chunk in chunk_counts]
    freqs = list(chunk_counts.values())
    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)  # pair -> chunks that may hold it
    for i, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freqs[i]
            where[pair].add(i)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)  # smallest (-count, pair): highest count, then smallest pair
    merges: list[tuple[int, int]] = []
    while len(merges) < vocab_size - 256:
        while heap and pair_counts.get(heap[0][1], 0) != -heap[0][0]:
            heapq.heappop(heap)  # stale: its count changed since it was pushed
        if not heap:
            break  # no chunk has two tokens left
        _, pair = heapq.heappop(heap)
        new_id = 256 + len(merges)
        merges.append(pair)
        changed: set[tuple[int, int]] = set()
        for i in where.pop(pair):
            word = words[i]
            merged = merge_pair(word, pair, new_id)
            if len(merged) == len(word):
                continue  # the pair left this chunk in an earlier merge
            freq = freqs[i]
            for old in zip(word, word[1:]):
                pair_counts[old] -= freq
                changed.add(old)
            for new in zip(merged, merged[1:]):
                pair_counts[new] += freq
                where[new].add(i)
                changed.add(new)
            words[i] = merged
        for p in changed:
            count = pair_counts[p]
            if count > 0:
                heapq.heappush(heap, (-count, p))
            else:
                del pair_counts[p]
    return merges


def _merges_of(merges) -> BPETokenizer:
    if isinstance(merges, BPETokenizer):
        return merges
    return _plain_tokenizer(tuple(tuple(pair) for pair in merges))


@functools.lru_cache(maxsize=8)
def _plain_tokenizer(merges: tuple) -> BPETokenizer:
    return BPETokenizer(merges, special_tokens={})


@answer
def bpe_encode(text: str, merges) -> list[int]:
    """``text`` as token ids under ``merges`` (a list of pairs, or a :class:`BPETokenizer`, whose
    special tokens are then treated as ordinary text): pre-tokenise, then in each chunk apply the
    merges in the order they were learned."""
    _check_text(text)
    tok = _merges_of(merges)
    out: list[int] = []
    for chunk in _pretokenizer().findall(text):
        out.extend(tok._encode_chunk(chunk))
    return out


@answer
def bpe_decode(ids: Iterable[int], merges) -> str:
    """The text of ``ids`` under ``merges`` (a list of pairs, or a :class:`BPETokenizer`): their
    bytes joined and decoded as UTF-8, invalid sequences as U+FFFD."""
    tok = _merges_of(merges)
    return b"".join(tok.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


@answer
def token_table(merges) -> tuple[list[bytes], dict[tuple[int, int], int]]:
    """The bytes of every id under ``merges`` (ids 0-255 the bytes themselves, ``256 + k`` the two
    parts of merge ``k`` joined) and each merge's rank, ``{pair: k}``; a ValueError for a merge that
    is not a pair of earlier ids, or that repeats one. What :class:`BPETokenizer` is built on (and
    what decoding needs), so the encode and decode checks refuse it to a learner's function."""
    vocab = [bytes([b]) for b in range(256)]
    ranks: dict[tuple[int, int], int] = {}
    for k, pair in enumerate(merges):
        try:
            a, b = (operator.index(x) for x in pair)
        except (TypeError, ValueError):
            raise ValueError(f"merge {k} must be a pair of ids, got {pair!r}") from None
        if not (0 <= a < 256 + k and 0 <= b < 256 + k):
            raise ValueError(f"merge {k} is {pair!r}, but merge {k} may only join ids made before it "
                             f"(0 to {255 + k})")
        if (a, b) in ranks:
            raise ValueError(f"merge {k} repeats the pair {pair!r} (already merge {ranks[(a, b)]})")
        ranks[(a, b)] = k
        vocab.append(vocab[a] + vocab[b])
    return vocab, ranks


@answer
def apply_merges(ids: list[int], ranks: dict[tuple[int, int], int]) -> list[int]:
    """One chunk's ids with the merges applied in the order learned: repeatedly merge (everywhere,
    left to right) the adjacent pair of lowest rank, until no adjacent pair is a merge. Merge ``k``
    can never re-create a pair of lower rank (it makes id ``256 + k``, larger than any id a lower
    merge joins), so this is the same as going through the merges once in order."""
    while len(ids) >= 2:
        best = min(zip(ids, ids[1:]), key=lambda p: ranks.get(p, sys.maxsize))
        rank = ranks.get(best)
        if rank is None:
            break
        ids = merge_pair(ids, best, 256 + rank)
    return ids


# -- the tokenizer -------------------------------------------------------------------------------------

class BPETokenizer:
    """A byte-level BPE tokenizer: ``merges`` (ordered pairs of ids; the ``k``-th makes id
    ``256 + k``) and ``special_tokens`` (string -> id, ids right after the merges).
    Build one with :func:`train_bpe` or :meth:`load`."""

    def __init__(self, merges: Iterable[tuple[int, int]], special_tokens: dict[str, int] | None = None):
        vocab, ranks = token_table(merges)
        if special_tokens is None:
            special_tokens = {END_OF_TEXT: len(vocab)}
        specials = dict(special_tokens)
        expected = list(range(len(vocab), len(vocab) + len(specials)))
        if sorted(specials.values()) != expected or not all(isinstance(s, str) and s for s in specials):
            raise ValueError(f"special tokens must be non-empty strings with the ids right after the merges "
                             f"({expected}), got {specials!r}")
        for text, _ in sorted(specials.items(), key=lambda item: item[1]):
            vocab.append(text.encode("utf-8"))
        self._merges = list(ranks)
        self._ranks = ranks
        self._vocab = vocab
        self._special = specials
        self._cache: dict[str, tuple[int, ...]] = {}

    # what it is
    @property
    def merges(self) -> list[tuple[int, int]]:
        """The merges in the order learned (a copy)."""
        return list(self._merges)

    @property
    def vocab_size(self) -> int:
        """Number of ids: 256 bytes + merges + special tokens."""
        return len(self._vocab)

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token strings and their ids (a copy)."""
        return dict(self._special)

    @property
    def end_of_text_id(self) -> int:
        """The id of :data:`END_OF_TEXT`, or a ValueError if this tokenizer has none."""
        if END_OF_TEXT not in self._special:
            raise ValueError(f"this tokenizer has no {END_OF_TEXT} token; its special tokens are {self._special}")
        return self._special[END_OF_TEXT]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one id (a special token's are its string in UTF-8)."""
        return self._vocab[_check_id(token_id, len(self._vocab))]

    def __len__(self) -> int:
        return len(self._vocab)

    def __repr__(self) -> str:
        return (f"BPETokenizer(vocab_size={self.vocab_size}, merges={len(self._merges)}, "
                f"special_tokens={self._special})")

    # encoding and decoding
    def _encode_chunk(self, chunk: str) -> tuple[int, ...]:
        cached = self._cache.get(chunk)
        if cached is not None:
            return cached
        result = tuple(apply_merges(list(chunk.encode("utf-8")), self._ranks))
        if len(self._cache) > 50_000:
            self._cache.clear()
        self._cache[chunk] = result
        return result

    def encode(self, text: str, allowed_special: Iterable[str] | str = ()) -> list[int]:
        """Token ids of ``text``. Special-token strings in ``text`` are ordinary text unless named in
        ``allowed_special`` (a set of them, or ``"all"``); see the module docstring for why."""
        _check_text(text)
        if allowed_special == "all":
            allowed = set(self._special)
        else:
            allowed = {allowed_special} if isinstance(allowed_special, str) else set(allowed_special)
            unknown = allowed - set(self._special)
            if unknown:
                raise ValueError(f"allowed_special names {sorted(unknown)}, which are not special tokens of "
                                 f"this tokenizer ({sorted(self._special)})")
        if not allowed:
            return bpe_encode(text, self)
        pattern = "|".join(re.escape(s) for s in sorted(allowed, key=len, reverse=True))
        out: list[int] = []
        pos = 0
        for match in re.finditer(pattern, text):
            out.extend(bpe_encode(text[pos:match.start()], self))
            out.append(self._special[match.group()])
            pos = match.end()
        out.extend(bpe_encode(text[pos:], self))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``: their bytes joined, decoded as UTF-8, invalid sequences as U+FFFD
        (never dropped); a special token decodes to its string."""
        return bpe_decode(ids, self)

    # files
    def to_dict(self) -> dict:
        return {"format": FILE_FORMAT, "version": 1, "pretokenizer": PRETOKENIZER_NAME,
                "vocab_size": self.vocab_size, "merges": [list(p) for p in self._merges],
                "special_tokens": dict(self._special)}

    @classmethod
    def from_dict(cls, data: dict) -> BPETokenizer:
        if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
            raise ValueError(f"not a labsupport BPE tokenizer (expected \"format\": \"{FILE_FORMAT}\"); "
                             f"write one with BPETokenizer.save")
        if data.get("version") != 1 or data.get("pretokenizer") != PRETOKENIZER_NAME:
            raise ValueError(f"tokenizer file version {data.get('version')!r} with pre-tokenizer "
                             f"{data.get('pretokenizer')!r} is not one this labsupport reads (version 1, "
                             f"{PRETOKENIZER_NAME!r}); update labsupport or retrain")
        tok = cls(data.get("merges", []), data.get("special_tokens", {}))
        if "vocab_size" in data and data["vocab_size"] != tok.vocab_size:
            raise ValueError(f"the file says vocab_size {data['vocab_size']} but holds {tok.vocab_size} ids")
        return tok

    def save(self, path) -> Path:
        """Write the tokenizer as JSON (merges and special tokens); returns the path."""
        path = Path(path)
        merges = ",\n    ".join(json.dumps(list(p)) for p in self._merges)
        header = {k: v for k, v in self.to_dict().items() if k != "merges"}
        text = json.dumps(header, ensure_ascii=False, indent=2)[:-2] + ',\n  "merges": [\n    ' + merges + "\n  ]\n}\n"
        path.write_text(text, encoding="utf-8")
        return path

    @classmethod
    def load(cls, path) -> BPETokenizer:
        """Read a tokenizer written by :meth:`save`."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"no tokenizer file at {path}") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON ({error}); write it with BPETokenizer.save") from None
        return cls.from_dict(data)


def hf_single_thread() -> None:
    """Make Hugging Face ``tokenizers`` run on one thread from now on (chapter 01 times its trainer
    beside the course's one-threaded one). The library reads ``TOKENIZERS_PARALLELISM`` at every
    parallel call, so setting it in this process takes effect at once."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def train_bpe(text: str, vocab_size: int, special_tokens: Iterable[str] = (END_OF_TEXT,)) -> BPETokenizer:
    """Train a byte-level BPE tokenizer on ``text`` with ``vocab_size`` ids in all: 256 bytes, then
    ``vocab_size - 256 - len(special_tokens)`` merges (:func:`bpe_merges`; fewer if the text runs
    out of pairs), then the special tokens."""
    _check_text(text)
    specials = list(dict.fromkeys(special_tokens))
    vocab_size = _check_vocab_size(vocab_size, len(specials))
    merges = bpe_merges(text, vocab_size - len(specials))
    return BPETokenizer(merges, {s: 256 + len(merges) + k for k, s in enumerate(specials)})


# -- streaming ------------------------------------------------------------------------------------------

def _second_byte_range(lead: int) -> tuple[int, int]:
    """The bytes that may follow ``lead`` in valid UTF-8 (no overlong forms, no surrogates, <= U+10FFFF)."""
    return {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(lead, (0x80, 0xBF))


@answer
def utf8_incomplete_tail(pending: bytes) -> int:
    """How many bytes at the end of ``pending`` are the valid start of a character still missing
    bytes (0 to 3). Everything before them can be decoded now; they must wait for the next token.
    Bytes that can never become valid UTF-8 are not held: they decode (to U+FFFD) at once, exactly as
    decoding the whole stream would."""
    n = len(pending)
    for back in range(1, min(3, n) + 1):
        byte = pending[n - back]
        if 0x80 <= byte <= 0xBF:
            continue  # a continuation byte: the lead is further back
        need = 2 if 0xC2 <= byte <= 0xDF else 3 if 0xE0 <= byte <= 0xEF else 4 if 0xF0 <= byte <= 0xF4 else 0
        if need <= back:
            return 0  # complete, ASCII, or a byte that never starts a character
        if back >= 2:
            low, high = _second_byte_range(byte)
            if not low <= pending[n - back + 1] <= high:
                return 0  # already invalid: decodes to U+FFFD now
        return back
    return 0


class IncrementalDetokenizer:
    """Turns token ids into text as they arrive: :meth:`push` returns the text that is complete so
    far, holding back the bytes of a character whose remaining bytes are in tokens not yet seen;
    :meth:`flush` returns what is held (a truncated character as U+FFFD). Joined, the pieces are
    ``tokenizer.decode(ids)`` exactly."""

    def __init__(self, tokenizer: BPETokenizer):
        self.tokenizer = tokenizer
        self._pending = b""

    @property
    def pending_bytes(self) -> bytes:
        """The bytes held back, waiting for the rest of their character."""
        return self._pending

    def push(self, token_id: int) -> str:
        self._pending += self.tokenizer.token_bytes(token_id)
        cut = len(self._pending) - utf8_incomplete_tail(self._pending)
        text = self._pending[:cut].decode("utf-8", errors="replace")
        self._pending = self._pending[cut:]
        return text

    def flush(self) -> str:
        text = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        return text


# -- the course's corpus and tokenizer --------------------------------------------------------------------

# The kinds of text the course ships, in the order they are joined; each is labsupport/data/passages/<kind>.txt.
PASSAGE_KINDS = (
    "english", "french", "german", "spanish", "russian", "greek", "arabic", "hindi",
    "chinese", "japanese", "korean", "emoji", "python", "c", "json",
)


@functools.lru_cache(maxsize=1)
def _passages() -> dict[str, str]:
    return {kind: (PASSAGES_DIR / f"{kind}.txt").read_text(encoding="utf-8") for kind in PASSAGE_KINDS}


def course_passages() -> dict[str, str]:
    """The course's training text by kind: ``english`` is the course's own chapter prose; the
    others are short passages the course wrote in other languages and scripts, emoji-rich text, and
    code (Python, C, JSON)."""
    return dict(_passages())


def course_corpus() -> str:
    """All of :func:`course_passages` joined by blank lines, in :data:`PASSAGE_KINDS` order."""
    return "\n\n".join(_passages().values())


@functools.lru_cache(maxsize=1)
def _course_tokenizer() -> BPETokenizer:
    return BPETokenizer.load(COURSE_TOKENIZER_PATH)


def course_tokenizer() -> BPETokenizer:
    """The course's tokenizer: :func:`train_bpe` on :func:`course_corpus` with
    :data:`COURSE_VOCAB_SIZE` ids, read from ``labsupport/data/course_tokenizer.json``."""
    return _course_tokenizer()


def write_course_tokenizer(path=COURSE_TOKENIZER_PATH, vocab_size: int = COURSE_VOCAB_SIZE) -> BPETokenizer:
    """Retrain the course's tokenizer on :func:`course_corpus` and write it to ``path``."""
    tok = train_bpe(course_corpus(), vocab_size)
    tok.save(path)
    _course_tokenizer.cache_clear()
    return tok


# -- what tokens cost ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Compression:
    """How a tokenizer compresses one text: ``chars`` (Unicode code points), ``utf8_bytes`` and
    ``tokens``, with the ratios chapter 01 compares."""

    chars: int
    utf8_bytes: int
    tokens: int

    @property
    def chars_per_token(self) -> float:
        return self.chars / self.tokens if self.tokens else float("nan")

    @property
    def bytes_per_token(self) -> float:
        return self.utf8_bytes / self.tokens if self.tokens else float("nan")


def compression_by_kind(encode, passages: dict[str, str] | None = None) -> dict[str, Compression]:
    """For each kind of text (:func:`course_passages` unless ``passages`` is given), how many tokens
    ``encode(text) -> list of ids`` makes of it. Characters are code points (``len(text)``), so a
    flag emoji counts 2 and ``"e\u0301"`` counts 2."""
    passages = course_passages() if passages is None else passages
    return {kind: Compression(len(text), len(text.encode("utf-8")), len(encode(text)))
            for kind, text in passages.items()}


@dataclasses.dataclass(frozen=True)
class VocabCosts:
    """What a vocabulary of ``vocab_size`` entries costs a model of width ``d_model`` (chapter 01).

    ``output_params`` is the output layer's ``d_model x vocab_size`` matrix (the embedding table has
    as many, unless tied); ``output_flops_per_token`` counts a multiply and an add per weight,
    ``2 * d_model * vocab_size``; ``output_share`` is the output layer's part of all the parameters
    of the model with that vocabulary (:func:`labsupport.costs.param_count`), ``vocab_share`` the
    part of the embedding table and the output layer together."""

    vocab_size: int
    d_model: int
    model_params: int
    embedding_params: int
    output_params: int
    output_bytes: float
    output_flops_per_token: int

    @property
    def output_share(self) -> float:
        return self.output_params / self.model_params

    @property
    def vocab_share(self) -> float:
        return (self.embedding_params + self.output_params) / self.model_params


def vocab_costs(cfg, vocab_size: int | None = None, weight_dtype_bytes: float = 2) -> VocabCosts:
    """The costs of ``cfg``'s vocabulary, or of ``vocab_size`` entries on the same shape (everything
    else unchanged), with ``weight_dtype_bytes`` bytes per weight (2: bf16)."""
    cfg = as_model(cfg)
    if vocab_size is not None:
        cfg = dataclasses.replace(cfg, vocab_size=positive_int("vocab_size", vocab_size))
    size = positive_number("weight_dtype_bytes", weight_dtype_bytes)
    d, v = cfg.d_model, cfg.vocab_size
    output = d * v
    return VocabCosts(vocab_size=v, d_model=d, model_params=param_count(cfg),
                      embedding_params=0 if cfg.tied_embeddings else d * v, output_params=output,
                      output_bytes=output * size, output_flops_per_token=2 * output)


if __name__ == "__main__":
    written = write_course_tokenizer()
    print(f"wrote {COURSE_TOKENIZER_PATH} ({written!r})")
