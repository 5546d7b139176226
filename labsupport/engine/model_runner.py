"""Running one step of the model: flat metadata, the paged cache, CUDA graphs (nano-vllm's ``ModelRunner``).

:meth:`ModelRunner.run` takes the scheduler's batch (requests and their token counts) and

1. **prepares** the step's flat metadata (:class:`~labsupport.engine.paged_batch.StepMetadata`):
   the tokens laid end to end, their positions and cache slots, each sequence's block table,
   length and query range, and the rows whose logits are sampled. It is built once per step on
   the host into persistent buffers (pinned memory on a GPU, copied without blocking), the way
   vLLM's ``GPUModelRunner._prepare_inputs`` fills its ``CpuGpuBuffer``\\ s. A copy without blocking
   reads its host buffer when the GPU gets to it, so a buffer is refilled only once the copy out
   of it from the step before has completed (:class:`Copier`: a CUDA event recorded after each
   copy and waited on before the refill). Without that guard, two steps that sample nothing (a
   long prompt chunked at an idle engine) can overwrite a chunk's slots before the GPU read them.
   The scheduler's batch is first read as :class:`ScheduledSeq` rows (tokens, block table, cached
   and new counts), and :func:`prepare_step` turns them into the metadata. ``ModelRunner.assemble``
   plugs in another function with :func:`prepare_step`'s signature (lab 12's exercise:
   ``engine.runner.assemble = my_prepare_step``); its tensors are moved to the model's device;
2. **runs** the model once over the flat batch with a :class:`~labsupport.engine.paged_batch.PagedBatch`:
   every layer stores its keys and values and attends in one call each;
3. **samples** the rows of the sequences whose known tokens are now all computed.

**CUDA graphs** (a GPU only): at start-up the runner captures one graph of the decode forward pass
per padded batch size (1, 2, 4, 8, then multiples of 16 up to ``max_num_seqs``, as nano-vllm
does), reading static input buffers. A step of decodes only is then copied into the buffers of
the smallest captured size that holds it, padded rows getting slot -1 (nothing written) and length
0 (a zero output), and replayed: one launch for the whole forward pass. Steps with a prefill chunk
run eagerly (their shapes vary every step). On a CPU the same padding code runs eagerly, which the
tests use to check it.

The KV cache itself is one :class:`~labsupport.paged_cache.PagedKVStore` (keys and values of
every layer, ``(L, num_blocks, block_size, Hkv, D)``) in the model's dtype: bf16 weights give a
bf16 cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .._answers import answer
from ..batch_attention import query_tiles
from ..cpu_decode import FusedDecoder, plugged_in
from ..device import interpreter_mode
from ..flash_decoding import num_kv_splits
from ..paged_cache import PagedKVStore
from ..transformer import Transformer
from .block_manager import BlockManager
from .paged_batch import BACKENDS, PagedBatch, StepMetadata
from .sequence import Request
from .speculative import verify_drafts

CPU_DECODE = ("torch", "fused")  # how a CPU engine runs a decode step of up to 16 sequences


class Copier:
    """How a host buffer reaches the device, and how its next refill waits for that (the guard).

    On a GPU the runner fills pinned host buffers and copies them without blocking: the copy runs
    later, in stream order, and reads the host buffer *when it runs*. A refill before then would
    change what the queued copy reads, so every copy out of a buffer is followed by a completion
    mark (a CUDA event recorded on the stream) and the buffer's next refill first waits for it
    (:attr:`_Buffer.np`). vLLM does the same before it refills its reused host buffers.

    ``copy(dst, src)`` queues one copy; ``record()`` returns a mark for the copies queued so far;
    ``wait(mark)`` blocks until they have completed. ``separate_host``: the buffers keep a host
    tensor apart from the device one. A test passes its own copier, whose completion it controls,
    to check the order on a CPU (``tests/test_engine_buffers.py``)."""

    separate_host = True

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def record(self):
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done

    def wait(self, mark) -> None:
        mark.synchronize()


def default_copier(device: torch.device) -> Copier | None:
    """A CUDA device's copier; None on a CPU, where the host buffer is the device tensor itself."""
    return Copier(device) if torch.device(device).type == "cuda" else None


