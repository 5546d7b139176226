"""The model side of a learner's stack (issue 31): the slots that act where the model is loaded, sized
and run, plugged in by :func:`plug_model_side` for ``python -m labsupport.serve --stack``.

The engine side (:mod:`labsupport.serve.stack`) plugs into a back end that already exists; these
slots act earlier, so the server assembles the stack *before* it loads the model:

* ``dequantize_q8_0`` and ``dequantize_q4_1`` (lab 09): read the GGUF file's Q8_0 and Q4_1 blocks
  while the model loads (:class:`labsupport.checkpoints.Dequantizers`), in place of the ``gguf``
  package. Their conversion is cached apart from the course's, in the course's cache folder
  (``$LABSUPPORT_CACHE/checkpoints``, never the learner's folder), keyed by a hash of the learner's
  module file: the learner's weights never stand in for the course's, nor the other way round. A
  dequantiser that raises (or returns the wrong shape) stops the start-up with a message naming the
  slot and the learner's line: there is no request yet to fail. With the course model (no
  ``--model``) there is no GGUF file, and they are not used (the description says so);
* ``rope`` (lab 08's ``apply_rope(x, positions, theta, layout)``): every layer's
  :attr:`labsupport.transformer.Attention.rope` hook rotates the queries and keys with it (halves
  layout, the model's ``rope_theta``). A model that scales its frequencies (``rope_scaling``) keeps
  the course's rotation: the exercise's interface takes only a base. Step-wide.

The learner's parts run guarded as the engine side's are (:func:`labsupport.serve.stack.guarded`):
one that raises while serving becomes a :class:`~labsupport.serve.stack.PartFailed` naming the slot
and the learner's line, the engine fails the step's requests, and the server goes on.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from ..stack import BY_NAME
from .served_model import checkpoint_model
from .stack import guarded, learner_line

DEQUANTIZE_SLOTS = {"dequantize_q8_0": "Q8_0", "dequantize_q4_1": "Q4_1"}  # slot -> the GGUF block type it reads
MODEL_SLOTS = (*DEQUANTIZE_SLOTS, "rope")


def _at_load(slot: str, fn, file: str):
    """A learner's load-time part: an exception it raises stops the start-up, as a ValueError naming
    the slot and the learner's line (the server's start-up errors are ValueErrors)."""
    s = BY_NAME[slot]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise ValueError(f"--stack: your {slot} part (lab {s.lab[:2]}, {s.part}) raised {type(exc).__name__}: "
                             f"{exc} at {learner_line(exc, file)} while the model's weights were read; the server "
                             f"cannot start with it: fix it and run python -m labsupport stack again") from exc
    return call


def owner_of(files) -> str:
    """Whose dequantisers: ``yours-`` and a hash of the learner's module files' text (a changed cell is
    another owner, with a cache entry of its own)."""
    digest = hashlib.sha256()
    for file in sorted(set(files)):
        digest.update(Path(file).read_bytes())
    return f"yours-{digest.hexdigest()[:12]}"


def rope_hook(apply_rope, theta: float):
    """The :attr:`Attention.rope` hook of a learner's ``apply_rope(x, positions, theta, layout)``:
    queries and keys rotated alike, in the halves layout the course model's weights use."""
    def rope(q, k, positions):
        return apply_rope(q, positions, theta, "halves"), apply_rope(k, positions, theta, "halves")
    return rope


@dataclass
class ModelSide:
    """The model-side parts of an assembled stack (slot -> (part, its module file)), and what
    plugging them in said (:attr:`notes`: a line per slot whose part could not serve, and why)."""

    parts: dict[str, tuple[object, str]]
    notes: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)  # the slots that read the served model's weights
    checkpoint: bool = False  # load() was asked for a checkpoint (not the course model)

    def dequantizers(self):
        """The learner's dequantisers as the loader takes them, or None where none is the learner's."""
        from ..checkpoints import Dequantizers  # the Hugging Face stack: only with --model

        mine = {slot: self.parts[slot] for slot in DEQUANTIZE_SLOTS if slot in self.parts}
        if not mine:
            return None
        by_type = {DEQUANTIZE_SLOTS[slot]: _at_load(slot, part, file) for slot, (part, file) in mine.items()}
        return Dequantizers(by_type, owner_of(file for _, file in mine.values()))

    def load(self, source: str):
        """The checkpoint ``source`` as the server serves it (a ServedModel), its GGUF blocks read by
        the learner's dequantisers where they are the learner's."""
        from ..checkpoints import resolve

        self.checkpoint = True
        dequantizers = self.dequantizers()
        if dequantizers is not None and resolve(source)[1].suffix != ".gguf":
            self.notes.append(f"dequantize_q8_0, dequantize_q4_1: {source} is not a GGUF file, so your "
                              f"dequantisers are not used")
            dequantizers = None
        served = checkpoint_model(source, dequantizers=dequantizers)
        if dequantizers is not None:
            self.loaded = [slot for slot in DEQUANTIZE_SLOTS if slot in self.parts]
        return served

    def plug(self, model) -> list[str]:
        """Plug the parts that act on the model's forward pass into ``model`` (a course
        Transformer); returns the slots plugged in, with those that read its weights first."""
        done = list(self.loaded)
        unused = [slot for slot in DEQUANTIZE_SLOTS if slot in self.parts and slot not in self.loaded]
        if unused and not self.checkpoint:
            self.notes.append(f"{', '.join(unused)}: the course model is not read from a GGUF file, so your "
                              f"dequantisers are not used (serve one with --model smollm2-135m-instruct)")
        if "rope" in self.parts:
            part, file = self.parts["rope"]
            if model.cfg.rope_scaling is not None:
                self.notes.append(f"rope: {model.cfg.name} scales its RoPE frequencies ({model.cfg.rope_scaling}); "
                                  f"your apply_rope takes only a base, so the course's rotation serves")
            else:
                hook = guarded(BY_NAME["rope"], rope_hook(part, model.cfg.rope_theta), file)
                for layer in model.layers:
                    layer.attention.rope = hook
                done.append("rope")
        return done


def model_side(parts: dict[str, tuple[object, str]]) -> ModelSide:
    """The model-side slots of ``parts`` (what :func:`labsupport.serve.stack.load_parts` returned)."""
    return ModelSide({name: parts[name] for name in MODEL_SLOTS if name in parts})


def plug_model_side(backend, side: ModelSide) -> list[str]:
    """Plug ``side``'s parts into ``backend``'s model; returns the slots plugged in and adds a sentence
    saying so (and what could not serve) to the back end's description."""
    done = side.plug(backend.model)
    if done:
        backend.description += f" Your stack's model-side parts serve: {', '.join(done)}."
    for note in side.notes:
        backend.description += f" {note}."
    return done
