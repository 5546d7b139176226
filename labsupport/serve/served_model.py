"""What the course server serves: a model, its tokenizer (interface A), and what it says about them.

:class:`ServedModel` is the one object both back ends take. Two kinds exist:

* :func:`course_model`: the course model (chapter 02's small decoder with **random weights**, seed
  ``--seed``; its text is meaningless) with the course tokenizer of chapter 01 behind
  :class:`CourseTokenizer`, an adapter giving it the served-tokenizer interface (A) the real
  tokenizer also has: ``encode`` (special-token strings stay text), ``decode``, ``detokenizer()``,
  ``eos_token_ids``, a chat template and ``save_pretrained``.
* :func:`checkpoint_model`: a real checkpoint through ``labsupport.checkpoints.load`` (interface B),
  imported only when ``--model`` asks for one.

**The course chat template.** The course tokenizer has one special token, ``<|endoftext|>``, and
the labs store outputs computed with its vocabulary and the course model's shape, so the template
adds no token: every turn opens with ``<|endoftext|>``, then the role and a newline in plain text,
then the content; the generation prompt is ``<|endoftext|>assistant\\n``. The model's end of text is
also the end of its turn (the next turn would open with it). Roles: ``system``, ``user``,
``assistant``. The template's ``<|endoftext|>`` is the only special id in a prompt: the same string
typed inside a message is encoded as text (:meth:`CourseTokenizer.apply_chat_template` builds the
ids turn by turn, and a test checks they equal what ``transformers`` renders from the Jinja template).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path

from ..models import ModelConfig, get_model
from ..tokenizer import END_OF_TEXT, BPETokenizer, IncrementalDetokenizer, course_tokenizer
from ..transformer import Transformer

#: The model preset whose shape the course model takes (with the tokenizer's vocabulary size).
BASE_PRESET = "tiny-2m"
MODEL_NAME = "course-tiny"
WEIGHTS_NOTE = (
    "random weights (seed {seed}), not trained: the text it generates is meaningless. It serves to "
    "measure a request's journey, not to answer anything."
)
CHAT_ROLES = ("system", "user", "assistant")
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('the course chat template knows the roles system, user and assistant, not ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|endoftext|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|endoftext|>assistant\\n' }}{%- endif -%}"
)


def cache_dir() -> Path:
    """Where the course keeps files it makes (``$LABSUPPORT_CACHE``, else ``~/.cache/labsupport``)."""
    return Path(os.environ.get("LABSUPPORT_CACHE") or Path.home() / ".cache" / "labsupport").expanduser()


def course_model_config(vocab_size: int, base: str = BASE_PRESET) -> ModelConfig:
    """The shape of the course model: the ``base`` preset with the tokenizer's vocabulary."""
    return dataclasses.replace(get_model(base), name=MODEL_NAME, vocab_size=vocab_size, source="course server")


