// Shown under a notebook cell that raised (labsupport/_run_all.py writes it, with the time it was
// written in place of EMITTED_MS). JupyterLab's Run All moves the view to the notebook's last cell as
// it starts; when a cell fails, the cells after it do not run, so bring the failed cell back into
// view, its top at the top of the notebook. A cell already in full view is left where it is (a cell
// run on its own). The script runs in JupyterLab or Notebook 7 while the output is new; a notebook
// reopened later, another frontend, or an untrusted output does nothing.
(function () {
  try {
    var script = document.currentScript;
    var cell = script && script.closest(".jp-Cell");
    if (!cell || Math.abs(Date.now() - EMITTED_MS) > 60000) {
      return;
    }
    var bring = function () {
      var panel = cell.closest(".jp-WindowedPanel-outer, .jp-Notebook");
      var view = panel ? panel.getBoundingClientRect() : { top: 0, bottom: window.innerHeight };
      var box = cell.getBoundingClientRect();
      if (box.top < view.top || box.bottom > view.bottom) {
        cell.scrollIntoView({ block: "start" });
      }
    };
    // twice: the cells above may still change height as their outputs settle
    setTimeout(bring, 100);
    setTimeout(bring, 800);
  } catch (e) {
    // never let this script show an error of its own
  }
})();
