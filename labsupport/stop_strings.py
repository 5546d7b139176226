"""Stop strings in a stream of text (chapters 01 and 03).

A request's ``stop`` strings end its answer where one first appears, and the stop string itself is
not sent. A server streams text as tokens arrive, and a stop string can be split across tokens
(``"\\n\\nUser:"`` may come as ``"\\n"``, ``"\\nUs"``, ``"er:"``), so text that could still become
the start of a stop string is **held back** until the next piece says whether it does:

* when a stop string occurs in the text held plus the new piece, send what comes before the
  earliest occurrence (the earliest start, whichever stop string it is) and end the answer;
* otherwise hold the longest end of that text that is the beginning of some stop string (at most
  one character less than the longest stop string), and send the rest;
* when the answer ends another way (end of sequence, the length limit), send what is held.

Holding more than that delays text the client could already have (a client measuring time between
tokens sees a stall); holding less sends a piece of a stop string the answer must not contain. (A
simpler rule some servers use holds a fixed tail of the longest stop string's length less one
character: never wrong, but it delays every piece of every answer that has stop strings.)

:func:`split_at_stop` is the course's answer to lab 01's stop-string exercise (the course server's
back ends use it); the lab's learners write their own, and ``labsupport.checks.check_stop_strings``
compares the two on streams whose stop strings are split across pieces.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._answers import answer


@answer
def split_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str, bool]:
    """``(send, hold, stopped)`` for ``text``, the text held so far plus the newest piece.

    ``stopped`` is true when a stop string occurs in ``text``: ``send`` is then what comes before the
    earliest occurrence and ``hold`` is empty. Otherwise ``hold`` is the longest end of ``text`` that
    begins some stop string (shorter than that stop string) and ``send`` is the rest.
    """
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    if hits:
        return text[:min(hits)], "", True
    keep = 0  # the longest end of the text that begins some stop string
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:k]):
                keep = k
                break
    return text[:len(text) - keep], text[len(text) - keep:], False
