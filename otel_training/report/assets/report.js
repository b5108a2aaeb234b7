/* otel-training HTML report: draws the chart specs embedded in the page with uPlot.
   Specs (otel_training/report/charts.py): {id, title, kind, x | categories,
   series: [{label, values, color, dash?, colors?, notes?}], unit, xlabel}.
   kind: "line", "area" (stacked shares), "bars", "stacked-bars", "grouped-bars". */
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("otel-training-data").textContent);
  var HEIGHT = 250;
  var state = { charts: 0, rendered: 0, errors: [] };
  window.otelTrainingReport = state;

  function num(v, digits) {
    if (v == null || isNaN(v)) return "-";
    var a = Math.abs(v);
    if (a >= 1e4) return Math.round(v).toLocaleString("en-US");
    if (a >= 100) return v.toFixed(0);
    if (a >= 10) return v.toFixed(digits == null ? 1 : digits);
    return v.toFixed(digits == null ? 2 : digits);
  }

  function fmt(unit, v) {
    if (v == null) return "-";
    if (unit === "%") return num(v, 1) + "%";
    if (unit === "ms") return num(v) + " ms";
    if (unit === "/s") return num(v) + "/s";
    if (unit === "GiB") return num(v) + " GiB";
    return num(v);
  }

  function clock(s) {
    if (s == null) return "-";
    if (s < 120) return num(s, 1) + " s";
    var m = Math.floor(s / 60), r = Math.round(s - 60 * m);
    if (m < 120) return m + ":" + (r < 10 ? "0" : "") + r;
    return (s / 3600).toFixed(1) + " h";
  }

  function yAxis(unit) {
    return {
      label: unit,
      size: 64,
      values: function (u, vals) {
        return vals.map(function (v) { return v == null ? "" : fmt(unit, v).replace(" " + unit, ""); });
      },
    };
  }

  function zeroBased(u, min, max) {
    return [0, uPlot.rangeNum(0, max > 0 ? max : 1, 0.1, true)[1]];
  }

  function lineChart(spec, width) {
    var stacked = spec.kind === "area";
    var raw = spec.series.map(function (s) { return s.values; });
    var data = [spec.x];
    var bands = [];
    if (stacked) {
      var acc = spec.x.map(function () { return 0; });
      raw.forEach(function (vals) {
        data.push(vals.map(function (v, i) { acc[i] += v || 0; return acc[i]; }));
      });
      for (var i = 1; i < raw.length; i++) bands.push({ series: [i + 1, i] });
    } else {
      // null breaks a line (a mode that did not run there: the spec's breaks);
      // undefined is spanned (a bin where the mode has no window of its own).
      spec.series.forEach(function (s, k) {
        var cut = {};
        (s.breaks || []).forEach(function (i) { cut[i] = true; });
        data.push(raw[k].map(function (v, i) { return v == null ? (cut[i] ? null : undefined) : v; }));
      });
    }
    var series = [{ label: spec.xlabel, value: function (u, v) { return clock(v); } }];
    spec.series.forEach(function (s, k) {
      // Few values (an eval pass of a window or two between training epochs): draw them as
      // points too, or a pass of one window would not show at all.
      var known = raw[k].filter(function (v) { return v != null; }).length;
      series.push({
        label: s.label,
        stroke: s.color,
        width: stacked ? 1 : 1.75,
        dash: s.dash || undefined,
        fill: stacked ? s.color + "cc" : undefined,
        spanGaps: stacked,
        points: { show: !stacked && (spec.x.length <= 30 || known <= 30), size: 5 },
        value: function (u, v, si, i) { return i == null ? "-" : fmt(spec.unit, raw[k][i]); },
      });
    });
    var opts = {
      title: spec.title,
      width: width,
      height: HEIGHT,
      scales: { x: { time: false }, y: stacked ? { range: function () { return [0, 100]; } } : { range: zeroBased } },
      axes: [{ label: spec.xlabel, values: function (u, vals) { return vals.map(clock); } }, yAxis(spec.unit)],
      series: series,
      bands: bands,
    };
    return { opts: opts, data: data };
  }

  function barChart(spec, width) {
    var n = spec.categories.length;
    var x = spec.categories.map(function (_, i) { return i; });
    var raw = spec.series.map(function (s) { return s.values; });
    var data = [x];
    var series = [{ label: spec.xname || "phase", value: function (u, v) { return v == null ? "-" : spec.categories[v]; } }];
    var order = spec.series.map(function (_, k) { return k; });
    if (spec.kind === "stacked-bars") {
      // Cumulative values drawn tallest first: each bar shows through as its phase's part.
      var cum = [], acc = x.map(function () { return 0; });
      raw.forEach(function (vals) { cum.push(vals.map(function (v, i) { acc[i] += v || 0; return acc[i]; })); });
      order = order.reverse();
      order.forEach(function (k) { data.push(cum[k]); });
    } else {
      order.forEach(function (k) { data.push(raw[k]); });
    }
    var grouped = spec.kind === "grouped-bars";
    order.forEach(function (k, j) {
      var s = spec.series[k];
      var barOpts = { size: grouped ? [0.4, 48] : [0.6, 72] };
      if (grouped) barOpts.align = j === 0 ? -1 : 1;
      if (s.colors) barOpts.disp = { fill: { unit: 3, values: function () { return s.colors; } } };
      series.push({
        label: s.label,
        stroke: s.color,
        fill: s.color,
        width: 0,
        points: { show: false },
        paths: uPlot.paths.bars(barOpts),
        value: function (u, v, si, i) {
          if (i == null) return "-";
          var text = fmt(spec.unit, raw[k][i]);
          return s.notes ? text + " (" + s.notes[i] + ")" : text;
        },
      });
    });
    var rotate = n > 4;
    var opts = {
      title: spec.title,
      width: width,
      height: HEIGHT + (rotate ? 40 : 0),
      padding: [12, rotate ? 48 : 12, 0, 0],  // room for the last rotated label
      scales: { x: { time: false, range: function () { return [-0.5, n - 0.5]; } }, y: { range: zeroBased } },
      axes: [
        {
          splits: function () { return x; },
          values: function (u, splits) {
            return splits.map(function (i) {
              var c = spec.categories[i];
              return c == null ? "" : c.length > 26 ? c.slice(0, 25) + "…" : c;
            });
          },
          rotate: rotate ? -30 : 0,
          size: rotate ? 100 : 40,
          grid: { show: false },
        },
        yAxis(spec.unit),
      ],
      series: series,
      legend: { live: true },
    };
    return { opts: opts, data: data };
  }

  function draw(el) {
    var spec = DATA.charts[el.getAttribute("data-chart")];
    state.charts += 1;
    if (!spec) throw new Error("no chart spec " + el.getAttribute("data-chart"));
    var width = Math.max(320, el.clientWidth || 600);
    var made = spec.kind === "line" || spec.kind === "area" ? lineChart(spec, width) : barChart(spec, width);
    var plot = new uPlot(made.opts, made.data, el);
    el.setAttribute("data-rendered", "true");
    state.rendered += 1;
    return plot;
  }

  var plots = [];
  Array.prototype.forEach.call(document.querySelectorAll("[data-chart]"), function (el) {
    try {
      plots.push([el, draw(el)]);
    } catch (e) {
      state.errors.push(String(e && e.stack || e));
      el.textContent = "chart failed: " + e;
    }
  });
  var pending = null;
  window.addEventListener("resize", function () {
    clearTimeout(pending);
    pending = setTimeout(function () {
      plots.forEach(function (p) { p[1].setSize({ width: Math.max(320, p[0].clientWidth), height: p[1].height }); });
    }, 150);
  });
})();
