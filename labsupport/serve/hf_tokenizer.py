"""The course tokenizer in Hugging Face format: ``tokenizer.json`` for the ``tokenizers`` library.

Benchmark clients (guidellm, ``vllm bench serve``, genai-perf) count tokens with a Hugging Face
tokenizer they load from a folder. :func:`hf_tokenizer` builds one that gives **exactly** the ids
of the course's byte-level BPE (:class:`labsupport.tokenizer.BPETokenizer`), and
:func:`write_pretrained` writes it as ``tokenizer.json`` and ``tokenizer_config.json``, which
``transformers.AutoTokenizer.from_pretrained(folder)`` reads.

How the course BPE maps onto the ``tokenizers`` pipeline:

* **Pre-tokenisation**: a ``Split`` on the course's :data:`~labsupport.tokenizer.PRETOKENIZE_PATTERN`
  (matches isolated), then ``ByteLevel`` without its own regex. The course pattern uses Python's
  ``re`` classes (``\\w``, ``\\d``, ``\\s``: what the running Python's Unicode tables say), which the
  Oniguruma engine of ``tokenizers`` reads differently, so every class is written out as explicit
  code-point ranges computed from the running Python (:func:`onig_pattern`). The export is
  therefore exact for the Python that made it; the Unicode version is recorded in
  ``tokenizer_config.json``.
* **Model**: BPE whose vocabulary gives id ``b`` to byte ``b`` (in ByteLevel's printable alphabet)
  and id ``256 + k`` to merge ``k``, with the merges in the order learned: ``tokenizers`` applies
  the lowest-ranked pair first, leftmost first, which is the course's rule (a merge never
  re-creates a pair of lower rank).
* **Special tokens** (``<|endoftext|>``) are added tokens. Hugging Face's default turns their
  strings inside text into the special id; the course's ``encode`` never does (role injection,
  chapter 01). :func:`hf_tokenizer` sets ``encode_special_tokens`` so the object it returns
  behaves like the course; a folder loaded by ``transformers`` follows Hugging Face's default
  unless loaded with ``split_special_tokens=True``.

Building the pattern scans every code point once (a second or two); :func:`onig_pattern` keeps it.
Encoding with the result is linear-logarithmic in the text (the course's own :func:`apply_merges` is
quadratic in the length of one chunk), which is why the course server encodes with it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import tempfile
import unicodedata
from pathlib import Path

from ..tokenizer import PRETOKENIZE_PATTERN, BPETokenizer

EXPORT_VERSION = 1  # bump when the files written change
# The course pattern that onig_pattern translates, alternative by alternative (checked at export).
_TRANSLATED = (
    r"'(?:s|t|re|ve|m|ll|d)"
    r"| ?(?:[^\W\d_]|[{MARK}])+"
    r"| ?\d{1,3}"
    r"| ?(?:[^\s\w]|_)+"
    r"|\s+(?!\S)"
    r"|\s+"
)


def _finditer_ranges(pattern: str, chars: str, offset: int) -> list[tuple[int, int]]:
    return [(offset + m.start(), offset + m.end() - 1) for m in re.finditer(pattern, chars)]


def _onig_class(ranges: list[tuple[int, int]]) -> str:
    return "".join(f"\\x{{{a:X}}}" if a == b else f"\\x{{{a:X}}}-\\x{{{b:X}}}" for a, b in ranges)


@functools.lru_cache(maxsize=1)
def onig_pattern() -> str:
    """:data:`~labsupport.tokenizer.PRETOKENIZE_PATTERN` for Oniguruma, every class spelled out as
    the code points the running Python's ``re`` (and ``unicodedata``, for the combining marks) puts
    in it. Surrogates are left out: text that UTF-8 can encode has none."""
    classes: dict[str, list[tuple[int, int]]] = {"letter": [], "mark": [], "digit": [], "other": [], "space": []}
    for start, stop in ((0, 0xD800), (0xE000, 0x110000)):
        chars = "".join(map(chr, range(start, stop)))
        classes["letter"] += _finditer_ranges(r"[^\W\d_]+", chars, start)
        classes["digit"] += _finditer_ranges(r"\d+", chars, start)
        classes["other"] += _finditer_ranges(r"[^\s\w]+", chars, start)
        classes["space"] += _finditer_ranges(r"\s+", chars, start)
        marks = "".join("m" if cat[0] == "M" else "." for cat in map(unicodedata.category, chars))
        classes["mark"] += _finditer_ranges("m+", marks, start)
    letter, mark, digit, other, space = (_onig_class(classes[k]) for k in ("letter", "mark", "digit", "other", "space"))
    if PRETOKENIZE_PATTERN != _TRANSLATED:
        raise RuntimeError("the course's pre-tokenizer pattern changed: update onig_pattern to match it")
    return (
        r"'(?:s|t|re|ve|m|ll|d)"
        rf"| ?(?:[{letter}]|[{mark}])+"
        rf"| ?[{digit}]{{1,3}}"
        rf"| ?(?:[{other}]|_)+"
        rf"|[{space}]+(?![^{space}])"
        rf"|[{space}]+"
    )


def _gpt2_bytes() -> dict[int, str]:
    """ByteLevel's printable character for each byte (GPT-2's table: printable Latin-1 bytes stand
    for themselves, the others for code points from 256 up, in byte order)."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)}
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def hf_tokenizer(bpe: BPETokenizer, *, split_special: bool = True):
    """A ``tokenizers.Tokenizer`` giving ``bpe``'s ids. ``split_special`` (default): special-token
    strings inside text stay text, as in the course's ``encode``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _gpt2_bytes()

    def spell(token_id: int) -> str:
        return "".join(alphabet[b] for b in bpe.token_bytes(token_id))

    vocab = {spell(i): i for i in range(256 + len(bpe.merges))}
    merges = [(spell(a), spell(b)) for a, b in bpe.merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(onig_pattern()), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = sorted(bpe.special_tokens.items(), key=lambda item: item[1])
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False) for text, _ in specials])
    for text, token_id in specials:
        if tok.token_to_id(text) != token_id:
            raise ValueError(f"special token {text!r} got id {tok.token_to_id(text)}, not {token_id}")
    tok.encode_special_tokens = split_special
    return tok


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def export_stamp(bpe: BPETokenizer) -> dict:
    """What the files depend on: the export's version, the Unicode tables and the tokenizer itself."""
    import hashlib

    digest = hashlib.sha256(json.dumps(bpe.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
    return {"version": EXPORT_VERSION, "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
            "unicode": unicodedata.unidata_version, "tokenizer_sha256": digest}


def _stamp_of(folder: Path) -> dict | None:
    try:
        if not (folder / "tokenizer.json").is_file():
            return None
        return json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("labsupport_export")
    except (OSError, ValueError, AttributeError):
        return None


def copy_pretrained(source, folder) -> Path:
    """Copy the two files :func:`write_pretrained` wrote in ``source`` into ``folder`` (kept as they
    are if ``folder`` already holds the same export). Returns ``folder``."""
    source, folder = Path(source), Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    if _stamp_of(folder) is None or _stamp_of(folder) != _stamp_of(source):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            _write_atomically(folder / name, (source / name).read_text(encoding="utf-8"))
    return folder


def write_pretrained(bpe: BPETokenizer, folder, *, chat_template: str | None, eos_token: str | None,
                     bos_token: str | None = None, model_max_length: int | None = None) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for ``bpe`` into ``folder`` (made if
    missing; each file replaced atomically, so a reader never sees half a file). Returns the folder.
    Files already there from the same tokenizer, export version and Unicode tables are kept."""
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    stamp = export_stamp(bpe)
    if _stamp_of(folder) == stamp:
        return folder
    tok = hf_tokenizer(bpe, split_special=False)  # files follow Hugging Face's convention
    _write_atomically(folder / "tokenizer.json", tok.to_str())
    specials = sorted(bpe.special_tokens.items(), key=lambda item: item[1])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": bos_token,
        "eos_token": eos_token,
        "pad_token": eos_token,
        "unk_token": None,
        "model_max_length": model_max_length or 1_000_000,
        "chat_template": chat_template,
        "added_tokens_decoder": {str(i): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False} for s, i in specials},
        "labsupport_export": stamp,
    }
    _write_atomically(folder / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return folder