class _Buffer:
    """A persistent device tensor and its host twin (pinned on a GPU; the same tensor on a CPU, unless
    a test's copier keeps them apart): filled through :attr:`np` on the host, copied to the device
    without blocking by ``copier``."""

    def __init__(self, shape, dtype, device: torch.device, fill: int = 0, copier: Copier | None = None):
        self.copier = copier
        self.device_t = torch.full(shape, fill, dtype=dtype, device=device)
        if copier is None or not copier.separate_host:
            self.host = self.device_t
        else:
            self.host = torch.full(shape, fill, dtype=dtype, pin_memory=torch.device(device).type == "cuda")
        self._np = self.host.numpy()
        self._in_flight = None  # the copier's mark for the last copy out of host, until it is known complete

    @property
    def np(self) -> np.ndarray:
        """The host buffer as a numpy array, to fill: first waits until the last copy out of it has
        completed (the guard; at once when it has, as nearly always once the GPU is not behind)."""
        if self._in_flight is not None:
            self.copier.wait(self._in_flight)
            self._in_flight = None
        return self._np

    def __len__(self) -> int:
        return self.host.shape[0]

    def to_device(self, rows: int) -> torch.Tensor:
        """The first ``rows`` rows on the device (a copy queued on the current stream on a GPU)."""
        if self.host is self.device_t:
            return self.device_t[:rows]
        self.copier.copy(self.device_t[:rows], self.host[:rows])
        self._in_flight = self.copier.record()
        return self.device_t[:rows]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes decode graphs are captured for: 1, 2, 4, 8, then every 16 up to (and
    including) ``max_num_seqs`` rounded up to 16 (``max_num_seqs`` itself when it is at most 8)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs + 16, 16)) if max_num_seqs > 8 else [max_num_seqs]
    return sorted(set(sizes))


