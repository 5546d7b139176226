"""The model side of a learner's stack (issue 31): the slots that act where the model is loaded, sized
and run, plugged in by :func:`plug_model_side` for ``python -m labsupport.serve --stack``.

The engine side (:mod:`labsupport.serve.stack`) plugs into a back end that already exists; these
slots act earlier, so the server assembles the stack *before* it loads the model:

* ``rope`` (lab 08's ``apply_rope(x, positions, theta, layout)``): every layer's
  :attr:`labsupport.transformer.Attention.rope` hook rotates the queries and keys with it (halves
  layout, the model's ``rope_theta``). A model that scales its frequencies (``rope_scaling``) keeps
  the course's rotation: the exercise's interface takes only a base. Step-wide.

The learner's parts run guarded as the engine side's are (:func:`labsupport.serve.stack.guarded`):
one that raises while serving becomes a :class:`~labsupport.serve.stack.PartFailed` naming the slot
and the learner's line, the engine fails the step's requests, and the server goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..stack import BY_NAME
from .stack import guarded

MODEL_SLOTS = ("rope",)


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

    def plug(self, model) -> list[str]:
        """Plug the parts that act on the model's forward pass into ``model`` (a course
        Transformer); returns the slots plugged in."""
        done = []
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
