// Number formatting shared by the static widgets of the HTML book (chapter 05's phase explainer,
// chapter 14's capacity planner). labsupport/explainer.py and labsupport/planner_widget.py inline
// this file in front of each widget's own script. Each function gives, string for string, what its
// Python twin in labsupport/explainer.py gives (_fixed, _group, format_seconds, format_percent):
// toFixed rounds ties away from zero on the exact binary value, as the Python side does.

/* exported labsupportNumberFormat */
function labsupportNumberFormat() {
  "use strict";
  const fixed = (x, d) => x.toFixed(d);
  function group(text) {
    let [whole, frac] = text.split(".");
    const sign = whole.startsWith("-") ? "-" : "";
    whole = whole.replace("-", "").replace(/\B(?=(\d{3})+(?!\d))/g, ",");
    return sign + whole + (frac === undefined ? "" : "." + frac);
  }
  function seconds(s) {
    const ms = s * 1000;
    if (ms < 1) return fixed(ms, 2) + " ms";
    if (s < 1) return fixed(ms, 1) + " ms";
    if (s < 100) return fixed(s, 2) + " s";
    if (s < 3600) return fixed(s / 60, 1) + " min";
    return group(fixed(s / 3600, 1)) + " h";
  }
  const percent = (f) => { const p = f * 100; return fixed(p, p < 10 ? 1 : 0) + "%"; };
  return { fixed, group, seconds, percent };
}