def padded_batch_size(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``batch`` sequences, or None when none does."""
    return next((s for s in sizes if s >= batch), None)


@dataclass(frozen=True, eq=False)
class ScheduledSeq:
    """One sequence of a step, as :func:`prepare_step` reads it (lab 12's exercise takes the same).
    The runner builds these from the scheduler's batch each step: ``token_ids`` is a read-only
    :class:`~labsupport.engine.sequence.TokenView` of the request's tokens (a list where tests and
    labs build their own), indexed, sliced and measured like a list without copying the history;
    ``block_table`` a new list."""

    token_ids: Sequence[int]  # every token it knows: its prompt, then what it has generated (and its draft)
    block_table: list[int]  # its cache blocks, logical block 0 first (enough for the step's tokens)
    num_cached: int  # leading tokens whose keys and values are already in the cache
    num_new: int  # tokens it computes this step: a prompt chunk, or 1 for a decode

    @property
    def samples(self) -> bool:
        """Whether its logits are sampled this step: the step computes its last known token."""
        return self.num_cached + self.num_new == len(self.token_ids)


AssembleFn = Callable[[Sequence[ScheduledSeq], int], StepMetadata]


class StepBuffers:
    """The persistent host buffers :func:`prepare_step` fills, with their device twins; they grow
    when a step needs more and are never allocated otherwise."""

    def __init__(self, device: torch.device, max_blocks: int, tokens: int = 256, seqs: int = 32,
                 copier: Copier | None = None):
        self.device, self.max_blocks = torch.device(device), max_blocks
        self.copier = default_copier(self.device) if copier is None else copier
        self.b: dict[str, _Buffer] = {}
        self.ensure(tokens, seqs)

    def ensure(self, tokens: int, seqs: int) -> dict[str, _Buffer]:
        """The buffers, (re)allocated to hold at least ``tokens`` tokens and ``seqs`` sequences."""
        have, dev = self.b, self.device
        if have and len(have["input_ids"]) >= tokens and len(have["seq_lens"]) >= seqs:
            return have
        tokens = max(tokens, len(have["input_ids"]) if have else 0)
        seqs = max(seqs, len(have["seq_lens"]) if have else 0)
        c = self.copier
        self.b = {
            "input_ids": _Buffer((tokens,), torch.long, dev, copier=c),
            "positions": _Buffer((tokens,), torch.long, dev, copier=c),
            "slot_mapping": _Buffer((tokens,), torch.long, dev, copier=c),
            "block_tables": _Buffer((seqs, self.max_blocks), torch.int32, dev, fill=-1, copier=c),
            "seq_lens": _Buffer((seqs,), torch.int32, dev, copier=c),
            "cu_seqlens_q": _Buffer((seqs + 1,), torch.int32, dev, copier=c),
            "logits_indices": _Buffer((seqs,), torch.long, dev, copier=c),
            "tile_seq": _Buffer((tokens + seqs,), torch.int32, dev, copier=c),
            "tile_first": _Buffer((tokens + seqs,), torch.int32, dev, copier=c),
        }
        return self.b

    def tiles(self, tile_seq: Sequence[int], tile_first: Sequence[int], block_q: int) -> tuple:
        """The Triton prefill kernel's query tiles (:func:`~labsupport.batch_attention.query_tiles`) on
        the device."""
        n = len(tile_seq)
        buf = self.ensure(n, 0) if n > len(self.b["tile_seq"]) else self.b
        buf["tile_seq"].np[:n], buf["tile_first"].np[:n] = tile_seq, tile_first
        return buf["tile_seq"].to_device(n), buf["tile_first"].to_device(n), block_q


@answer
def prepare_step(seqs: Sequence[ScheduledSeq], block_size: int, buffers: StepBuffers | None = None) -> StepMetadata:
    """A step's flat metadata (:class:`~labsupport.engine.paged_batch.StepMetadata`) from its
    scheduled sequences (lab 12's exercise; chapter 13 explains it). Sequence ``b`` runs tokens
    ``num_cached .. num_cached + num_new - 1`` of its ``token_ids``, laid end to end after the
    sequences before it:

    * ``input_ids``, ``positions`` (int64): those tokens and their positions in their sequence;
    * ``slot_mapping`` (int64): ``block_table[p // block_size] * block_size + p % block_size``;
    * ``block_tables`` (int32, ``(B, W)``, ``W`` the most blocks a sequence holds, at least 1):
      each sequence's table, padded with -1 (a block id no sequence owns);
    * ``seq_lens`` (int32): ``num_cached + num_new``; ``cu_seqlens_q`` (int32, ``B + 1``): 0, then
      the running total of ``num_new``;
    * ``logits_indices`` (int64): the flat row of the last token of every sequence that samples
      (:attr:`ScheduledSeq.samples`), in batch order;
    * ``max_q_len``, the largest ``num_new``; ``decode_only``, whether every ``num_new`` is 1.

    Built with numpy into ``buffers`` (the runner's persistent ones; fresh ones on the CPU when
    None) and copied to their device without blocking."""
    if buffers is None:
        buffers = StepBuffers(torch.device("cpu"), max([1, *(len(s.block_table) for s in seqs)]), 1, 1)
    n_tokens = sum(s.num_new for s in seqs)
    buf = buffers.ensure(n_tokens, len(seqs))
    ids, pos, slots = buf["input_ids"].np, buf["positions"].np, buf["slot_mapping"].np
    tables, lens, cu, rows = buf["block_tables"].np, buf["seq_lens"].np, buf["cu_seqlens_q"].np, []
    width = max([1, *(len(s.block_table) for s in seqs)])
    row = 0
    cu[0] = 0
    for b, s in enumerate(seqs):
        start, n = s.num_cached, s.num_new
        table = np.asarray(s.block_table, dtype=np.int64)
        p = np.arange(start, start + n)
        ids[row:row + n] = s.token_ids[start:start + n]
        pos[row:row + n] = p
        slots[row:row + n] = table[p // block_size] * block_size + p % block_size
        tables[b, :len(table)] = table
        tables[b, len(table):width] = -1  # padding: no block (the buffers are reused step after step)
        lens[b] = start + n
        row += n
        cu[b + 1] = row
        if s.samples:
            rows.append(row - 1)
    buf["logits_indices"].np[:len(rows)] = rows
    max_q = max(s.num_new for s in seqs)
    return StepMetadata(
        input_ids=buf["input_ids"].to_device(n_tokens), positions=buf["positions"].to_device(n_tokens),
        slot_mapping=buf["slot_mapping"].to_device(n_tokens),
        block_tables=buf["block_tables"].to_device(len(seqs))[:, :width],
        seq_lens=buf["seq_lens"].to_device(len(seqs)), cu_seqlens_q=buf["cu_seqlens_q"].to_device(len(seqs) + 1),
        logits_indices=buf["logits_indices"].to_device(len(rows)), max_q_len=int(max_q), decode_only=max_q == 1)


TENSOR_FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q",
                 "logits_indices")


def on_device(meta: StepMetadata, device: torch.device) -> StepMetadata:
    """A plugged-in step assembly's result with its tensors on ``device``; a ValueError saying what
    is wrong when it is not a :class:`StepMetadata` of tensors."""
    if not isinstance(meta, StepMetadata):
        raise ValueError(f"the step assembly returned a {type(meta).__name__}; it must return a "
                         f"labsupport.engine.StepMetadata (fields: {', '.join(TENSOR_FIELDS)}, max_q_len, decode_only)")
    moved = {}
    for name in TENSOR_FIELDS:
        value = getattr(meta, name)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"StepMetadata.{name} is a {type(value).__name__}; it must be a torch.Tensor")
        moved[name] = value.to(device)
    return dataclasses.replace(meta, **moved, tiles=None)


class ModelRunner:
    """The model, its paged cache and the step's buffers (module docstring)."""

    def __init__(self, model: Transformer, block_manager: BlockManager, num_blocks: int, block_size: int,
                 max_num_seqs: int, max_model_len: int, attention: str = "auto", cuda_graphs: bool | None = None,
                 assemble: AssembleFn | None = None, cpu_decode: str = "torch"):
        self.model, self.device = model, model.device
        self.block_manager, self.block_size = block_manager, block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)  # block-table columns a sequence may need
        cuda = self.device.type == "cuda"
        if attention == "auto":
            attention = "triton" if cuda and not interpreter_mode() else "torch"
        if attention not in BACKENDS:
            raise ValueError(f"attention must be 'auto' or one of {BACKENDS}, got {attention!r}")
        if cuda_graphs and not cuda:
            raise ValueError("cuda_graphs=True needs the model on a CUDA GPU; leave it None (on by default on a GPU)")
        self.attention = attention
        self.store = PagedKVStore(model.cfg, num_blocks, block_size, device=self.device, dtype=model.dtype)
        cfg = model.cfg
        self.group = cfg.n_heads // cfg.n_kv_heads
        self.buffers = StepBuffers(self.device, self.max_blocks, tokens=256, seqs=max_num_seqs)
        self.assemble: AssembleFn | None = assemble  # None: the engine's own prepare_step
        self.verify = verify_drafts  # a speculative step's draft verification (lab 13's rule can be plugged in)
        self.graph_sizes: list[int] = []
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_vars: dict[str, torch.Tensor] = {}
        max_graph = min(max_num_seqs, 512)
        self._graph_splits = {}
        if cuda and attention == "triton" and (cuda_graphs is None or cuda_graphs):
            self.capture_cudagraphs(graph_batch_sizes(max_graph))
        if cpu_decode not in CPU_DECODE:
            raise ValueError(f"cpu_decode must be one of {CPU_DECODE}, got {cpu_decode!r}")
        self.fused = None  # cpu_decode="fused": decode steps of up to 16 sequences in one C call (labsupport.cpu_decode)
        if cpu_decode == "fused":
            self.fused = FusedDecoder(model, self.store.k, self.store.v, max_model_len)

    # -- 1. the step's metadata ------------------------------------------------------------------

    def scheduled(self, batch: Sequence[tuple[Request, int]]) -> list[ScheduledSeq]:
        """The step as :func:`prepare_step` reads it: each request's tokens, block table, cached and
        new token counts (the block tables already cover the step's tokens)."""
        # the tokens are a read-only view (nothing copied), the block table a new list
        return [ScheduledSeq(req.view(), self.block_manager.block_table(req.request_id), req.num_computed, n)
                for req, n in batch]

    def prepare(self, batch: Sequence[tuple[Request, int]]) -> StepMetadata:
        """Build the step's metadata and copy it to the device: the engine's own
        :func:`prepare_step` into the persistent buffers, or :attr:`assemble` where one is plugged in
        (lab 12's exercise), whose tensors are moved to the model's device."""
        seqs = self.scheduled(batch)
        if self.assemble is None:
            meta = prepare_step(seqs, self.block_size, self.buffers)
        else:
            meta = on_device(self.assemble(seqs, self.block_size), self.device)
        if self.attention == "triton" and not meta.decode_only:  # the prefill kernel's query tiles
            q_lens = [s.num_new for s in seqs]
            tile_seq, tile_first, block_q = query_tiles(q_lens, self.group)
            meta.tiles = self.buffers.tiles(tile_seq, tile_first, block_q)
        return meta

    # -- 2. the forward pass -----------------------------------------------------------------------

    @torch.no_grad()
    def run(self, batch: Sequence[tuple[Request, int]], sampler, copies=()) -> list[list[int]]:
        """One forward pass over ``batch`` and the tokens of every request that samples (in batch
        order; see :meth:`prepare`): one token each, or with speculative decoding its accepted
        draft tokens and the target's own (:func:`~labsupport.engine.speculative.verify_drafts`); a
        request whose sampling failed gets its :class:`~labsupport.engine.sampler.RowSamplingError`
        instead. ``copies`` are copy-on-write block copies to make first."""
        for src, dst in copies:
            self.store.copy_block(src, dst)
        meta = self.prepare(batch)
        sampling = [req for req, n in batch if req.samples_after(n)]
        drafts = [req.draft_ids for req in sampling]
        if any(drafts):  # every drafted position's logits, not only the last row's
            meta.logits_indices = self.verify_rows(batch)
        if self.fused is not None and meta.decode_only and len(sampling) == len(batch) <= self.fused.max_batch \
                and not any(drafts) and self.fused_applies():
            logits = self.fused_step(meta)  # (B, V): the whole step in one C call
        else:
            hidden = self.forward(meta)  # (N, d) or (R, d): see forward
            logits = self.model.logits(hidden)  # (R, V)
        params = [r.params for r in sampling]
        histories = None  # the usual case, no penalty: no sequence is copied
        if any(p.repetition_penalty != 1 for p in params):
            histories = [r.all_ids if p.repetition_penalty != 1 else () for r, p in zip(sampling, params)]
        generators = [r.generator for r in sampling]
        if any(drafts):
            return self.verify(logits, params, generators, drafts, histories)
        # a row the sampler could not sample comes back as its RowSamplingError: the engine fails it alone
        return [[t] if isinstance(t, int) else t for t in sampler(logits, params, generators, histories)]

    def fused_applies(self) -> bool:
        """Whether a decode step may run the C step: not while a part it would bypass is
        plugged in after the engine was built (a step assembly, a forward pass, a rotation); a model
        moved to another dtype or packed since gets a new decoder first (in-place weight updates need
        none: the C step reads the model's tensors in place)."""
        if self.assemble is not None or "forward" in vars(self) or plugged_in(self.model) is not None:
            return False
        if self.fused.repacked():
            self.fused = FusedDecoder(self.model, self.store.k, self.store.v, self.max_model_len)
        return True

    def fused_step(self, meta: StepMetadata) -> torch.Tensor:
        """A decode step's logits (B, V) from the C step (:class:`~labsupport.cpu_decode.FusedDecoder`), which
        stores each token's keys and values in the same cache the torch path uses."""
        return self.fused.step_batch(meta.input_ids, meta.positions, meta.block_tables)

    def verify_rows(self, batch: Sequence[tuple[Request, int]]) -> torch.Tensor:
        """The flat rows whose logits a speculative step needs: for each request that samples, its
        last ``1 + len(draft)`` rows (the last sampled token's and each draft token's), in order."""
        rows, end = [], 0
        for req, n in batch:
            end += n
            if req.samples_after(n):
                rows.extend(range(end - 1 - len(req.draft_ids), end))
        rows_t = torch.tensor(rows, dtype=torch.long)  # (R,) on the host
        if self.device.type != "cuda":
            return rows_t.to(self.device)
        # A copy from pageable memory waits for the whole stream: here, before the forward pass is
        # even queued, the GPU would idle while the host issues it. A fresh pinned tensor copied
        # without blocking (nano-vllm's way) waits for nothing; PyTorch's pinned-memory allocator
        # does not hand its block out again until the copy has run.
        return rows_t.pin_memory().to(self.device, non_blocking=True)

    def forward(self, meta: StepMetadata) -> torch.Tensor:
        """The hidden states of the rows ``meta.logits_indices`` names, (R, d): replayed from a
        captured graph for a decode step that fits one, else run eagerly."""
        size = padded_batch_size(meta.seq_lens.shape[0], self.graph_sizes) if meta.decode_only else None
        if size is not None and size in self._graphs:
            self.fill_graph_inputs(meta, size)
            self._graphs[size].replay()
            return self._graph_vars["hidden"][:meta.seq_lens.shape[0]][meta.logits_indices]
        kv = PagedBatch(self.store.k, self.store.v, meta, self.attention)
        return self.model(meta.input_ids[None], kv)[0][meta.logits_indices]  # (R, d)

    # -- 3. CUDA graphs for decode steps ---------------------------------------------------------

    def _make_graph_vars(self, max_bs: int) -> None:
        dev, d = self.device, self.model.cfg.d_model
        self._graph_vars = {
            "input_ids": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.long, device=dev),
            "seq_lens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            "cu_seqlens_q": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            "block_tables": torch.zeros(max_bs, self.max_blocks, dtype=torch.int32, device=dev),
            "rows": torch.arange(max_bs, device=dev),
            "hidden": torch.zeros(max_bs, d, dtype=self.model.dtype, device=dev),
        }

    def graph_metadata(self, size: int) -> StepMetadata:
        """The metadata a graph of ``size`` decodes reads: views of the static buffers."""
        g = self._graph_vars
        return StepMetadata(g["input_ids"][:size], g["positions"][:size], g["slot_mapping"][:size],
                            g["block_tables"][:size], g["seq_lens"][:size], g["cu_seqlens_q"][:size + 1],
                            g["rows"][:size], max_q_len=1, decode_only=True)

    def fill_graph_inputs(self, meta: StepMetadata, size: int) -> None:
        """Copy a decode step's metadata into the static buffers of the graph for ``size``
        sequences: padded rows get slot -1 (the store skips them) and length 0 (nothing is read)."""
        g, b, w = self._graph_vars, meta.seq_lens.shape[0], meta.block_tables.shape[1]
        g["input_ids"][:b] = meta.input_ids
        g["positions"][:b] = meta.positions
        g["slot_mapping"][:size].fill_(-1)
        g["slot_mapping"][:b] = meta.slot_mapping
        g["seq_lens"][:size].zero_()
        g["seq_lens"][:b] = meta.seq_lens
        g["block_tables"][:b, :w] = meta.block_tables

    def graph_body(self, size: int) -> None:
        """What a decode graph of ``size`` sequences records: the forward pass on the static buffers,
        its hidden states written to the static output."""
        kv = PagedBatch(self.store.k, self.store.v, self.graph_metadata(size), self.attention,
                        num_splits=self._graph_splits.get(size))
        self._graph_vars["hidden"][:size] = self.model(self._graph_vars["input_ids"][:size][None], kv)[0]

    @torch.no_grad()
    def capture_cudagraphs(self, sizes: Sequence[int]) -> None:
        """Capture one decode graph per size, largest first, sharing one memory pool."""
        cfg = self.model.cfg
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._make_graph_vars(max(sizes))
        pool = None
        for size in sorted(sizes, reverse=True):
            self._graph_splits[size] = num_kv_splits(size, cfg.n_kv_heads, self.max_model_len, sms)
            self.graph_body(size)  # warm-up: compiles the kernels for these shapes
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.graph_body(size)
            pool = graph.pool() if pool is None else pool
            self._graphs[size] = graph
        torch.cuda.synchronize()
        self.graph_sizes = sorted(sizes)
