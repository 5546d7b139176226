"""Serve through a learner's assembled stack (``python -m labsupport.serve --stack my-labs/``, issue 31).

The assembly (:mod:`labsupport.course.stack`, instructor tooling: it needs the grader's splice and the
checks) runs in a subprocess, ``python -m labsupport stack``, and writes ``stack.json`` into its cache
folder; this module reads only that file and imports the learner's module files it names, so the
server imports nothing of the course tooling.

The wired slots (:func:`labsupport.stack.serving_slots`) plug in as follows:

* ``prepare_step`` (lab 12): ``engine.runner.assemble``; step-wide;
* ``scheduler`` (lab 13): the engine's step decision (``engine.scheduler.decide``); step-wide;
* ``sampler`` (lab 13): the engine's per-row sampler (``PerRowSampler``); step-wide;
* ``stop_strings`` (lab 01): the back end's stop-string filter (``Backend.stop_filter``); per request;
* ``detokenizer`` (lab 01): each request's incremental detokenizer (``Backend.detokenizer``), reading
  the model tokenizer's token bytes through :class:`TokenBytes`; per request.

Every part is wrapped so that an exception it raises becomes a :class:`PartFailed` whose message names
the slot, the lab and the learner's line. The server's own failure handling does the rest: a step-wide
part that raises fails the requests of that step, a per-request part fails its request, and the
server goes on with the learner's part (the course's part is never substituted mid-run).

**A profile by slot** (the capstone, lab 16): every guarded call also adds its time to a
:class:`SlotProfile`, and so does every engine step, the learner's parts or not; ``GET /health`` then
says, under ``stack_profile``, each slot's calls and seconds, the steps' and the prefix cache's counts,
so a client can tell what each of the learner's parts cost in the step.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import linecache
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from ..engine.sampler import PerRowSampler
from ..stack import BY_NAME, Slot, serving_slots

MANIFEST_NAME = "stack.json"  # as labsupport.course.stack writes it


class PartFailed(RuntimeError):
    """A learner's part raised while serving; the message names the slot and the learner's line."""


def learner_line(exc: BaseException, file: str) -> str:
    """``file:line: source`` of the deepest frame of ``exc``'s traceback in the learner's module file."""
    where = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if os.path.abspath(frame.filename) == os.path.abspath(file):
            line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
            where = f"{frame.filename}:{frame.lineno}: {line}"
    return where or f"{file} (no line of it in the traceback)"


def _failed(slot: Slot, exc: BaseException, file: str) -> PartFailed:
    scope = "its request fails" if slot.name in ("stop_strings", "detokenizer") else "the step's requests fail"
    return PartFailed(f"your {slot.name} part (lab {slot.lab[:2]}, {slot.part}) raised {type(exc).__name__}: {exc} "
                      f"at {learner_line(exc, file)}; {scope}, the server goes on with your part")


class SlotProfile:
    """Calls and seconds (``time.perf_counter``, the call's whole time, its exceptions included) of
    each slot's part, and of the engine's steps under ``"step"``; the capstone's profile by slot."""

    def __init__(self):
        self._lock = threading.Lock()  # per-request parts run on the event loop, step-wide ones in the step's thread
        self.totals: dict[str, list] = {}

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            calls, total = self.totals.get(name, (0, 0.0))
            self.totals[name] = [calls + 1, total + seconds]

    def timed(self, name: str, fn):
        """``fn`` with its time added under ``name``."""
        @functools.wraps(fn)
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - started)
        return call

    def snapshot(self) -> dict[str, dict]:
        """``{name: {"calls": n, "seconds": s}}``."""
        with self._lock:
            return {name: {"calls": c, "seconds": s} for name, (c, s) in self.totals.items()}


PROFILE = SlotProfile()  # this server's; one server per process


def guarded(slot: Slot, fn, file: str, profile: SlotProfile | None = None):
    """``fn`` (a learner's function) with its exceptions turned into :class:`PartFailed`, and its time
    added to ``profile`` (default :data:`PROFILE`) under the slot's name."""
    profile = PROFILE if profile is None else profile

    @functools.wraps(fn)
    def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise _failed(slot, exc, file) from exc
        finally:
            profile.add(slot.name, time.perf_counter() - started)
    return call


class GuardedFilter:
    """A learner's stop-string filter, made on its first use (so its constructor raises where the
    request's tokens are sent, and fails that request alone), its ``push`` and ``flush`` guarded."""

    def __init__(self, slot: Slot, cls, file: str, stops):
        self._make = guarded(slot, lambda: cls(stops), file)
        self._slot, self._file, self._obj = slot, file, None

    def _filter(self):
        if self._obj is None:
            self._obj = self._make()
        return self._obj

    def push(self, text: str):
        return guarded(self._slot, self._filter().push, self._file)(text)

    def flush(self) -> str:
        return guarded(self._slot, self._filter().flush, self._file)()


def guarded_class(slot: Slot, cls, file: str):
    """A factory like ``cls`` whose objects' constructor and methods are guarded."""
    return lambda stops: GuardedFilter(slot, cls, file, stops)


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's spelling of bytes as characters (GPT-2's, used by SmolLM2 and Qwen): the
    printable Latin-1 bytes stand for themselves, the other 68 bytes for the characters from U+0100 on,
    in byte order. Returns character -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return {c: b for b, c in chars.items()}


