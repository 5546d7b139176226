// The capacity planner for pages without a Python kernel (the HTML book).
//
// labsupport/planner_widget.py inlines this file into the page, after two JSON blocks: the tables
// (models, cards, precisions, constants; generated from labsupport) and the starting setting.
// plan() re-implements labsupport.planning.plan operation for operation, and texts()
// labsupport.planner_widget.display_values string for string: a browser test checks both agree.
// Where Python multiplies whole numbers (its ints are exact), this file does it in BigInt and
// rounds once, as Python's float() does.

/* exported labsupportPlanner */
function labsupportPlanner(root) {
  "use strict";
  const json = (name) => JSON.parse(root.querySelector('script[data-pl="' + name + '"]').textContent);
  const DATA = json("data");
  const START = json("start");
  const $ = (sel) => root.querySelector(sel);

  // --- number formatting (explainer_static/number_format.js, shared with the explainer), then the planner's own
  const { fixed, group, seconds, percent } = labsupportNumberFormat();
  function plain(x) {
    let t = fixed(x, 2);
    if (t.includes(".")) t = t.replace(/0+$/, "").replace(/\.$/, "");
    return group(t);
  }
  const count = (n) => group(Math.trunc(n).toFixed(0));
  const plural = (n, w) => count(n) + " " + w + (n === 1 ? "" : "s");
  function gib(b) { const g = b / DATA.gib; return group(fixed(g, g < 10 ? 2 : 1)) + " GiB"; }
  function cost(v) { return group(fixed(v, v < 0.1 ? 4 : v < 1 ? 3 : v < 1000 ? 2 : 0)); }
  const tokRate = (v) => group(fixed(v, v < 10 ? 1 : 0)) + " tok/s";

  // --- exact integer products, as Python's ints, rounded once to a double
  function exact(...xs) { let r = 1n; for (const x of xs) r *= BigInt(x); return Number(r); }

  // --- labsupport.costs and labsupport.planning, operation for operation
  const kvPerToken = (m, kvb) => m.kv_values_per_token * kvb;  // costs.kv_bytes_per_token
  // kv * a * b with kv an int (Python: exact) or a float (Python: left to right)
  const kvTimes = (kv, a, b) => (Number.isInteger(kv) ? exact(kv, a, b) : kv * a * b);
  function decodeStepFlops(m, b, c) {  // costs.decode_step_flops
    return Number(BigInt(b) * (2n * BigInt(m.params) + 4n * BigInt(m.n_layers) * BigInt(c) * BigInt(m.q_width)));
  }
  function prefillFlops(m, p) {  // costs.prefill_flops(causal=True)
    const linear = exact(2, m.params, p);
    const attention = exact(4, m.n_layers, p, p, m.q_width) / 2;
    return linear + attention;
  }
  function unreadEmbedding(m, b, wdb) {  // phases.unread_embedding_bytes
    if (m.tied) return 0;
    const rows = Math.max(m.vocab_size - b, 0);
    return Number.isInteger(wdb) ? exact(rows, m.d_model, wdb) : exact(rows, m.d_model) * wdb;
  }
  function decodeStepTime(m, b, c, hw) {  // PlanSettings.step_time: decode_step_time(read_exact=True)
    const read = m.params * hw.wdb + kvTimes(kvPerToken(m, hw.kvb), c, b) - unreadEmbedding(m, b, hw.wdb);
    const flops = decodeStepFlops(m, b, c);
    return Math.max(read / (hw.tp * hw.bw * hw.beff), flops / (hw.tp * hw.peak * hw.ceff)) + hw.overhead;
  }
  function maxBatchForTpot(m, c, tpot, hw) {  // planning.max_batch_for_tpot
    const step = (b) => decodeStepTime(m, b, c, hw);
    if (step(1) > tpot) return 0;
    let low = 1, high = DATA.max_batch_search;
    if (step(high) <= tpot) return high;
    while (high - low > 1) {
      const mid = Math.floor((low + high) / 2);
      if (step(mid) <= tpot) low = mid; else high = mid;
    }
    return low;
  }
  function maxBatchInMemory(m, c, hw) {  // planning.max_batch_in_memory
    const budget = DATA.memory_utilization * hw.tp * hw.memGib * DATA.gib;
    const free = budget - m.params * hw.wdb;
    const kv = kvPerToken(m, hw.kvb);
    const perSequence = Number.isInteger(kv) ? exact(c, kv) : c * kv;
    return Math.max(0, Math.floor(free / perSequence));
  }
  function prefillTime(m, p, hw) {  // planning.prefill_time
    const flops = prefillFlops(m, p);
    const weights = m.params * hw.wdb;
    return Math.max(flops / (hw.tp * hw.peak * hw.ceff), weights / (hw.tp * hw.bw * hw.beff)) + hw.overhead;
  }
  const prefillComputeTime = (m, p, hw) => prefillFlops(m, p) / (hw.tp * hw.peak * hw.ceff);
  function poissonQuantile(mean, pct) {  // planning.poisson_quantile
    const p = pct / 100;
    if (mean > 1e5) return Math.max(0, Math.ceil(mean + DATA.burst_z * Math.sqrt(mean) - 0.5));
    let k = 0, logPmf = -mean, total = Math.exp(logPmf);
    while (total < p) {
      k += 1;
      logPmf += Math.log(mean / k);
      total += Math.exp(logPmf);
    }
    return k;
  }
  const burstHeadroom = (mean) => Math.max(0, poissonQuantile(mean, DATA.burst_percentile) / mean - 1);
  function replicasForRate(rate, tis, batch, room) {  // planning.replicas_for_rate
    const needed = rate * tis * (1 + room) / batch;
    return Math.max(1, Math.ceil(needed - 1e-9));
  }
  const costPerMillion = (price, gpus, tokens) => price * gpus / DATA.seconds_per_hour / tokens * 1e6;

  function plan(s) {  // planning.plan with mean lengths, at the widget's fixed percentiles
    const m = DATA.models[s.model], card = DATA.cards[s.gpu];
    const [wdb, kvb] = DATA.precisions[s.precision];
    const fp8 = DATA.fp8_weights.includes(s.precision) && card.fp8_peak_flops > 0;  // FP8 matmuls (W8A8)
    const matmulPeak = fp8 ? card.fp8_peak_flops : card.peak_flops;
    const hw = { wdb, kvb, tp: s.tp, bw: (card.bandwidth / DATA.gb) * DATA.gb,
                 peak: (matmulPeak / 1e12) * 1e12, beff: s.bandwidth_pct / 100, ceff: s.compute_pct / 100,
                 overhead: s.overhead_ms / 1000, memGib: card.usable_bytes / DATA.gib };
    const rate = s.rate, meanPrompt = s.prompt, meanOutput = s.output;
    const ttftTarget = s.ttft_ms / 1000, tpotTarget = s.tpot_ms / 1000;
    const memoryContext = Math.ceil(meanPrompt + meanOutput);
    const stepContext = Math.ceil(meanPrompt + meanOutput / 2);
    const prefillMean = prefillTime(m, Math.ceil(meanPrompt), hw);
    const prefillP = prefillMean;
    const prefillWork = prefillComputeTime(m, Math.ceil(meanPrompt), hw);
    const inMemory = maxBatchInMemory(m, memoryContext, hw);
    const timeInSystem = prefillMean + (meanOutput - 1) * tpotTarget;
    const meanConcurrency = rate * timeInSystem;
    const room = burstHeadroom(meanConcurrency);
    function batchWith(r) {
      const share = rate / r * prefillWork;
      if (share >= 1) return [share, 0];
      return [share, Math.min(maxBatchForTpot(m, stepContext, tpotTarget * (1 - share), hw), inMemory)];
    }
    function enough(r) {
      const b = batchWith(r)[1];
      return b >= 1 && replicasForRate(rate, timeInSystem, b, room) <= r;
    }
    const ceilingBatch = Math.min(maxBatchForTpot(m, stepContext, tpotTarget, hw), inMemory);
    let replicas = 0;
    if (ceilingBatch >= 1) {
      let low = 0, high = 1;
      while (!enough(high)) {
        low = high; high = high * 2;
        if (high > 2 ** 40) throw new Error("the planner found no replica count that carries this load; check the inputs");
      }
      while (high - low > 1) {
        const mid = Math.floor((low + high) / 2);
        if (enough(mid)) high = mid; else low = mid;
      }
      replicas = high;
    }
    const share = replicas ? batchWith(replicas)[0] : 0;
    const byTime = maxBatchForTpot(m, stepContext, tpotTarget * (1 - share), hw);
    const batch = Math.min(byTime, inMemory);
    const feasible = batch >= 1;
    if (!feasible) replicas = 0;
    const step = feasible ? decodeStepTime(m, batch, stepContext, hw) : Infinity;
    const tpot = feasible ? step / (1 - share) : Infinity;
    const ttft = prefillP + (feasible ? step : 0);
    const gpus = replicas * s.tp;
    const outRate = rate * meanOutput, allRate = rate * (meanOutput + meanPrompt);
    const price = (tokens) => (s.price > 0 && feasible ? costPerMillion(s.price, gpus, tokens) : null);
    const utilisation = feasible ? meanConcurrency / (replicas * batch) : 0;
    const kv = kvPerToken(m, kvb);
    return {
      s, m, hw, arrivalRate: rate, stepContext, memoryContext, tp: s.tp, weightBytes: m.params * wdb, kvPerToken: kv,
      prefill: prefillMean, prefillWork, ttft, prefillShare: feasible ? share : 0, batchForTpot: byTime,
      batchInMemory: inMemory, batch, step, tpot,
      kvCache: Number.isInteger(kv) ? exact(batch, memoryContext, kv) : batch * memoryContext * kv,
      budget: DATA.memory_utilization * s.tp * hw.memGib * DATA.gib, timeInSystem, concurrency: meanConcurrency,
      headroom: room, replicas, gpus, utilisation,
      outRate, allRate, costOutput: price(outRate), costAll: price(allRate), ttftTarget, tpotTarget,
      costOutputSaturated: feasible ? price(outRate / utilisation) : null,
      costAllSaturated: feasible ? price(allRate / utilisation) : null,
      fp8, matmulPeak, meetsTtft: ttft <= ttftTarget, feasible,
    };
  }

  // --- labsupport.planner_widget.display_values, string for string
  function texts(p) {
    const s = p.s, tp = p.tp, gpu = s.gpu, rate = plain(p.arrivalRate);
    const budgetText = plain(DATA.memory_utilization * 100) + "% of " + tp + " x " + gpu;
    const free = p.budget - p.weightBytes;
    const out = {
      "concurrency": group(fixed(p.concurrency, 1)) + " requests",
      "concurrency-note": rate + " requests/s x " + seconds(p.timeInSystem) + " in the system",
      "headroom": "Headroom for bursts: +" + percent(p.headroom) + ", for the " + DATA.burst_percentile +
      "th percentile of requests in the system under Poisson arrivals.",
      "throughput": tokRate(p.outRate) + " out",
      "throughput-note": tokRate(p.allRate) + " prompt and output",
      "batch-tpot": p.batchForTpot
        ? "The TPOT target allows a batch of " + count(p.batchForTpot) + " at " + count(p.stepContext) +
          " tokens of context" + (p.feasible ? ", prefill taking " + percent(p.prefillShare) + " of each replica's time." : ".")
        : "Even one sequence misses the " + seconds(p.tpotTarget) + " TPOT target: a decode step reads every weight.",
      "plot-target": "TPOT target " + seconds(p.tpotTarget),
      "plot-memory": "memory holds " + count(p.batchInMemory),
      "device": p.m.label + ", " + s.precision + ", on " + tp + " x " + gpu + " per replica: " + gib(p.weightBytes) +
        " of weights, " + count(p.kvPerToken) + " bytes of KV cache a token." +
        (p.fp8 ? " Matmuls in FP8, at its " + group(fixed(p.matmulPeak / 1e12, 0)) + " TFLOP/s dense FP8 peak." : "") +
        (tp > 1 ? " The all-reduces between the " + tp + " GPUs are not modelled: each step is a lower bound." : ""),
    };
    if (p.batchInMemory === 0) {
      out["memory"] = "The weights (" + gib(p.weightBytes) + ") and one sequence of " + count(p.memoryContext) +
        " tokens do not fit in " + gib(p.budget) + " (" + budgetText + "): more GPUs per replica or fewer bytes per element.";
    } else if (!p.feasible) {
      out["memory"] = "Memory has room for " + plural(p.batchInMemory, "sequence") + " of " + count(p.memoryContext) +
        " tokens: " + gib(free) + " left after the weights in " + gib(p.budget) + " (" + budgetText + ").";
    } else {
      out["memory"] = "KV cache for " + plural(p.batch, "sequence") + " of " + count(p.memoryContext) + " tokens: " +
        gib(p.kvCache) + " of the " + gib(free) + " left after the weights in " + gib(p.budget) + " (" + budgetText +
        "); room for " + count(p.batchInMemory) + ".";
    }
    if (p.feasible) {
      out["replicas"] = count(p.replicas);
      out["replicas-note"] = plural(p.gpus, "GPU") + ", " + tp + " per replica";
      out["batch"] = count(p.batch);
      out["batch-note"] = "TPOT allows " + count(p.batchForTpot) + ", memory " + count(p.batchInMemory);
      out["utilisation"] = percent(p.utilisation);
      out["utilisation-note"] = "of the batch slots, on average";
      out["tpot"] = seconds(p.tpot);
      out["tpot-note"] = "the mean: step " + seconds(p.step) + ", prefill turns included";
      out["ttft"] = seconds(p.ttft);
      out["ttft-note"] = (p.meetsTtft ? "meets" : "misses") + " the " + seconds(p.ttftTarget) + " target";
      if (p.costAll === null) {
        out["cost"] = "no price"; out["cost-note"] = "enter a GPU-hour price";
        out["cost-saturation"] = "no price"; out["cost-saturation-note"] = "enter a GPU-hour price";
      } else {
        out["cost"] = cost(p.costAll);
        out["cost-note"] = cost(p.costOutput) + " per million output tokens";
        out["cost-saturation"] = cost(p.costAllSaturated);
        out["cost-saturation-note"] = cost(p.costOutputSaturated) + " per million output tokens, every batch slot busy";
      }
      out["plot-batch"] = "batch " + count(p.batch);
      const what = plural(p.replicas, "replica") + " of " + tp + " x " + gpu + " (" + plural(p.gpus, "GPU") + ") " +
        (p.replicas === 1 ? "carries " : "carry ") + rate + " requests/s";
      out["verdict"] = p.meetsTtft ? what + " within both targets." :
        what + " within the TPOT target, but the predicted TTFT misses its target: more GPUs per replica.";
    } else {
      for (const key of ["replicas", "batch", "utilisation", "tpot", "ttft", "cost", "cost-saturation"]) out[key] = "none";
      out["replicas-note"] = "no replica meets the targets";
      out["batch-note"] = "TPOT allows " + count(p.batchForTpot) + ", memory " + count(p.batchInMemory);
      out["utilisation-note"] = "nothing runs";
      out["tpot-note"] = "target " + seconds(p.tpotTarget);
      out["ttft-note"] = "target " + seconds(p.ttftTarget);
      out["cost-note"] = "no plan, no price";
      out["cost-saturation-note"] = "no plan, no price";
      out["plot-batch"] = "no batch meets both";
      out["verdict"] = "No replica can meet these targets: " +
        (p.batchInMemory === 0 ? "the weights and one sequence do not fit." : "the TPOT target is too tight.");
    }
    return out;
  }

  // --- the plot: decode step against the batch (log-log), the TPOT target, the memory limit
  function plotBatches(p) {  // planner_widget.plot_batches
    const top = Math.max(16, 2 * p.batchForTpot, 2 * p.batchInMemory);
    const k = Math.min(20, Math.ceil(Math.log2(top)));
    const out = [];
    for (let i = 0; i <= k; i++) out.push(2 ** i);
    return out;
  }
  const esc = (t) => String(t).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  function svgPlot(p, t) {
    const xs = plotBatches(p);
    const steps = xs.map((b) => decodeStepTime(p.m, b, p.stepContext, p.hw) * 1000);
    const stretch = p.prefillShare > 0 ? steps.map((v) => v / (1 - p.prefillShare)) : [];
    const target = p.tpotTarget * 1000;
    const all = steps.concat(stretch, [target]);
    const yLo = Math.floor(Math.log10(Math.min(...all) / 1.5)), yHi = Math.ceil(Math.log10(Math.max(...all) * 1.5));
    const xHi = Math.log2(xs[xs.length - 1]);
    const W = 720, H = 380, L = 64, R = 20, T = 28, B = 46;
    const X = (b) => L + Math.log2(b) / xHi * (W - L - R);
    const Y = (v) => H - B - (Math.log10(v) - yLo) / (yHi - yLo) * (H - T - B);
    const f = (v) => v.toFixed(1);
    const line = (vals) => vals.map((v, i) => f(X(xs[i])) + "," + f(Y(v))).join(" ");
    let svg = '<svg viewBox="0 0 ' + W + " " + H + '" role="img" aria-label="decode step time against the batch">';
    svg += '<text x="' + L + '" y="18" font-size="14" font-weight="600">The batch a TPOT target allows (one replica)</text>';
    for (let e = yLo; e <= yHi; e++) {
      const v = Math.pow(10, e);
      svg += '<line x1="' + L + '" x2="' + (W - R) + '" y1="' + f(Y(v)) + '" y2="' + f(Y(v)) + '" stroke="#eaeef2"/>';
      svg += '<text x="' + (L - 6) + '" y="' + f(Y(v) + 4) + '" font-size="11" text-anchor="end" fill="#57606a">' +
        (e < 0 ? String(v) : String(Math.round(v))) + " ms</text>";
    }
    const every = Math.max(1, Math.ceil(xs.length / 11));
    xs.forEach((b, i) => {
      if (i % every) return;
      svg += '<text x="' + f(X(b)) + '" y="' + (H - B + 16) + '" font-size="11" text-anchor="middle" fill="#57606a">' +
        (b >= 1024 ? b / 1024 + "K" : b) + "</text>";
    });
    svg += '<text x="' + ((L + W - R) / 2) + '" y="' + (H - 10) + '" font-size="12" text-anchor="middle">' +
      "sequences in the batch</text>";
    svg += '<line x1="' + L + '" x2="' + (W - R) + '" y1="' + f(Y(target)) + '" y2="' + f(Y(target)) + '" stroke="' +
      DATA.colours.target + '" stroke-width="2"/>';
    if (p.batchInMemory >= 1 && p.batchInMemory <= xs[xs.length - 1]) {
      svg += '<line x1="' + f(X(p.batchInMemory)) + '" x2="' + f(X(p.batchInMemory)) + '" y1="' + T + '" y2="' + (H - B) +
        '" stroke="' + DATA.colours.memory + '" stroke-width="2" stroke-dasharray="2 4"/>';
    }
    svg += '<polyline fill="none" stroke="' + DATA.colours.step + '" stroke-width="2.5" points="' + line(steps) + '"/>';
    if (stretch.length) {
      svg += '<polyline fill="none" stroke="' + DATA.colours.step + '" stroke-width="1.5" stroke-dasharray="6 4" points="' +
        line(stretch) + '"/>';
    }
    if (p.feasible) {
      svg += '<circle cx="' + f(X(p.batch)) + '" cy="' + f(Y(p.tpot * 1000)) + '" r="6" fill="' + DATA.colours.step + '"/>';
      svg += '<text x="' + f(X(p.batch) + 9) + '" y="' + f(Y(p.tpot * 1000) + 16) + '" font-size="12" fill="' +
        DATA.colours.step + '">' + esc(t["plot-batch"]) + "</text>";
    }
    return svg + "</svg>";
  }

  // --- controls
  const NAMES = {
    rate: "The arrival rate", prompt: "The prompt length", output: "The output length", ttft_ms: "The TTFT target",
    tpot_ms: "The TPOT target", bandwidth_pct: "The bandwidth efficiency", compute_pct: "The compute efficiency",
    overhead_ms: "The overhead per step", price: "The price",
  };
  function problem(s) {  // the planner's own argument checks, as messages for a reader
    for (const key of ["rate", "prompt", "ttft_ms", "tpot_ms"]) {
      if (!(s[key] > 0)) return NAMES[key] + " must be a number greater than 0.";
    }
    if (!(s.output >= 1)) return NAMES.output + " must be at least 1 token (the first token).";
    for (const key of ["bandwidth_pct", "compute_pct"]) {
      if (!(s[key] > 0 && s[key] <= 100)) return NAMES[key] + " is a percentage: above 0 and at most 100.";
    }
    for (const key of ["overhead_ms", "price"]) {
      if (!(s[key] >= 0)) return NAMES[key] + " must be a number, 0 or more.";
    }
    return null;
  }
  const state = Object.assign({}, START);
  function render() {
    const error = problem(state);
    const box = $("[data-error]"), results = $(".pl-results");
    let p = null;
    let message = error;
    if (!error) {
      try { p = plan(state); } catch (exc) { message = String(exc.message || exc); }
    }
    for (const el of root.querySelectorAll("[data-control]")) el.classList.remove("pl-wrong");
    if (message) {
      box.hidden = false; box.textContent = message; results.hidden = true;
      return;
    }
    box.hidden = true; box.textContent = ""; results.hidden = false;
    const t = texts(p);
    for (const el of root.querySelectorAll(".pl-text[data-out]")) el.textContent = t[el.dataset.out];
    $(".pl-svg").innerHTML = svgPlot(p, t);
    $(".pl-verdict").classList.toggle("pl-bad", !(p.feasible && p.meetsTtft));
    $('[data-out="memory"]').classList.toggle("pl-bad", p.batchInMemory === 0);
    root.querySelector(".pl-legend-stretch").hidden = !(p.prefillShare > 0);
  }
  for (const el of root.querySelectorAll("[data-control]")) {
    const key = el.dataset.control;
    el.value = String(state[key]);
    const read = () => {
      if (el.tagName === "SELECT") state[key] = key === "tp" ? Number(el.value) : el.value;
      else state[key] = el.value.trim() === "" ? NaN : Number(el.value);
      render();
    };
    el.addEventListener(el.tagName === "SELECT" ? "change" : "input", read);
  }
  render();
  root.dataset.ready = "1";
}
