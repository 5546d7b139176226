"""guidellm against the course server (chapter 15): the command that works, and its measured results.

guidellm (the vLLM project's benchmark tool) runs against the course server with three settings:
``request_format=/v1/completions`` (or its default, chat completions), the tokenizer folder the
server writes and names as ``root`` in ``/v1/models``, and ``GUIDELLM__MAX_WORKER_PROCESSES=1`` for
Poisson arrivals that are Poisson (see :func:`guidellm_command`). ``scripts/guidellm_check.py`` runs
it beside :mod:`labsupport.bench_serving` and writes :data:`RESULTS_PATH`; :func:`results_markdown`
is the table chapter 15 shows from that file ("not yet measured" without it).
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS_PATH = Path(__file__).resolve().parents[2] / "results" / "guidellm_course_server.json"
GUIDELLM_VERSION = "0.8.1"  # the version whose options these commands use (tried against the server)


def startup_command(url: str, model: str, tokenizer_dir: str, context: int, max_tokens_limit: int,
                    requests: int = 20) -> list[str]:
    """The guidellm command the server prints when it starts: ``requests`` requests one after another
    (guidellm's ``synchronous`` profile) of prompts and answers that fit the context. guidellm loads
    its tokenizer by the model's name unless ``--tokenizer`` names one, and never reads ``root``
    from ``/v1/models``: when the served name is the tokenizer's folder (``--served-model-name``
    an absolute path) the command needs no ``--tokenizer`` and runs offline as it is."""
    size = max(1, min(64, context // 4, max_tokens_limit))
    command = ["guidellm", "run", "--backend", f"kind=openai_http,target={url},model={model},"
               f"request_format=/v1/completions"]
    if not (Path(model).is_absolute() and Path(model).resolve() == Path(tokenizer_dir).resolve()):
        # guidellm loads the name as it is: a relative or ~ path only from the folder the server started in
        command += ["--tokenizer", f"kind=hf_auto,model={tokenizer_dir}"]
    return command + ["--data", f"kind=synthetic_text,prompt_tokens={size},output_tokens={size}",
                      "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={requests}"]


def guidellm_command(guidellm: str, url: str, model: str, tokenizer_dir: str, rate: float, requests: int,
                     prompt_tokens: int, output_tokens: int, out: str | None = None,
                     request_format: str = "/v1/completions") -> list[str]:
    """The guidellm command (guidellm 0.8's options) that benchmarks the course server at ``url``:
    ``requests`` Poisson arrivals at ``rate`` per second, prompts of ``prompt_tokens`` and answers of
    ``output_tokens`` (guidellm sends ``ignore_eos``). Run it with ``GUIDELLM__MAX_WORKER_PROCESSES=1``
    in the environment: with several worker processes guidellm's Poisson gaps repeat."""
    command = [guidellm, "run",
               "--backend", f"kind=openai_http,target={url},model={model},request_format={request_format}",
               "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
               "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
               "--profile", f"kind=poisson,rate={rate:g}",
               "--constraint", f"kind=max_requests,count={requests}"]
    if out is not None:
        command += ["--output", f"kind=json,path={out}", "--disable-progress"]
    return command


def load_results(path=RESULTS_PATH) -> dict | None:
    """The measured results, or None when none were committed."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def _client(run: dict) -> str:
    if run["client"] != "guidellm":
        return "`bench_serving`"
    return "guidellm, 1 worker" if run["workers"] == 1 else "guidellm, default workers"


def results_markdown(results: dict | None) -> str:
    """The runs as a Markdown table, with where and when they were measured."""
    if results is None:
        return "guidellm against the course server: not yet measured (`python scripts/guidellm_check.py`)."
    rows = ["| offered load | client | TTFT p50 (ms) | TTFT p90 (ms) | TPOT p50 (ms) | E2E p50 (ms) | "
            "server's TTFT, mean (ms) | server's ITL, mean (ms) | arrival gaps: CV | gaps equal to the one before |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["runs"]:
        rows.append(f"| {r['rate']:g} requests/s | {_client(r)} | {r['ttft_ms']['p50']:.1f} | {r['ttft_ms']['p90']:.1f} "
                    f"| {r['tpot_ms']['p50']:.2f} | {r['e2e_ms']['p50']:.0f} | {r['server_ttft_ms_mean']:.1f} | "
                    f"{r['server_itl_ms_mean']:.2f} | {r['gap_cv']:.2f} | {100 * r['repeated_gap_share']:.0f}% |")
    m, v, load = results["machine"], results["versions"], results["load"]
    rows.append("")
    rows.append(f"Measured {results['date']} on {m['cores']} CPU cores ({m['platform']}; one-minute load average "
                f"{m['load_average_1min']:g} from other work on the machine), guidellm {v['guidellm']}, Python "
                f"{v['python']}, torch {v['torch']}, labsupport {v['labsupport_commit']}: the course server "
                f"(`{' '.join(results['server']['command'][1:])}`, FIFO), {load['requests']} streamed requests per "
                f"run, Poisson arrivals, {load['output_tokens']} output tokens each (`ignore_eos`), prompts of about "
                f"{load['prompt_tokens']} tokens. {results['conventions'][:1].upper()}{results['conventions'][1:]}; the server's columns come from its own "
                f"`/metrics` histograms over the run (from arrival, so a slow client cannot inflate them).")
    return "\n".join(rows)