class TokenBytes:
    """Lab 01's detokenizer reads ``tokenizer.token_bytes(id)``; the model's tokenizer (byte-level BPE)
    spells each token's bytes as characters (:func:`_byte_alphabet`). This gives the bytes back; a
    special token's bytes are its string in UTF-8, as the course tokenizer's are."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "_backend", None)  # the tokenizers.Tokenizer of a ModelTokenizer
        if backend is None or not hasattr(tokenizer, "_special"):
            raise ValueError(f"your detokenizer reads token bytes, which the served tokenizer "
                             f"({type(tokenizer).__name__}) does not give")
        self._alphabet = _byte_alphabet()
        self._token = backend.id_to_token
        self._special = {i: s for s, i in tokenizer._special.items()}
        strange = [i for i in range(tokenizer.vocab_size) if i not in self._special
                   and any(c not in self._alphabet for c in (self._token(i) or "\x00"))]
        if strange:
            raise ValueError(f"the model's tokenizer is not byte-level BPE (token {strange[0]} is "
                             f"{self._token(strange[0])!r}): your detokenizer cannot read its tokens' bytes")

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._special:
            return self._special[token_id].encode("utf-8")
        return bytes(self._alphabet[c] for c in self._token(int(token_id)))


class GuardedDetokenizer:
    """A learner's detokenizer over the model tokenizer's bytes, made on its first use (as
    :class:`GuardedFilter`), its ``push`` and ``flush`` guarded."""

    def __init__(self, slot: Slot, cls, file: str, token_bytes: TokenBytes):
        self._make = guarded(slot, lambda: cls(token_bytes), file)
        self._slot, self._file, self._obj = slot, file, None

    def _detokenizer(self):
        if self._obj is None:
            self._obj = self._make()
        return self._obj

    def push(self, token_id: int) -> str:
        return guarded(self._slot, self._detokenizer().push, self._file)(token_id)

    def flush(self) -> str:
        return guarded(self._slot, self._detokenizer().flush, self._file)()


def load_parts(manifest: Path) -> dict[str, tuple[object, str]]:
    """slot -> (the learner's part, its module file) for every wired slot the manifest gives the learner."""
    data = json.loads(Path(manifest).read_text(encoding="utf-8"))
    wired = {s.name for s in serving_slots()}
    modules: dict[str, object] = {}
    parts = {}
    for name, where in data.get("parts", {}).items():
        if name not in wired:
            continue
        file = where["file"]
        if file not in modules:
            module_name = Path(file).stem
            spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                raise ValueError(f"--stack: your lab {where['lab']} module {file} raised when imported "
                                 f"({type(exc).__name__}: {exc}); run python -m labsupport stack again") from exc
            modules[file] = module
        parts[name] = (getattr(modules[file], where["name"]), file)
    return parts


def assemble_stack(labs_dir: str, cache_dir: str | None = None) -> tuple[Path, str]:
    """Run ``python -m labsupport stack`` on ``labs_dir`` in a subprocess; returns the manifest's path and
    the table it printed (a ValueError with its message if it failed)."""
    cache = Path(cache_dir).expanduser() if cache_dir else (
        Path(os.environ.get("LABSUPPORT_CACHE") or Path.home() / ".cache" / "labsupport").expanduser() / "stack")
    proc = subprocess.run([sys.executable, "-m", "labsupport", "stack", str(labs_dir), "--cache", str(cache)],
                          capture_output=True, text=True)
    if proc.returncode:
        raise ValueError(f"--stack {labs_dir}: assembly failed: {(proc.stderr or proc.stdout).strip()[-800:]}")
    return cache / MANIFEST_NAME, proc.stdout.strip()


def plug_in(backend, parts: dict[str, tuple[object, str]]) -> list[str]:
    """Plug the learner's parts into ``backend`` (a ContinuousBackend for the engine's slots); returns
    the slots plugged in. A ValueError where a part cannot go into this back end."""
    done = []
    engine = getattr(backend, "engine", None)
    engine_slots = [n for n in ("prepare_step", "scheduler", "sampler") if n in parts]
    if engine_slots and engine is None:
        raise ValueError(f"--stack: your {', '.join(engine_slots)} part(s) serve in the continuous engine: "
                         f"add --engine continuous")
    if "sampler" in parts and getattr(engine, "speculative", None) is not None:
        raise ValueError("--stack: your sampler cannot serve with speculative decoding (the engine verifies "
                         "drafts with its own sampler): leave out --num-speculative-tokens")
    for name, (part, file) in parts.items():
        slot = BY_NAME[name]
        if name == "prepare_step":
            engine.runner.assemble = guarded(slot, part, file)
        elif name == "scheduler":
            engine.scheduler.decide = guarded(slot, part, file)
        elif name == "sampler":
            engine.sampler = PerRowSampler(guarded(slot, part, file))
        elif name == "stop_strings":
            backend.stop_filter = guarded_class(slot, part, file)
        elif name == "detokenizer":
            tok = getattr(backend.tokenizer, "bpe", backend.tokenizer)  # the course model's: its BPE has token_bytes
            token_bytes = tok if callable(getattr(tok, "token_bytes", None)) else TokenBytes(tok)
            backend.detokenizer = functools.partial(GuardedDetokenizer, slot, part, file, token_bytes)
        else:
            continue
        done.append(name)
    if done:
        backend.description += f" Your stack's parts serve: {', '.join(done)}."
    _profile(backend, PROFILE)
    return done


def _profile(backend, profile: SlotProfile) -> None:
    """Time every engine step too, and add ``stack_profile`` to the back end's stats (``/health``)."""
    engine = getattr(backend, "engine", None)
    if engine is not None:
        engine.step = profile.timed("step", engine.step)
    own_stats = backend.stats

    def stats() -> dict:
        found = {"slots": profile.snapshot()}
        if engine is not None:
            found["prefix_cache"] = engine.block_manager.stats()  # queries and hits in prompt tokens
        return {**own_stats(), "stack_profile": found}
    backend.stats = stats
