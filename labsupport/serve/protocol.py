"""The course server's request bodies: parsed and validated before anything reaches a back end.

:func:`parse_body` turns the raw bytes into a JSON object (every malformed body an HTTP 400 with
OpenAI's error body, never a 500); :func:`parse_completion` and :func:`parse_chat` check every field
of ``/v1/completions`` and ``/v1/chat/completions`` and return a :class:`Call`.

**The rule for fields.** Every field a request may carry is in one of three tables:

* honoured: OpenAI's parameters the server implements, and vLLM's sampling extensions it implements
  (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
  ``add_special_tokens``, ``add_generation_prompt``, ``stream_options.continuous_usage_stats``).
  ``add_special_tokens`` (completions, default true) adds around a text prompt what the model's
  tokenizer configuration adds, and nothing to a prompt of token ids; ``skip_special_tokens``
  (default true) leaves special tokens out of the text; ``spaces_between_special_tokens`` is taken
  at its default, true, which changes nothing here: the text is the tokenizer's own decoding, as
  vLLM's detokenizer for fast tokenizers gives it;
* accepted only at their neutral value (:data:`NEUTRAL`): parameters of OpenAI's API or vLLM's
  extensions the server does not implement. Sent with that value (or ``null``) they change nothing;
  with any other value the request is refused (HTTP 400 naming the field), so a client never
  believes it got what it asked for. Benchmark clients send some of them (``vllm bench serve``:
  ``logprobs: null``), which is why they are listed rather than refused;
* everything else is refused (HTTP 400, ``code: "unknown_parameter"``, naming the fields), as
  OpenAI's API does ("Unrecognized request argument supplied"). vLLM instead accepts unknown fields
  and only logs them, because clients send other servers' extensions; for a course, a typo such as
  ``max_token`` silently ignored is the worse surprise.

``null`` means a parameter's default, as in OpenAI's API.

**Ranges** are the ones the engine really accepts: ``temperature`` 0 to 2 (below 1e-5 it is greedy,
as in vLLM, since dividing logits by a tinier number overflows), ``top_p`` in (0, 1], ``top_k`` -1
(or 0: every token) or more, ``min_p`` in [0, 1], ``repetition_penalty`` from 0.01 to 100 (1 is off; the
prompt's tokens count as seen, as in vLLM; vLLM takes any value above 0, but past these a float32
logit can overflow), ``seed`` from -2**63 to 2**64 - 1 (what ``torch.Generator.manual_seed``
takes; a negative seed ``s`` draws as ``s + 2**64`` does; vLLM takes -2**63 to 2**63 - 1), token ids
inside the vocabulary, ``max_tokens`` from 1 to the server's limit, at most
:data:`MAX_STOP_STRINGS` stop strings of at most :data:`MAX_STOP_CHARS` characters. Text must be
valid Unicode (a lone surrogate such as ``"\\ud800"`` is refused).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field

from ..sampling import PENALTY_RANGE
from .backend import InvalidRequest

GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (vLLM's _SAMPLING_EPS)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64

#: Fields the server does not implement, with the values that mean "not used" (``null`` always does).
NEUTRAL: dict[str, tuple] = {
    # OpenAI's
    "n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False,), "top_logprobs": (0,), "suffix": ("",),
    "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none", "auto"),
    "functions": ([],), "function_call": ("none",), "response_format": ({"type": "text"},), "modalities": (["text"],),
    "audio": (), "prediction": (), "reasoning_effort": (), "web_search_options": (), "verbosity": (),
    "store": (False,), "parallel_tool_calls": (True, False),
    # vLLM's sampling extensions
    "length_penalty": (1,), "min_tokens": (0,), "use_beam_search": (False,),
    "include_stop_str_in_output": (False,), "spaces_between_special_tokens": (True,),
    "prompt_logprobs": (), "allowed_token_ids": (), "bad_words": ([],), "truncate_prompt_tokens": (),
    "continue_final_message": (False,), "chat_template": (), "chat_template_kwargs": ({},), "documents": (),
    "mm_processor_kwargs": ({},), "priority": (0,), "cache_salt": (), "return_tokens_as_token_ids": (False,),
    "structured_outputs": (), "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "logits_processors": (), "vllm_xargs": (), "kv_transfer_params": (),
}
#: Fields taken as they come and not used: who the end user is, labels for stored completions.
IGNORED = {"user": str, "metadata": dict, "service_tier": str}
SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
            "stop_token_ids", "ignore_eos", "skip_special_tokens", "stream", "stream_options"}
COMPLETION_FIELDS = SAMPLING | {"prompt", "add_special_tokens"}
CHAT_FIELDS = SAMPLING | {"messages", "max_completion_tokens", "add_generation_prompt", "add_special_tokens"}
MESSAGE_FIELDS = {"role", "content", "name"}


@dataclass(frozen=True)
class Call:
    """A validated request: the prompt (``prompt`` text or ids, or chat ``messages``), the options
    :meth:`Backend.prepare <labsupport.serve.backend.Backend.prepare>` takes, and how to answer."""

    chat: bool
    prompt: str | list[int] | None
    messages: list[dict] | None
    options: dict
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    ignored: tuple[str, ...] = field(default=())


def parse_body(raw: bytes, example: str) -> dict:
    """The JSON object of a request body; HTTP 400 for anything else (bad UTF-8, bad JSON, NaN,
    an integer of more digits than Python converts, nesting deeper than Python parses, not an object)."""
    def refuse_constant(name):
        raise ValueError(f"{name} is not JSON (JSON has no NaN or Infinity)")

    try:
        body = json.loads(raw, parse_constant=refuse_constant)
    except RecursionError:
        raise InvalidRequest("the JSON body is nested too deeply for this server to parse; send a flat JSON object"
                             f" such as {example}") from None
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError, as is a 5,001-digit int
        reason = str(error)[:200]
        if "integer string conversion" in reason:
            reason = f"a number in it has more than {sys.get_int_max_str_digits()} digits"
        raise InvalidRequest(f"We could not parse the JSON body of your request ({reason}). Send a JSON object such "
                             f"as {example}.") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}; send one such as "
                             f"{example}")
    return body


def text(value, name: str) -> str:
    """``value`` if it is a string that UTF-8 can encode, else HTTP 400 naming ``name``."""
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string, got {_kind(value)}", name.split("[")[0].split(".")[0])
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequest(f"{name} holds a lone surrogate (U+{ord(value[error.start]):04X} at character "
                             f"{error.start}), which is not Unicode text: send valid UTF-8",
                             name.split("[")[0].split(".")[0]) from None
    return value


def _kind(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def _integer(value, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {_kind(value)}", name)
    if value < low or (high is not None and value > high):
        shown = value if abs(value) < 10**30 else f"an integer of {len(str(abs(value)))} digits"
        span = f"at least {low}" if high is None else f"from {low} to {high}"
        raise InvalidRequest(f"{name} must be {span}, got {shown}", name)
    return value


def _number(value, name: str, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number, got {_kind(value)}", name)
    value = float(value) if not isinstance(value, int) or abs(value) < 10**300 else math.inf
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        raise InvalidRequest(f"{name} must be a number from {low} ({'excluded' if low_open else 'included'}) to "
                             f"{high}, got {value!r}", name)
    return value


def _boolean(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {_kind(value)}", name)
    return value


def _check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(k for k in body if k not in allowed and k not in NEUTRAL and k not in IGNORED)
    if unknown:
        shown = ", ".join(ascii(k) for k in unknown[:8])
        raise InvalidRequest(f"Unrecognized request argument supplied: {shown}. Leave it out; the server's fields "
                             f"are OpenAI's (and vLLM's sampling extensions).", unknown[0] if unknown[0].isascii()
                             else None, "unknown_parameter")
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] is not None and not any(_same(body[name], v) for v in neutral):
            raise InvalidRequest(f"{name} is not supported by the course server (leave it out, or send "
                                 f"{_neutral_text(neutral)})", name, "unsupported_parameter")
    for name, kind in IGNORED.items():
        if name in body and body[name] is not None and not isinstance(body[name], kind):
            raise InvalidRequest(f"{name} must be {_kind(kind())}, got {_kind(body[name])}", name)


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def _neutral_text(neutral: tuple) -> str:
    return " or ".join(json.dumps(v) for v in neutral) + " or null" if neutral else "null"


def _model(body: dict, served_name: str) -> None:
    model = body.get("model")
    if model is None:
        raise InvalidRequest("you must provide a model parameter", "model", "missing_required_parameter")
    model = text(model, "model")
    if model != served_name:
        raise InvalidRequest(f"The model {ascii(model)} does not exist. This server serves `{served_name}` "
                             f"(GET /v1/models).", "model", "model_not_found", status=404)


def _stops(value) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop must be a string or an array of at most {MAX_STOP_STRINGS} strings", "stop")
    out = []
    for i, s in enumerate(stops):
        s = text(s, f"stop[{i}]")
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise InvalidRequest(f"stop[{i}] must have 1 to {MAX_STOP_CHARS} characters, got {len(s)}", "stop")
        out.append(s)
    return tuple(dict.fromkeys(out))


def _stream(body: dict) -> tuple[bool, bool, bool]:
    stream = _boolean(body.get("stream", False), "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not isinstance(options, dict):
        raise InvalidRequest(f"stream_options must be an object, got {_kind(options)}", "stream_options")
    if not stream:
        raise InvalidRequest("stream_options can only be set when stream is true", "stream_options")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats", "include_obfuscation"})
    if unknown:
        raise InvalidRequest(f"stream_options has unknown fields: {', '.join(map(ascii, unknown))}", "stream_options")
    usage = options.get("include_usage")
    continuous = options.get("continuous_usage_stats")
    usage = False if usage is None else _boolean(usage, "stream_options.include_usage")
    continuous = False if continuous is None else _boolean(continuous, "stream_options.continuous_usage_stats")
    if options.get("include_obfuscation") is not None:
        _boolean(options["include_obfuscation"], "stream_options.include_obfuscation")  # no obfuscation is sent
    return stream, usage, continuous


def _sampling(body: dict, vocab_size: int, max_tokens_limit: int, max_tokens_field: str,
              default_max_tokens: int | None) -> dict:
    max_tokens = body.get(max_tokens_field, body.get("max_tokens", default_max_tokens))
    if max_tokens is not None:
        field_name = max_tokens_field if body.get(max_tokens_field) is not None else "max_tokens"
        _integer(max_tokens, field_name, 1)
        if max_tokens > max_tokens_limit:
            raise InvalidRequest(f"{field_name} is too large: {max_tokens}. This server generates at most "
                                 f"{max_tokens_limit} tokens per request.", field_name)
    temperature = _number(body.get("temperature", 0), "temperature", 0, 2)
    top_k = _integer(body.get("top_k", 0), "top_k", -1)
    stop_ids = body.get("stop_token_ids", [])
    if not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"stop_token_ids must be an array of at most {MAX_STOP_TOKEN_IDS} token ids",
                             "stop_token_ids")
    return {
        "max_tokens": max_tokens,
        "temperature": 0.0 if temperature < GREEDY_BELOW else temperature,
        "top_p": _number(body.get("top_p", 1), "top_p", 0, 1, low_open=True),
        "top_k": max(top_k, 0),
        "min_p": _number(body.get("min_p", 0), "min_p", 0, 1),
        "repetition_penalty": _number(body.get("repetition_penalty", 1), "repetition_penalty", *PENALTY_RANGE),
        "seed": None if body.get("seed") is None else _integer(body["seed"], "seed", *SEED_RANGE),
        "stop": _stops(body.get("stop", [])),
        "stop_token_ids": tuple(_integer(t, "stop_token_ids", 0, vocab_size - 1) for t in stop_ids),
        "ignore_eos": _boolean(body.get("ignore_eos", False), "ignore_eos"),
        "skip_special_tokens": _boolean(body.get("skip_special_tokens", True), "skip_special_tokens"),
    }


def _prompt(value, vocab_size: int):
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise InvalidRequest("the prompt is empty: give at least one character (or token id)", "prompt")
        return text(value, "prompt")
    if isinstance(value, list):
        if not value:
            raise InvalidRequest("the prompt is empty: give at least one character (or token id)", "prompt")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            raise InvalidRequest("prompt must be a string or a list of token ids; this server takes one prompt per "
                                 "request", "prompt")
        bad = next((i for i in value if not 0 <= i < vocab_size), None)
        if bad is not None:
            shown = bad if abs(bad) < 10**30 else f"of {len(str(abs(bad)))} digits"
            raise InvalidRequest(f"token id {shown} is outside the vocabulary [0, {vocab_size - 1}]", "prompt")
        return list(value)
    raise InvalidRequest(f"prompt must be a string or a list of token ids, got {_kind(value)}", "prompt")


def parse_completion(body: dict, served_name: str, vocab_size: int, max_tokens_limit: int) -> Call:
    """A ``/v1/completions`` body, validated (see the module docstring)."""
    body = {k: v for k, v in body.items() if v is not None}
    _check_fields(body, COMPLETION_FIELDS)
    _model(body, served_name)
    if "prompt" not in body:
        raise InvalidRequest("you must provide a prompt parameter", "prompt", "missing_required_parameter")
    prompt = _prompt(body["prompt"], vocab_size)
    options = _sampling(body, vocab_size, max_tokens_limit, "max_tokens", 16)  # 16: OpenAI's and vLLM's default
    options["add_special_tokens"] = _boolean(body.get("add_special_tokens", True), "add_special_tokens")
    stream, usage, continuous = _stream(body)
    return Call(False, prompt, None, options, stream, usage, continuous)


def _content(value, i: int) -> str:
    if isinstance(value, str):
        return text(value, f"messages[{i}].content")
    if isinstance(value, list):  # OpenAI's content parts: text ones are taken, joined by newlines (as vLLM does)
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise InvalidRequest(f"messages[{i}].content[{j}] must be an object with a string type", "messages")
            if part["type"] != "text":
                raise InvalidRequest(f"messages[{i}].content[{j}] is of type {ascii(part['type'])}: this model takes "
                                     f"text only, so send text parts ({{\"type\": \"text\", \"text\": ...}})",
                                     "messages", "unsupported_content")
            if set(part) - {"type", "text"}:
                raise InvalidRequest(f"messages[{i}].content[{j}] has unknown fields "
                                     f"{', '.join(map(ascii, sorted(set(part) - {'type', 'text'})))}", "messages")
            texts.append(text(part.get("text"), f"messages[{i}].content[{j}].text"))
        return "\n".join(texts)
    if value is None:
        raise InvalidRequest(f"messages[{i}].content is null: tool calls are not supported, so every message needs "
                             f"text content", "messages")
    raise InvalidRequest(f"messages[{i}].content must be a string or an array of text parts, got {_kind(value)}",
                         "messages")


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty array of {\"role\": ..., \"content\": ...} objects",
                             "messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object, got {_kind(message)}", "messages")
        extra = sorted(k for k in message if k not in MESSAGE_FIELDS and message[k] is not None)
        if extra:
            raise InvalidRequest(f"messages[{i}] has fields this server does not support: "
                                 f"{', '.join(map(ascii, extra))} (tool calls are not supported)", "messages")
        if "role" not in message:
            raise InvalidRequest(f"messages[{i}] has no role", "messages")
        role = text(message["role"], f"messages[{i}].role")
        if message.get("name") is not None:
            text(message["name"], f"messages[{i}].name")
        out.append({"role": role, "content": _content(message.get("content"), i)})
    return out


def parse_chat(body: dict, served_name: str, vocab_size: int, max_tokens_limit: int) -> Call:
    """A ``/v1/chat/completions`` body, validated (see the module docstring). ``max_tokens`` (or
    ``max_completion_tokens``, which wins) left out means the rest of the context."""
    body = {k: v for k, v in body.items() if v is not None}
    _check_fields(body, CHAT_FIELDS)
    _model(body, served_name)
    if "messages" not in body:
        raise InvalidRequest("you must provide a messages parameter", "messages", "missing_required_parameter")
    messages = _messages(body["messages"])
    options = _sampling(body, vocab_size, max_tokens_limit, "max_completion_tokens", None)
    options["add_generation_prompt"] = _boolean(body.get("add_generation_prompt", True), "add_generation_prompt")
    if _boolean(body.get("add_special_tokens", False), "add_special_tokens"):
        raise InvalidRequest("add_special_tokens must be false for chat: the chat template adds the special tokens",
                             "add_special_tokens")
    stream, usage, continuous = _stream(body)
    return Call(True, None, messages, options, stream, usage, continuous)
