"""The command line of ``python -m labsupport.serve``: parse options, build the back end, run uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import shlex
import signal
import socket
import sys
from pathlib import Path

import torch
import uvicorn

from ..cpu_linear import prepack
from ..models import get_model, list_models
from .app import BODY_TIMEOUT_S, MAX_BODY_BYTES, create_app
from .continuous import ContinuousBackend
from .fifo import FifoBackend
from .guidellm import GUIDELLM_VERSION, startup_command
from .process import LISTENING
from .served_model import BASE_PRESET, cache_dir, checkpoint_model, course_model
from .stack import assemble_stack, load_parts, plug_in
from .stack_model import model_side, plug_model_side
from .timeouts import HEADER_TIMEOUT_S, timed_protocol

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m labsupport.serve",
        description="The course's OpenAI-compatible server: the course model (random weights, meaningless "
        "text) and the course tokenizer, or a real checkpoint (--model), behind /v1/completions, "
        "/v1/chat/completions, /v1/models and /health.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one and prints it)")
    p.add_argument("--context", type=int, default=512, help="context length in tokens, prompt and answer (512)")
    p.add_argument("--max-tokens-limit", type=int, default=256, help="largest max_tokens a request may ask (256)")
    p.add_argument("--max-requests", type=int, default=64,
                   help="slots: requests queued, running or still being sent at once (a slot is held until the "
                        "response has been sent); more get HTTP 429 (64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights, and of sampling without a seed (0)")
    p.add_argument("--model", default=None, metavar="NAME_OR_PATH",
                   help="serve a real checkpoint (a name the course registers, such as smollm2-135m-instruct, a .gguf "
                   "file or a Hugging Face folder) through labsupport.checkpoints.load; default: the course model")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the API (vLLM's option; default: the model's own name, or for --model a "
                   "Hugging Face folder, its path as given, as vLLM does). An absolute path (or one starting with ./ or ../) "
                   "names a folder the server writes its tokenizer into, if it is new, empty or the server's own, so a "
                   "client that loads the tokenizer by the model's name, as guidellm does, finds it offline; a folder "
                   "holding other files is never written into. A name such as org/model is only a name")
    p.add_argument("--tokenizer-dir", default=None,
                   help="folder to write the served tokenizer into, in Hugging Face format, for benchmark clients "
                   "(default: the --served-model-name folder if it is a path, else <cache>/tokenizers/<model name>; "
                   "the cache is $LABSUPPORT_CACHE or ~/.cache/labsupport). A folder holding files the server did not "
                   "write is left as it is, and the tokenizer goes to the cache")
    p.add_argument("--base-model", default=BASE_PRESET, help=f"labsupport.models preset for the shape ({BASE_PRESET})")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="the weights' and KV cache's dtype: float32 (default, the exact reference) or bfloat16 "
                   "(half the bytes a decode step reads)")
    p.add_argument("--prepack", nargs="?", const="onednn", default=None, choices=("onednn", "int8"),
                   help="pack the weights once for the CPU's matmuls (labsupport.cpu_linear): onednn (the default "
                   "when the flag is given alone: oneDNN's layout; faster on most CPUs, and where one plain row "
                   "is faster batch-1 decode keeps it) or int8 (chapter 09's weight-only int8, one scale per "
                   "output channel: a quarter of float32's bytes for decode steps of up to 4 sequences, more "
                   "memory than bfloat16; needs --dtype bfloat16)")
    p.add_argument("--engine", choices=("fifo", "continuous"), default="fifo",
                   help="fifo (default): chapter 03's one request at a time; continuous: chapter 13's engine, "
                   "concurrent requests share each forward pass (chapter 12)")
    p.add_argument("--block-size", type=int, default=16, help="continuous engine: tokens per KV block (16)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="continuous engine: KV blocks (default: --max-running requests at the full --context)")
    p.add_argument("--token-budget", type=int, default=256, help="continuous engine: most tokens per step (256)")
    p.add_argument("--max-running", type=int, default=16, help="continuous engine: most requests per step (16)")
    p.add_argument("--cpu-decode", choices=("torch", "fused"), default="torch",
                   help="continuous engine on a CPU: torch (default) or fused, which runs a step that only decodes "
                   "(up to 16 requests, no speculative drafts) as one C call compiled on this machine "
                   "(labsupport.cpu_decode: float32 activations, int16 into int8 products; "
                   "results/cpu_engine.json has its speed on the machine named there). With bfloat16 or "
                   "int8 weights a request's text can then depend on whether its decode steps ran in C or through "
                   "torch (beside a prompt chunk, or more than 16 requests)")
    p.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="continuous engine: speculative decoding with prompt-lookup drafts of up to K tokens (0: off)")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="seconds to pause after each forward pass: a slower model, for demos and tests (0)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds a graceful drain (SIGTERM) lets admitted requests finish before aborting them (30)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help=f"largest request body taken; more gets HTTP 413 ({MAX_BODY_BYTES})")
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S,
                   help=f"seconds a request's headers may take to arrive; later gets HTTP 408 ({HEADER_TIMEOUT_S:g})")
    p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                   help=f"seconds a request's body may take to arrive; later gets HTTP 408 ({BODY_TIMEOUT_S:g})")
    p.add_argument("--stack", default=None, metavar="LABS_DIR",
                   help="serve through your own parts: assemble the stack from the lab notebooks in LABS_DIR "
                        "(python -m labsupport stack) and plug in each wired part whose check passes")
    p.add_argument("--kv-memory-gib", type=float, default=None, metavar="GIB",
                   help="with --stack and --engine continuous, where your kv_capacity (lab 12) sizes the KV cache: the "
                        "memory it budgets, in GiB, for the weights and the cache together (utilisation 1.0, no "
                        "reserve; a CPU has no GPU memory to read). Default: the weights plus the course's default "
                        "cache (--max-running requests at the full --context)")
    p.add_argument("--stack-cache", default=None, metavar="DIR",
                   help="with --stack: the assembly's cache folder (default $LABSUPPORT_CACHE/stack)")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop when the process that started the server exits (used by ServerProcess)")
    args = p.parse_args(argv)
    for name in ("context", "max_tokens_limit", "max_requests", "threads", "block_size", "num_blocks",
                 "token_budget", "max_running", "max_body_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.context < 2:
        p.error("--context must be at least 2 (one prompt token and one answer token)")
    cpu_presets = [name for name in list_models() if get_model(name).source == "course preset"]
    if args.base_model.strip().lower() not in cpu_presets:
        p.error(f"--base-model {args.base_model!r} is not one of the course's small presets "
                f"({', '.join(cpu_presets)}); the server runs on the CPU")
    if args.num_blocks is not None and args.num_blocks * args.block_size < args.context:
        p.error(f"--num-blocks {args.num_blocks} of --block-size {args.block_size} hold "
                f"{args.num_blocks * args.block_size} tokens, fewer than one request at --context {args.context}")
    if args.kv_memory_gib is not None and not args.kv_memory_gib > 0:
        p.error(f"--kv-memory-gib must be a positive number of GiB, got {args.kv_memory_gib}")
    if args.kv_memory_gib is not None and not args.stack:
        p.error("--kv-memory-gib is the budget of your kv_capacity part: it goes with --stack LABS_DIR")
    if args.prepack == "int8" and args.dtype != "bfloat16":
        p.error("--prepack int8 computes with bfloat16 activations: add --dtype bfloat16")
    if not args.step_delay >= 0:
        p.error(f"--step-delay must be 0 or more seconds, got {args.step_delay}")
    for name in ("drain_timeout", "header_timeout", "body_timeout"):
        if not getattr(args, name) >= 0:
            p.error(f"--{name.replace('_', '-')} must be 0 or more seconds, got {getattr(args, name)}")
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be from 0 to 65535, got {args.port}")
    if args.num_speculative_tokens < 0:
        p.error(f"--num-speculative-tokens must be 0 (off) or more, got {args.num_speculative_tokens}")
    if args.cpu_decode == "fused" and args.engine != "continuous":
        p.error("--cpu-decode fused needs --engine continuous (it is the engine's decode step)")
    if args.cpu_decode == "fused" and args.stack:
        p.error("--cpu-decode fused would run the course's decode step in C, past your parts: leave it out with --stack")
    if args.num_speculative_tokens and args.engine != "continuous":
        p.error("--num-speculative-tokens needs --engine continuous (the FIFO engine does not speculate)")
    name = args.served_model_name
    if name is not None and (not name.strip() or name.strip(".") == ""):
        p.error(f"--served-model-name must be a name (what clients send as \"model\") or a folder's path, got {name!r}")
    return args


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM drains (see :mod:`labsupport.serve.app`) and the process then
    exits 0; a second SIGTERM, or Ctrl-C, stops as uvicorn does."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.app = config.app
        self.app.state.on_drained = self._drained

    def _drained(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM and not self.app.state.draining and not self.should_exit:
            print("labsupport.serve: SIGTERM: draining (finishing admitted requests, refusing new ones)", flush=True)
            asyncio.get_event_loop().call_soon_threadsafe(self.app.state.begin_drain)
            return
        super().handle_exit(sig, frame)


async def _watch_parent(server: uvicorn.Server, parent: int) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(0.5)
    server.should_exit = True  # the notebook or test that started us is gone


def is_path(name: str) -> bool:
    """Whether a served model name is a folder's path the server may write its tokenizer into: an
    absolute path, or one starting with ./ or ../. A Hugging Face style name (``org/model``) is a
    name, not a folder in the working directory."""
    return os.path.isabs(name) or name.startswith(("./", "../"))


def _served_name(args: argparse.Namespace, own_name: str) -> str:
    if args.served_model_name is not None:
        return args.served_model_name
    if args.model and Path(args.model).expanduser().is_dir():  # a Hugging Face folder: its path, as vLLM names it
        return args.model
    return own_name


def _backend(args: argparse.Namespace):
    """The back end the options ask for, with the model they name (a ValueError if it cannot load).
    With ``--stack`` the stack is assembled first: its model-side parts act while the model loads."""
    parts, side = {}, None
    if args.stack:
        manifest, table = assemble_stack(args.stack, args.stack_cache)
        print(f"labsupport.serve: your stack ({args.stack}):\n{table}", flush=True)
        parts = load_parts(manifest)
        side = model_side(parts)
    if args.model:  # a learner's dequantisers (lab 09) read the GGUF file's blocks
        served = side.load(args.model) if side is not None else checkpoint_model(args.model)
    else:
        served = course_model(args.seed, args.base_model)
    served = dataclasses.replace(served, name=_served_name(args, served.name))
    served.model.to(DTYPES[args.dtype])  # the engine's KV cache follows the model's dtype
    if args.prepack:
        prepack(served.model, args.prepack)
    common = dict(context_tokens=args.context, max_tokens_limit=args.max_tokens_limit,
                  max_requests=args.max_requests, seed=args.seed)
    num_blocks = args.num_blocks
    if args.engine == "continuous" and num_blocks is None and side is not None and "kv_capacity" in side.parts:
        num_blocks = side.num_blocks(served.model, args.context, args.block_size, args.max_running, args.kv_memory_gib)
    if args.engine == "continuous":
        backend = ContinuousBackend(served, **common, block_size=args.block_size, num_blocks=num_blocks,
                                   token_budget=args.token_budget, max_running=args.max_running,
                                   speculative_tokens=args.num_speculative_tokens, cpu_decode=args.cpu_decode)
    else:
        backend = FifoBackend(served, **common)
    backend.step_delay_s = args.step_delay
    if args.stack:
        plug_in(backend, parts)
        plug_model_side(backend, side)
    return backend


MARKER = ".labsupport-served-tokenizer"  # in a folder the server wrote its tokenizer into: it may write it again


def _cached_tokenizer_dir(name: str) -> Path:
    """The server's own folder for ``name``'s tokenizer, inside the cache (a ``/`` in the name is
    ``--``, as in Hugging Face's cache, so no name reaches outside it)."""
    return cache_dir() / "tokenizers" / name.replace("/", "--").replace("\\", "--")


def _foreign_files(folder: Path) -> list[str]:
    """What in ``folder`` this server did not write (nothing if it does not exist, is empty, or holds
    the server's marker): a folder with such files is someone's, and is never written into."""
    if not folder.exists():
        return []
    if not folder.is_dir():
        return [folder.name]
    if (folder / MARKER).is_file():
        return []
    return sorted(p.name for p in folder.iterdir())


def _save(backend, folder: Path) -> bool:
    """Write the tokenizer's files and the marker into ``folder``; True once done."""
    backend.tokenizer.save_pretrained(folder)  # interface A: writes tokenizer.json and tokenizer_config.json
    (folder / MARKER).write_text("labsupport.serve wrote the tokenizer files in this folder; it may write them again\n")
    backend.tokenizer_dir = str(folder)
    return True


def _write_tokenizer(backend, folder: str | None, model: str | None = None) -> None:
    """Write the served tokenizer in Hugging Face format, for benchmark clients; say where. The folder
    is ``folder`` (--tokenizer-dir), else the served name if it is a path, else the server's cache. A
    Hugging Face folder served from its own path keeps its own files (they are the tokenizer served).
    A folder holding files the server did not write is left alone, and so is one that cannot be made:
    the tokenizer goes to the cache instead (the printed guidellm command then names it)."""
    name = backend.model_name
    cached = _cached_tokenizer_dir(name).expanduser().resolve()
    target = folder or (name if is_path(name) else str(cached))
    resolved = Path(target).expanduser().resolve()
    if model and Path(model).expanduser().is_dir() and Path(model).expanduser().resolve() == resolved:
        backend.tokenizer_dir = str(resolved)
        return
    written = False
    if resolved != cached:
        foreign = _foreign_files(resolved)
        if foreign:
            print(f"labsupport.serve: {target} holds files this server did not write ({', '.join(foreign[:5])}); they "
                  f"are left as they are (name a new or empty folder to have the tokenizer written there); the "
                  f"tokenizer's files go to {cached} instead", flush=True)
        else:
            try:
                written = _save(backend, resolved)
            except (OSError, ImportError, ValueError) as exc:
                print(f"labsupport.serve: could not write the tokenizer's files to {target} ({exc}); they go to "
                      f"{cached} instead", flush=True)
    if not written:
        try:
            _save(backend, cached)
        except (OSError, ImportError, ValueError) as exc:
            print(f"labsupport.serve: could not write the tokenizer's files to {cached} ({exc}); benchmark clients "
                  f"that need a tokenizer will not find one", flush=True)
            return
    print(f"labsupport.serve: tokenizer (Hugging Face format) in {backend.tokenizer_dir}: give it to guidellm "
          f"(--tokenizer kind=hf_auto,model=...) or vllm bench serve (--tokenizer)", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(levelname)s: %(message)s")
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"labsupport.serve: cannot listen on {args.host}:{args.port} ({exc.strerror}); "
              f"choose another port with --port, or --port 0 for a free one", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]  # the port first, so a busy one is reported before the model is built
    try:
        backend = _backend(args)
    except ValueError as exc:  # a checkpoint that cannot load, blocks too few for the context
        print(f"labsupport.serve: {exc}", file=sys.stderr)
        return 2
    _write_tokenizer(backend, args.tokenizer_dir, args.model)
    app = create_app(backend, drain_timeout_s=args.drain_timeout, max_body_bytes=args.max_body_bytes,
                     body_timeout_s=args.body_timeout)
    server = DrainingServer(uvicorn.Config(app, log_level="warning", access_log=False, http=timed_protocol(
        args.header_timeout), timeout_graceful_shutdown=2))  # open streams do not hold up a stop
    parent = os.getppid()

    async def serve() -> None:
        if args.exit_with_parent:
            asyncio.get_running_loop().create_task(_watch_parent(server, parent))
        await server.serve(sockets=[sock])

    print(f"labsupport.serve: model {backend.model_name} ({backend.cfg.n_layers} layers, d_model "
          f"{backend.cfg.d_model}, vocabulary {backend.cfg.vocab_size}): {backend.description}", flush=True)
    if backend.tokenizer_dir is not None:
        print(f"labsupport.serve: guidellm {GUIDELLM_VERSION}: " + shlex.join(startup_command(
            f"http://{args.host}:{port}", backend.model_name, backend.tokenizer_dir, args.context,
            backend.max_tokens_limit)), flush=True)
    print(f"{LISTENING} http://{args.host}:{port} (OpenAI base_url http://{args.host}:{port}/v1)", flush=True)
    asyncio.run(serve())
    return 0