def check_messages(messages, roles=CHAT_ROLES) -> list[dict]:
    """``messages`` as a list of ``{"role", "content"}`` with text content, or a ValueError naming
    what is wrong (interface A's rule for ``apply_chat_template``)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        if message["role"] not in roles:
            raise ValueError(f"messages[{i}] has the role {message['role']!r}; this model's chat template knows "
                             f"{', '.join(roles)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}]['content'] must be a string")
        out.append({"role": message["role"], "content": message["content"]})
    return out


class CourseTokenizer:
    """The course BPE (chapter 01) behind the served-tokenizer interface (A).

    ``encode`` runs the Hugging Face export of the same BPE (:mod:`labsupport.serve.hf_tokenizer`),
    which gives the same ids in time linear-logarithmic in the text; the export is made once per
    Python version and kept under :func:`cache_dir`."""

    chat_template = CHAT_TEMPLATE
    bos_token_id = None

    def __init__(self, bpe: BPETokenizer | None = None):
        self.bpe = course_tokenizer() if bpe is None else bpe
        self.name = "course BPE (labsupport/data/course_tokenizer.json, chapter 01)"
        self.vocab_size = self.bpe.vocab_size
        self.eos_token_ids = (self.bpe.end_of_text_id,)
        self._turn_id = self.bpe.end_of_text_id
        #: The most UTF-8 bytes one token of ``encode`` stands for: a prompt of more bytes than
        #: ``context * max_token_bytes`` cannot fit the context, whatever its tokens.
        self.max_token_bytes = max(len(self.bpe.token_bytes(i)) for i in range(256 + len(self.bpe.merges)))
        self.special_token_ids = frozenset(self.bpe.special_tokens.values())  # what skip_special_tokens skips
        self.prompt_prefix, self.prompt_suffix = (), ()  # nothing is added around a prompt

    # -- text --

    @functools.cached_property
    def _export(self) -> Path:
        """The Hugging Face export of this BPE, made once per Python (Unicode tables) and kept."""
        from .hf_tokenizer import export_stamp, write_pretrained

        stamp = export_stamp(self.bpe)
        name = f"course-bpe-{stamp['tokenizer_sha256']}-py{stamp['python']}-unicode{stamp['unicode']}"
        return write_pretrained(self.bpe, cache_dir() / "exports" / name, chat_template=CHAT_TEMPLATE,
                                eos_token=END_OF_TEXT)

    @functools.cached_property
    def _fast(self):
        """The export as a ``tokenizers.Tokenizer`` (built in memory if the cache cannot be written),
        or None without the ``tokenizers`` package: then the course's own BPE encodes, which is
        quadratic in one long word but bounded by the server's prompt-size check."""
        try:
            from tokenizers import Tokenizer
        except ImportError:
            return None
        try:
            tok = Tokenizer.from_file(str(self._export / "tokenizer.json"))
        except OSError:
            from .hf_tokenizer import hf_tokenizer

            return hf_tokenizer(self.bpe)
        tok.encode_special_tokens = True  # "<|endoftext|>" typed in text is text
        return tok

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (plain text: special-token strings stay text; no BOS). A ValueError
        for text UTF-8 cannot encode (a lone surrogate)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"the text holds a lone surrogate U+{ord(text[error.start]):04X} at character "
                             f"{error.start}, which UTF-8 cannot encode; send valid Unicode text") from None
        if self._fast is None:
            return self.bpe.encode(text)
        # encode_batch lets go of Python's interpreter lock while it works (encode holds it)
        return self._fast.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt's ids: :meth:`encode` (the course tokenizer adds nothing around a prompt)."""
        return self.encode(text)

    def decode(self, ids) -> str:
        return self.bpe.decode(ids)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.bpe)

    # -- chat --

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids of a conversation under :data:`CHAT_TEMPLATE`: per turn, the template's
        ``<|endoftext|>`` id and then ``role + "\\n" + content`` encoded as plain text."""
        ids: list[int] = []
        for message in check_messages(messages):
            ids += [self._turn_id, *self.encode(message["role"] + "\n" + message["content"])]
        if add_generation_prompt:
            ids += [self._turn_id, *self.encode("assistant\n")]
        return ids

    def save_pretrained(self, folder) -> Path:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (chat template, special tokens) into
        ``folder``, for ``transformers.AutoTokenizer.from_pretrained(folder)``; returns the folder."""
        from .hf_tokenizer import copy_pretrained

        return copy_pretrained(self._export, folder)


@dataclass
class ServedModel:
    """A model as the server serves it: ``name`` (the API's ``model``), the course ``Transformer``
    holding the weights, its tokenizer (interface A), whether its weights are ``trained``, where it
    came from, and the sentence ``/v1/models`` shows."""

    name: str
    model: Transformer
    tokenizer: object
    trained: bool
    source: str
    description: str

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def fingerprint(self) -> str:
        """The ``system_fingerprint`` of every response: says which weights answered."""
        weights = "trained-weights" if self.trained else "random-weights"
        return f"labsupport-{self.name}-{weights}"


def course_model(seed: int = 0, base: str = BASE_PRESET, device: str = "cpu") -> ServedModel:
    """The course model with random weights (``seed``) and the course tokenizer."""
    tokenizer = CourseTokenizer()
    cfg = course_model_config(tokenizer.vocab_size, base)
    return ServedModel(MODEL_NAME, Transformer(cfg, device=device, seed=seed), tokenizer, trained=False,
                       source=f"labsupport.models preset {base!r}, random weights (seed {seed})",
                       description=WEIGHTS_NOTE.format(seed=seed))


def checkpoint_model(source: str, device: str = "cpu", dequantizers=None) -> ServedModel:
    """A real checkpoint, loaded by ``labsupport.checkpoints.load`` (raises its ``CheckpointError``,
    a ValueError saying what is wrong and what to do); ``dequantizers``: a learner's GGUF
    dequantisers (``labsupport.checkpoints.Dequantizers``, ``--stack``)."""
    try:
        from .. import checkpoints  # heavy (the Hugging Face stack) and only for --model: imported here
    except ImportError as error:
        raise ValueError(f"--model needs labsupport.checkpoints, which this version of labsupport lacks "
                         f"({error}); serve the course model (leave out --model) or update labsupport") from None
    loaded = checkpoints.load(source, device=device, **({"dequantizers": dequantizers} if dequantizers else {}))
    weights = "trained weights" if loaded.trained else "random weights (not trained: its text is meaningless)"
    return ServedModel(loaded.name, loaded.model, loaded.tokenizer, trained=bool(loaded.trained),
                       source=str(loaded.source), description=f"{loaded.name}: {weights}, from {loaded.source}")
