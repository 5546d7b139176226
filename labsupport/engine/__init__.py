"""A small serving engine: continuous batching over a paged KV cache, shaped like nano-vllm (chapter 13).

Every engine people deploy runs the same loop, one iteration per forward pass, and
:meth:`Engine.step` is that loop in three lines:

1. **schedule** (:mod:`.scheduler`): a step decision (:func:`labsupport.scheduler.schedule_step`,
   or a learner's) picks which sequences run and how many tokens each, under a per-step token
   budget, the free cache blocks and ``max_running``; preempted sequences give their blocks back
   and admitted ones claim what the prefix cache holds of them (:mod:`.block_manager`);
2. **run** (:mod:`.model_runner`): the step's tokens are laid end to end in one flat batch and its
   metadata (slot mapping, block tables, sequence lengths, cumulative query lengths) is built
   once, into persistent buffers; the model runs once over the batch, and every layer's own
   attention writes its keys and values into their slots and attends over the paged cache in one
   call for the whole mixed batch of prefill chunks and decodes (:mod:`.paged_batch`); the
   sampler (:mod:`.sampler`) turns the logits of the sequences whose known tokens are all computed
   into tokens, with one host sync;
3. **postprocess**: the scheduler moves the requests on (``Scheduler.postprocess``, as in
   nano-vllm: computed counts, rejected drafts rolled back, tokens appended up to a stop, finished
   sequences retired, their blocks back to the allocator); the engine timestamps and streams the
   tokens (:class:`TokenEvent`) and records the step.

One file per role, as in nano-vllm (GeeeekExplorer/nano-vllm, ``nanovllm/engine/``):
``llm_engine`` (the loop), ``scheduler``, ``block_manager``, ``model_runner``, ``sequence``,
``sampler``, plus ``paged_batch`` (the KV interface the model consumes, nano-vllm's
``utils/context.py`` and ``layers/attention.py``), ``speculative`` (n-gram drafts verified in the
step's own forward pass, rejected ones rolled back from the cache) and ``trace`` (replaying traces). The model's
forward pass is the same one ``Transformer.generate`` runs: it takes a KV batch
(:class:`labsupport.transformer.KVBatch`), and the engine passes a paged one.

**On a GPU** the attention calls are Triton kernels (:mod:`labsupport.batch_attention`,
:mod:`labsupport.flash_decoding`), the step's buffers are pinned and copied without blocking, and
decode steps replay CUDA graphs captured for padded batch sizes. **On a CPU** attention is the
same contract in torch, one ``scaled_dot_product_attention`` call per layer for the whole batch.

The invariant the tests check: with greedy sampling, every request gets exactly the tokens
``Transformer.generate`` gives it alone (fp32, CPU), whatever shares its batches, however its
prompt is chunked, however often it is preempted and whatever part of it the prefix cache held.

**Interface for a server** (chapter 12 puts the engine behind the course server): call
:meth:`Engine.add_request` (returns the request id), call :meth:`Engine.step` in a loop (in a
worker thread): it returns the :class:`TokenEvent` of every token made in that step, each with its
request id, index, time and finish reason; :meth:`Engine.abort` cancels a request, queued or
running; :meth:`Engine.release` forgets a finished or aborted one; :meth:`Engine.stats` counts what
a metrics endpoint shows, prefix-cache queries and hits included. :meth:`Engine.stream` is the
same loop as a Python generator.

**Clocks.** Timestamps come from the engine's clock: ``"wall"`` (``time.perf_counter``),
``"virtual"`` (starts at 0 and advances by each step's measured duration; a trace driver jumps it
forward over idle gaps, so replaying a trace never sleeps) or ``"steps"`` (one unit per step:
machine-independent, for figures that must not depend on the CPU).
"""

from .llm_engine import CLOCKS, Engine, StepRecord, TokenEvent
from .model_runner import ScheduledSeq
from .paged_batch import StepMetadata
from .sequence import Request
from .speculative import SpeculativeConfig
from .trace import TraceRequest, poisson_trace, run_trace, trace_summary

__all__ = ["Engine", "Request", "TokenEvent", "StepRecord", "TraceRequest", "run_trace", "trace_summary",
           "poisson_trace", "CLOCKS", "ScheduledSeq", "StepMetadata", "SpeculativeConfig"]
