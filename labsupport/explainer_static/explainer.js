// The two-phase explainer for pages without a Python kernel (the HTML book).
//
// labsupport/explainer.py inlines this file into the page, after two JSON blocks: the tables
// (models, cards, slider stops, choices; generated from labsupport) and the starting setting.
// model() re-implements labsupport.serving.phases operation for operation, and texts()
// labsupport.explainer.display_values string for string: a browser test checks both agree.

/* exported labsupportExplainer */
function labsupportExplainer(root) {
  "use strict";
  const json = (name) => JSON.parse(root.querySelector('script[data-xp="' + name + '"]').textContent);
  const DATA = json("data");
  const START = json("start");
  const $ = (sel) => root.querySelector(sel);

  // Number formatting (number_format.js, shared with the planner), then this widget's own units.
  const { fixed, group, seconds, percent } = labsupportNumberFormat();
  const rate = (r) => group(fixed(r, r < 10 ? 1 : 0)) + " tok/s";
  const intensity = (x) => { const t = fixed(x, x < 10 ? 1 : 0); return (x >= 10000 ? group(t) : t) + " FLOP/B"; };
  function gb(b) { const g = b / 1e9; return group(fixed(g, g < 10 ? 2 : g < 100 ? 1 : 0)) + " GB"; }
  function three(v) {
    let t = fixed(v, v < 10 ? 2 : v < 100 ? 1 : 0);
    if (t.includes(".")) t = t.replace(/0+$/, "").replace(/\.$/, "");
    return t;
  }
  function si(v, unit) {
    for (const [f, p] of [[1e15, "P"], [1e12, "T"], [1e9, "G"]]) if (v >= f) return three(v / f) + " " + p + unit;
    return three(v) + " " + unit;
  }
  const tokens = (n) => (n >= 1024 && n % 1024 === 0 ? n / 1024 + "K" : String(n));
  const plural = (n, w) => n + " " + w + (n === 1 ? "" : "s");

  // The phase model: labsupport.serving, operation for operation.
  function kernel(name, flops, bytes, peak, bw) {
    const compute = flops / peak, memory = bytes / bw;
    const time = Math.max(compute, memory);
    const attained = flops / time;
    return { name, flops, bytes, time, intensity: flops / bytes, attained, fraction: attained / peak,
             bound: compute >= memory ? "compute" : "memory" };
  }
  function phase(name, kernels, roofline, peak, bw) {
    const flops = kernels[0].flops + kernels[1].flops, bytes = kernels[0].bytes + kernels[1].bytes;
    const compute = flops / peak, memory = bytes / bw;
    const merged = roofline === "merged";
    const time = merged ? Math.max(compute, memory) : kernels[0].time + kernels[1].time;
    const attained = flops / time;
    let bound;
    if (merged) bound = compute >= memory ? "compute" : "memory";
    else bound = kernels[0].bound === kernels[1].bound ? kernels[0].bound : "mixed";
    return { name, kernels, matmuls: kernels[0], attention: kernels[1], flops, bytes, time,
             intensity: flops / bytes, attained, fraction: attained / peak, bound, merged };
  }
  // Attention reads each token's queries and writes its output: d values each, every layer.
  function qo(m, tokens) { return 2 * m.n_layers * tokens * m.d_model * DATA.weight_bytes; }
  function model(s) {
    const m = DATA.models[s.model], c = DATA.cards[s.card];
    const n = s.params === "nominal" ? m.nominal_params : m.counted_params;
    const peak = c.peak_flops * s.count, bw = c.bandwidth * s.count, mem = c.memory_bytes * s.count;
    const kv = m.kv_values_per_token * DATA.kv_bytes;
    const p = s.prompt, o = s.output, b = s.batch;
    const tokensIn = b * p;
    const cacheIn = tokensIn * kv;
    let preAttn = 0;
    if (s.attention !== "none") {
      const attn = 4 * m.n_layers * p * p * m.d_model;
      preAttn = b * (s.attention === "causal" ? attn / 2 : attn);
    }
    const pre = phase("prefill", [
      kernel("weight matmuls", 2 * n * tokensIn, n * DATA.weight_bytes + cacheIn, peak, bw),
      kernel("attention", preAttn, cacheIn + qo(m, tokensIn), peak, bw),
    ], s.roofline, peak, bw);
    const ctx = s.decode_context === "start" ? p : s.decode_context === "end" ? p + o - 1 : p + (o - 1) / 2;
    let decAttn = 0;
    if (s.attention !== "none") decAttn = b * 4 * m.n_layers * ctx * m.d_model;
    const dec = phase("decode", [
      kernel("weight matmuls", 2 * n * b, n * DATA.weight_bytes + b * kv, peak, bw),
      kernel("attention", decAttn, b * ctx * kv + qo(m, b), peak, bw),
    ], s.roofline, peak, bw);
    const ttft = pre.time, itl = dec.time;
    const steps = s.decode_steps === "output" ? o : o - 1;
    const latency = ttft + steps * itl;
    const throughput = s.throughput === "decode" ? b / itl : b * o / latency;
    const weights = n * DATA.weight_bytes, cache = b * (p + o) * kv;
    return { s, pre, dec, ttft, itl, latency, throughput, peak, bw, mem, weights, cache,
             ridge: peak / bw, free: mem - weights, fits: weights + cache <= mem };
  }

  // What the roofline shows: one point per phase (merged) or one per kernel with FLOPs.
  function points(r) {
    if (r.s.roofline === "merged") return [["prefill", r.pre, "prefill"], ["decode", r.dec, "decode"]];
    const out = [];
    for (const ph of [r.pre, r.dec]) {
      out.push([ph.name, ph.matmuls, ph.name]);
      if (ph.attention.flops > 0) out.push([ph.name + "-attention", ph.attention, ph.name]);
    }
    return out;
  }
  function boundNote(ph, what) {
    if (ph.bound !== "mixed") return what + ", " + ph.bound + "-bound";
    return what + ": matmuls " + ph.matmuls.bound + "-bound, attention " + ph.attention.bound + "-bound";
  }
  function split(ph, what) {
    return what + " = weight matmuls " + seconds(ph.matmuls.time) + " (" + ph.matmuls.bound + "-bound) + attention " +
      seconds(ph.attention.time) + " (" + ph.attention.bound + "-bound)";
  }
  function texts(r) {
    const s = r.s, m = DATA.models[s.model];
    const what = s.batch === 1 ? tokens(s.prompt) + " tokens" : s.batch + " x " + tokens(s.prompt) + " tokens";
    let memory;
    if (r.weights > r.mem) {
      memory = "The weights alone (" + gb(r.weights) + ") exceed the " + gb(r.mem) + " of memory: this setting cannot run.";
    } else {
      memory = "KV cache at the last token: " + gb(r.cache) + " for " + plural(s.batch, "request") + ", against " +
        gb(r.free) + " left after " + gb(r.weights) + " of weights: " + (r.fits ? "fits" : "does not fit") + ".";
    }
    const dtype = DATA.weight_bytes === 2 ? "bf16" : three(DATA.weight_bytes) + "-byte weights";
    const out = {
      "ttft": seconds(r.ttft), "ttft-note": boundNote(r.pre, "prefill"),
      "itl": seconds(r.itl), "itl-note": boundNote(r.dec, "one decode step"),
      "latency": seconds(r.latency), "latency-note": plural(s.output, "token") + " end to end",
      "throughput": rate(r.throughput), "throughput-note": "across " + plural(s.batch, "request"),
      "steps": "prefill = " + fixed(r.ttft / r.itl, 1) + " decode steps",
      "ridge": "ridge " + intensity(r.ridge),
      "device": m.label + " in " + dtype + " on " + s.count + "x " + s.card + ": " + si(r.peak, "FLOP/s") +
        " dense peak against " + si(r.bw, "B/s") + ".",
      "memory": memory,
    };
    if (s.roofline === "merged") {
      out["prefill-label"] = "prefill, " + what;
      out["decode-label"] = "decode, batch " + s.batch;
    } else {
      out["prefill-label"] = "prefill matmuls, " + what;
      out["prefill-attention-label"] = "prefill attention";
      out["decode-label"] = "decode matmuls, batch " + s.batch;
      out["decode-attention-label"] = "decode attention";
      out["prefill-split"] = split(r.pre, "prefill");
      out["decode-split"] = split(r.dec, "one decode step");
    }
    for (const [key, k] of points(r)) out[key + "-point"] = intensity(k.intensity) + ", " + percent(k.fraction) + " of peak";
    if (r.weights > r.mem) {
      // a setting that cannot run has no latency or throughput (as the planner says "none"); one
      // whose cache outgrows the memory keeps its times, which the memory line says do not fit
      for (const key of ["ttft", "itl", "latency", "throughput"]) { out[key] = "none"; out[key + "-note"] = "the weights do not fit"; }
    }
    return out;
  }

  // The roofline, drawn as SVG on log axes (the frame as labsupport.explainer.roofline_frame).
  const HALO = 'stroke="#fff" stroke-width="4" stroke-linejoin="round" paint-order="stroke"';
  const esc = (t) => String(t).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  function axisLabel(v, unit) {
    const e = Math.round(Math.log10(v));
    const names = { 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E" };
    if (unit === "") {
      if (e < 0) return String(v);
      const base = 3 * Math.floor(e / 3);
      return Math.pow(10, e - base) + names[base];
    }
    const base = 3 * Math.floor(e / 3);
    return Math.pow(10, e - base) + " " + (names[base] || "") + unit;
  }
  function roofline(r, t) {
    const pts = points(r).map((pt) => pt[1]);
    const lo = Math.min(Math.min(...pts.map((p) => p.intensity)), r.ridge);
    const hi = Math.max(Math.max(...pts.map((p) => p.intensity)), r.ridge);
    const xLo = Math.floor(Math.log10(lo / 2)), xHi = Math.ceil(Math.log10(hi * 2));
    const xMin = Math.pow(10, xLo), xMax = Math.pow(10, xHi);
    const yLow = Math.min(Math.min(...pts.map((p) => p.attained)), r.bw * xMin);
    const yLo = Math.floor(Math.log10(yLow)), yHi = Math.ceil(Math.log10(r.peak * 4));
    const W = 720, H = 420, L = 72, R = 20, T = 30, B = 50;
    const X = (v) => L + (Math.log10(v) - xLo) / (xHi - xLo) * (W - L - R);
    const Y = (v) => H - B - (Math.log10(v) - yLo) / (yHi - yLo) * (H - T - B);
    const f = (v) => v.toFixed(1);
    const title = r.s.roofline === "merged" ? "Prefill and decode on the roofline" :
      "Each kernel on the roofline (filled: weight matmuls; hollow: attention)";
    let svg = '<svg viewBox="0 0 ' + W + " " + H + '" role="img" aria-label="roofline with prefill and decode">';
    svg += '<text x="' + L + '" y="18" font-size="14" font-weight="600">' + title + "</text>";
    for (let e = xLo; e <= xHi; e++) {
      const v = Math.pow(10, e);
      svg += '<line x1="' + f(X(v)) + '" x2="' + f(X(v)) + '" y1="' + T + '" y2="' + (H - B) + '" stroke="#eaeef2"/>';
      svg += '<text x="' + f(X(v)) + '" y="' + (H - B + 16) + '" font-size="11" text-anchor="middle" fill="#57606a">' +
        axisLabel(v, "") + "</text>";
    }
    for (let e = yLo; e <= yHi; e++) {
      const v = Math.pow(10, e);
      svg += '<line x1="' + L + '" x2="' + (W - R) + '" y1="' + f(Y(v)) + '" y2="' + f(Y(v)) + '" stroke="#eaeef2"/>';
      svg += '<text x="' + (L - 6) + '" y="' + f(Y(v) + 4) + '" font-size="11" text-anchor="end" fill="#57606a">' +
        axisLabel(v, "F") + "</text>";
    }
    svg += '<text x="' + ((L + W - R) / 2) + '" y="' + (H - 12) + '" font-size="12" text-anchor="middle">' +
      "arithmetic intensity (FLOP per byte read from memory)</text>";
    svg += '<text transform="translate(16,' + ((T + H - B) / 2) + ') rotate(-90)" font-size="12" text-anchor="middle">' +
      "attained FLOP/s</text>";
    svg += '<polyline fill="none" stroke="#24292f" stroke-width="2.5" points="' + f(X(xMin)) + "," + f(Y(r.bw * xMin)) +
      " " + f(X(r.ridge)) + "," + f(Y(r.peak)) + " " + f(X(xMax)) + "," + f(Y(r.peak)) + '"/>';
    svg += '<line x1="' + f(X(r.ridge)) + '" x2="' + f(X(r.ridge)) + '" y1="' + f(Y(r.peak)) + '" y2="' + (H - B) +
      '" stroke="#8c959f" stroke-dasharray="4 4"/>';
    svg += '<text data-out="ridge" x="' + f(X(r.ridge) + 5) + '" y="' + (H - B - 8) + '" font-size="11" fill="#57606a" ' + HALO + ">" +
      esc(t["ridge"]) + "</text>";
    // the regions' names at the foot of the ridge, under the roof, where no point or point label goes
    svg += '<text x="' + f(X(r.ridge) - 8) + '" y="' + (H - B - 24) + '" font-size="11" text-anchor="end" fill="#57606a" ' +
      HALO + ">\u2190 memory-bound</text>";
    svg += '<text x="' + f(X(r.ridge) + 5) + '" y="' + (H - B - 24) + '" font-size="11" fill="#57606a" ' + HALO +
      ">compute-bound \u2192 (peak " + esc(si(r.peak, "FLOP/s")) + ")</text>";
    for (const [key, p, ph] of points(r)) {
      const colour = DATA.colours[ph];
      const hollow = key.endsWith("-attention");
      const cx = X(p.intensity), cy = Y(p.attained);
      const anchor = cx > (L + W - R) / 2 ? "end" : "start";
      const dx = anchor === "end" ? -12 : 12;
      const dy = hollow ? -34 : 20;  // attention labels above their point, matmul labels below
      svg += '<circle cx="' + f(cx) + '" cy="' + f(cy) + '" r="7" ' +
        (hollow ? 'fill="#fff" stroke="' + colour + '" stroke-width="3"' : 'fill="' + colour + '"') + "/>";
      svg += '<text x="' + f(cx + dx) + '" y="' + f(cy + dy) + '" font-size="12" text-anchor="' + anchor + '" fill="' + colour + '" ' + HALO + ">";
      svg += '<tspan data-out="' + key + '-label" font-weight="600">' + esc(t[key + "-label"]) + "</tspan>";
      svg += '<tspan data-out="' + key + '-point" x="' + f(cx + dx) + '" dy="15">' + esc(t[key + "-point"]) + "</tspan></text>";
    }
    return svg + "</svg>";
  }

  // Controls.
  const state = Object.assign({}, START);
  const ranges = { prompt: DATA.prompts, output: DATA.outputs, batch: DATA.batches };
  const rangeText = { prompt: (v) => tokens(v) + " tokens", output: (v) => tokens(v) + " tokens",
                      batch: (v) => plural(v, "request") };
  function render() {
    const r = model(state), t = texts(r);
    for (const key of Object.keys(rangeText)) root.querySelector('output[data-for="' + key + '"]').textContent = rangeText[key](state[key]);
    $(".xp-svg").innerHTML = roofline(r, t);
    for (const el of root.querySelectorAll(".xp-text[data-out]")) el.textContent = t[el.dataset.out];
    // The per-kernel split lines exist only on the per-kernel roofline.
    for (const el of root.querySelectorAll(".xp-split")) {
      const key = el.dataset.split;
      if (key in t) { el.hidden = false; el.dataset.out = key; el.textContent = t[key]; }
      else { el.hidden = true; delete el.dataset.out; el.textContent = ""; }
    }
    $(".xp-memory").classList.toggle("xp-bad", !(r.weights <= r.mem && r.fits));
    const share = r.ttft / r.latency;
    $(".xp-bar-prefill").style.width = (100 * share).toFixed(2) + "%";
    $(".xp-bar-decode").style.width = (100 * (1 - share)).toFixed(2) + "%";
  }
  for (const el of root.querySelectorAll("[data-control]")) {
    const key = el.dataset.control;
    if (key in ranges) {
      el.max = String(ranges[key].length - 1);
      el.value = String(ranges[key].indexOf(state[key]));
      el.addEventListener("input", () => { state[key] = ranges[key][Number(el.value)]; render(); });
    } else {
      el.value = String(state[key]);
      el.addEventListener("change", () => { state[key] = key === "count" ? Number(el.value) : el.value; render(); });
    }
  }
  render();
  root.dataset.ready = "1";
}
