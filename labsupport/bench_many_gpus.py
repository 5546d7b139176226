"""Chapter 11's GPU measurement: NCCL all-reduce bus bandwidth, and a tensor-parallel decode step.

Run on a machine with two or more NVIDIA GPUs, from the repository root::

    python -m labsupport.bench_many_gpus --out results/gpu_many_gpus.json
    python -m labsupport.bench_many_gpus --dry-run --out /tmp/many_gpus.json   # CPU processes,
                                                                               # gloo, tiny sizes:
                                                                               # measures nothing

It launches one process per GPU (:func:`labsupport.distributed.launch`, backend NCCL) for each
world size 2, 4, 8 that the machine has, and records

* ``all_reduce``: the median time of ``dist.all_reduce`` on bf16 tensors from 8 KiB to 256 MiB
  and the bus bandwidth as nccl-tests defines it (:func:`labsupport.collectives.bus_bandwidth`);
* ``decode``: the median time of one decode step of the Llama 3.1 8B shape (bf16, batch 1 and
  32, 1,024 tokens of context) on one GPU and split over ``n``
  (:class:`labsupport.tensor_parallel.TensorParallelModel`), with the logits' largest difference
  from the single-GPU model's.

Chapter 11 reads ``results/gpu_many_gpus.json`` (:func:`load_results`); a dry run's file is never
shown. Without two GPUs (and without ``--dry-run``) the command exits with status 2 and says why.
"""

from __future__ import annotations

import torch
import torch.distributed

from . import bench_harness as H
from .collectives import time_all_reduce
from .distributed import launch
from .tensor_parallel import time_decode_step

GPU_RESULTS = "results/gpu_many_gpus.json"
SIZES = {"gpu": [2**k for k in range(12, 28, 2)], "dry": [2**k for k in range(4, 12, 4)]}  # bf16 elements
DECODE = {"gpu": ("llama-3.1-8b", (1, 32), 1024), "dry": ("tiny-2m", (1,), 16)}


def _decode_on_device(model_name, batch, context, tensor_parallel, dtype_name):
    """Run on every rank: the decode step on this rank's GPU (or the CPU in a dry run)."""
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    return time_decode_step(model_name, batch, context, tensor_parallel=tensor_parallel, device=device,
                            dtype=getattr(torch, dtype_name))


def measure(args) -> None:
    dry_run = args.dry_run
    backend = "gloo" if dry_run else "nccl"
    kind = "dry" if dry_run else "gpu"
    available = 2 if dry_run else torch.cuda.device_count()
    worlds = [n for n in (2, 4, 8) if n <= available]
    rec = H.Recorder(args.out, H.header(dry_run, "CPU processes (dry run, gloo)" if dry_run else None, gpus=available,
                                        backend=backend, timing="median of 5 after a warm-up; bus bandwidth = bytes / "
                                        "time * 2 (n - 1) / n (nccl-tests)", all_reduce=[], decode=[]))
    r = rec.data
    dtype = torch.float32 if dry_run else torch.bfloat16
    for n in worlds:
        r["all_reduce"] += launch(time_all_reduce, n, args=(SIZES[kind], 5, dtype), backend=backend, timeout=600)[0]
    rec.save("all-reduce")
    model_name, batches, context = DECODE[kind]
    dtype_name = str(dtype).replace("torch.", "")
    for batch in batches:
        for n in [1, *worlds]:  # alone, then split over n
            r["decode"].append(launch(_decode_on_device, n, args=(model_name, batch, context, n > 1, dtype_name),
                                      backend=backend, timeout=600)[0])
        rec.save(f"decode, batch {batch}")


def load_results(path=None) -> dict | None:
    """The results a GPU run of this module wrote, or None when there are none (or a dry run)."""
    return H.load_results("many_gpus", path, required=("all_reduce",))


def results_markdown(results: dict | None) -> str:
    """Chapter 11's measured tables, with device and date, or "not yet measured"."""
    if not results:
        return ("GPU results: not yet measured. `python -m labsupport.bench_many_gpus` on a machine with two or "
                "more GPUs writes `results/gpu_many_gpus.json`, and this page shows it.")
    lines = [f"Measured on {results['gpus']} x {results['device']}, {H.date_of(results)} (torch {results['torch']}, "
             f"{results['backend']}); {results['timing']}.", "",
             "| GPUs | bytes | time | bus bandwidth |", "| --- | --- | --- | --- |"]
    for r in results["all_reduce"]:
        lines.append(f"| {r['world_size']} | {r['bytes']:,} | {r['seconds'] * 1e6:,.1f} us | "
                     f"{r['bus_bandwidth'] / 1e9:,.1f} GB/s |")
    lines += ["", "| model | batch | GPUs | decode step |", "| --- | --- | --- | --- |"]
    for r in results["decode"]:
        lines.append(f"| {r['model']} | {r['batch']} | {r['world_size']} | {r['seconds'] * 1e3:,.2f} ms |")
    return "\n".join(lines)


BENCH = H.Bench("many_gpus", "11", measure, needs="gpus", description=__doc__.split("\n")[0])


def main(argv: list[str] | None = None) -> int:
    return H.main(BENCH, argv)


if __name__ == "__main__":
    raise SystemExit(main())
