"""A real model's own tokenizer and chat template, served safely (chapter 01).

:class:`ModelTokenizer` wraps the Hugging Face tokenizer a checkpoint ships (``tokenizer.json``, or
the vocabulary inside a GGUF file, converted by ``transformers``): the encoding is the ecosystem's,
not a re-implementation. What it adds is the serving contract the course server relies on
(interface A in the course's notes; :mod:`labsupport.checkpoints` builds one for every model it
loads):

* ``encode(text)`` treats the text as text. Hugging Face's default ``tokenizer(text)`` matches
  special-token strings anywhere in its input, so a user who types ``<|im_end|>`` gets the id that
  ends a turn. Here that string is spelled with ordinary tokens.
* ``apply_chat_template(messages)`` renders the model's own Jinja template (through transformers,
  so the rendering is the reference's), then tokenises it so that only the special tokens *the
  template wrote* become special ids; the same strings inside a message's content stay text. For
  content without such strings the ids are exactly transformers' ``apply_chat_template(...,
  tokenize=True)`` (tested). Chapter 01 shows the role injection this prevents.
* ``encode_prompt(text)``: a completion prompt's ids as the saved tokenizer gives them (``encode``
  plus what its post-processor adds, such as a BOS; SmolLM2's adds nothing); ``max_token_bytes``:
  the byte bound a server checks before encoding; ``special_token_ids``: what ``skip_special_tokens``
  leaves out of an answer.
* ``eos_token_ids``: every id that ends generation, ``detokenizer()``: UTF-8-safe streaming text,
  ``save_pretrained``: files ``AutoTokenizer`` (and so guidellm, ``vllm bench serve``) loads.

How it works: the template is rendered twice, once as given and once with every special-token
string inside the messages replaced by placeholder characters of the same length. Where the second
rendering has a special token, the template wrote it; the text between two of them is taken from
the first rendering and encoded with special-token matching off (the ``tokenizers`` library's
``encode_special_tokens``). Hugging Face splits its input at special tokens before anything else,
so each piece is encoded exactly as it would encode it.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool")
# A private-use character: stands in for each character of a special-token string inside a message
# while the template is rendered the second time (it cannot itself form a special token).
_PLACEHOLDER = "\ue000"


class ModelTokenizer:
    """A checkpoint's own tokenizer (a ``transformers`` fast tokenizer) with the course's serving
    contract. Build one with :meth:`from_pretrained` (a folder holding ``tokenizer.json``) or
    :meth:`from_gguf`; :func:`labsupport.checkpoints.load` does it for you.

    ``name``: where it came from; ``eos_token_ids``: every id that ends generation (the model's
    EOS, end-of-turn and those its generation config lists); ``bos_token_id``: or None.
    """

    def __init__(self, hf_tokenizer, name: str, eos_token_ids: Iterable[int] = ()):
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"{name}: a fast (tokenizers-backed) Hugging Face tokenizer is needed, got "
                f"{type(hf_tokenizer).__name__}"
            )
        self.name = str(name)
        self.hf = hf_tokenizer
        self._backend = backend
        # The same tokenizer with special-token matching off: special strings in the text are text.
        self._plain = copy.deepcopy(backend)
        self._plain.encode_special_tokens = True
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self._special = {tok.content: i for i, tok in added.items() if tok.special}
        self._special_ids = frozenset(self._special.values())
        ids = [int(i) for i in eos_token_ids]
        if hf_tokenizer.eos_token_id is not None:
            ids.append(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        #: The ids ``skip_special_tokens`` leaves out of an answer's text (Hugging Face's special added tokens).
        self.special_token_ids: frozenset[int] = self._special_ids
        #: What the tokenizer itself puts around a text prompt with ``add_special_tokens=True`` (its
        #: post-processor: a BOS for Llama 2, nothing for SmolLM2): ``encode_prompt`` adds the same.
        self.prompt_prefix, self.prompt_suffix = self._affixes()
        #: The most UTF-8 bytes one token of ``encode`` stands for: a text of more bytes than
        #: ``context * max_token_bytes`` has more than ``context`` tokens, so a server refuses it
        #: before encoding (exact for a tokenizer whose normalizer, if any, never shortens the text).
        self.max_token_bytes: int = self._longest_token_bytes()

    def _affixes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        bare = self._plain.encode("a", add_special_tokens=False).ids
        full = self._plain.encode("a", add_special_tokens=True).ids
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
        if at is None:  # a post-processor that changes the text's own ids: add nothing rather than guess
            return (), ()
        return tuple(full[:at]), tuple(full[at + len(bare):])

    def _longest_token_bytes(self) -> int:
        """The longest token's text in UTF-8 bytes (one more for a decoder that drops a leading
        space, such as SentencePiece's), the added tokens' strings included."""
        decode = self._backend.decode
        longest = max(len(decode([i], skip_special_tokens=False).encode("utf-8")) for i in range(self.vocab_size))
        return max(1, longest + 1)

    # -- construction --

    @classmethod
    def from_pretrained(cls, folder, name: str | None = None, eos_token_ids: Iterable[int] = ()) -> ModelTokenizer:
        """The tokenizer saved in ``folder`` (``tokenizer.json`` and ``tokenizer_config.json``)."""
        # transformers is imported here: an optional dependency (labsupport[model]), not one a lab needs
        from transformers import AutoTokenizer

        folder = Path(folder)
        return cls(AutoTokenizer.from_pretrained(folder), name or folder.name, eos_token_ids)

    @classmethod
    def from_gguf(cls, path, name: str | None = None, eos_token_ids: Iterable[int] = ()) -> ModelTokenizer:
        """The tokenizer described by a GGUF file's metadata, converted by transformers (the same
        conversion ``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` performs)."""
        from transformers import AutoTokenizer  # optional dependency, see from_pretrained

        path = Path(path)
        hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return cls(hf, name or path.stem, eos_token_ids)

    # -- text --

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text: no BOS, and special-token strings inside it (such as
        ``<|im_start|>``) are spelled with ordinary tokens, never turned into special ids."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        # encode_batch, not encode: it lets go of Python's interpreter lock while it works (encode
        # holds it, about two seconds per MB here), so a server's event loop runs beside it
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt's ids: :meth:`encode`, with what the tokenizer's own configuration
        adds around a text (:attr:`prompt_prefix`, :attr:`prompt_suffix`) when ``add_special_tokens``,
        so the count equals ``AutoTokenizer.from_pretrained(saved folder)(text)``'s (vLLM's rule)."""
        ids = self.encode(text)
        return [*self.prompt_prefix, *ids, *self.prompt_suffix] if add_special_tokens else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (special tokens written out unless ``skip_special_tokens``)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"decode: token ids must be in [0, {self.vocab_size - 1}], got {bad[:5]}")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self) -> IncrementalDetokenizer:
        """A new incremental detokenizer: ``push(id) -> text`` as it becomes final, ``flush()``."""
        return IncrementalDetokenizer(self)

    # -- chat --

    @property
    def chat_template(self) -> str | None:
        """The model's own Jinja chat template, or None if it has none."""
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) else None

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """The ids of ``messages`` rendered by the model's template, ready to prefill.

        Each message is ``{"role": one of system/user/assistant/tool, "content": str}`` (a list of
        ``{"type": "text", "text": ...}`` parts is joined with newlines, as vLLM joins them for such
        templates). Special-token strings inside the content stay text. ValueError for no template,
        no messages, an unknown role or content that is not text.
        """
        if self.chat_template is None:
            raise ValueError(
                f"{self.name} has no chat template: use encode() on a prompt of your own, or load a chat "
                f"(instruct) model"
            )
        messages = _checked_messages(messages)
        rendered = self._render(messages, add_generation_prompt)
        defused = self._render([dict(m, content=self._defuse(m["content"])) for m in messages], add_generation_prompt)
        if len(defused) != len(rendered):
            raise ValueError(
                f"{self.name}'s chat template changes the length of what it is given, so the special tokens it "
                f"writes cannot be told from those in the messages; this tokenizer cannot render it safely"
            )
        ids: list[int] = []
        start = 0
        for match in self._special_pattern().finditer(defused):
            ids += self.encode(rendered[start:match.start()])
            ids.append(self._special[match.group()])
            start = match.end()
        return ids + self.encode(rendered[start:])

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The template's text for ``messages`` (for reading; :meth:`apply_chat_template` gives the ids)."""
        if self.chat_template is None:
            raise ValueError(f"{self.name} has no chat template")
        return self._render(_checked_messages(messages), add_generation_prompt)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _defuse(self, text: str) -> str:
        return self._special_pattern().sub(lambda m: _PLACEHOLDER * len(m.group()), text)

    def _special_pattern(self) -> re.Pattern:
        if not hasattr(self, "_pattern"):
            strings = sorted(self._special, key=len, reverse=True)  # the longest first, as tokenizers matches
            self._pattern = re.compile("|".join(map(re.escape, strings)) or r"(?!)")
        return self._pattern

    # -- files --

    def save_pretrained(self, folder) -> Path:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (chat template and special tokens
        inside it) to ``folder``, so ``transformers.AutoTokenizer.from_pretrained(folder)`` loads
        the same tokenizer; returns the folder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.hf.save_pretrained(folder, save_jinja_files=False)
        return folder

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        template = "a chat template" if self.chat_template else "no chat template"
        eos = ", ".join(f"{self._backend.id_to_token(i)!s} ({i})" for i in self.eos_token_ids)
        return f"ModelTokenizer({self.name!r}: {self.vocab_size:,} tokens, {template}, stops at {eos or 'nothing'})"


def _checked_messages(messages) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty: give at least one {'role': 'user', 'content': ...} message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}] has role {role!r}; accepted roles: {', '.join(ROLES)}")
        out.append(dict(message, content=_text_of(message.get("content"), i)))
    return out


def _text_of(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"messages[{i}].content has a part of type {kind!r}; only text parts "
                                 f"({{'type': 'text', 'text': ...}}) are read")
            parts.append(part["text"])
        return "\n".join(parts)
    raise ValueError(f"messages[{i}].content must be a string (or a list of text parts), got "
                     f"{type(content).__name__}")


class IncrementalDetokenizer:
    """Text of a stream of token ids, emitted as soon as it is final and never half a character.

    Decoding one id at a time is wrong for byte-level vocabularies (a character can span tokens)
    and for those whose spacing depends on the previous token, so this decodes a short window of
    recent ids and emits what the newest ids added, holding it back while it ends in an incomplete
    character (U+FFFD). The offsets are the ones vLLM and text-generation-inference keep.
    """

    def __init__(self, tokenizer: ModelTokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # ids before this one are fully emitted
        self._read = 0  # ids before this one are decoded into emitted text

    def push(self, token_id: int) -> str:
        """Add one id; return the text that became final (possibly "")."""
        self._ids.append(int(token_id))
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        after = self._tokenizer.decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            del self._ids[:self._prefix]  # keep only the window the next decode needs
            self._read -= self._prefix
            self._prefix = 0
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """The rest of the text, whatever it ends with; the detokenizer is then empty."""
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        after = self._tokenizer.decode(self._ids[self._prefix:])
        self._ids, self._prefix, self._read = [], 0, 0
        return after[len(before):]


# ChatML, the template family of SmolLM2 and Qwen: each turn is <|im_start|>role\ncontent<|im_end|>\n.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chatml_tokenizer(text: str | None = None, vocab_size: int = 512) -> ModelTokenizer:
    """A small byte-level BPE trained here (on ``text``, by default the course corpus) with ChatML's
    special tokens and template: a real Hugging Face tokenizer for pages and tests that need one
    without loading a checkpoint (chapter 01's role-injection demonstration)."""
    # tokenizers and transformers are imported here: optional dependencies (labsupport[model])
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from .tokenizer import course_corpus

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([course_corpus() if text is None else text], trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                 unk_token="<|endoftext|>")
    hf.chat_template = CHATML_TEMPLATE
    return ModelTokenizer(hf, "course ChatML BPE")
