// Runs @grafana/data's own rangeutil and datemath (the installed npm package) on the
// cases read as JSON from stdin; writes the results as JSON to stdout. One process
// answers every case of tests/stack/test_grafana_npm.py.
//
//   node rangeutil.cjs <npm dir>
//   stdin: {now, round: [ms], intervalToMs: [text], secondsToHms: [s],
//           calculate: [[range, resolution, lowLimit]]}, a range in ms or [from, to] (e.g. "now-1h")
//
// The modules are loaded by file: the package's index (which re-exports them as
// rangeUtil and dateMath) needs a browser `window`. Each result is {value} or {error}.
"use strict";
const path = require("path");

const npm = path.resolve(process.argv[2]);
const dist = path.join(npm, "node_modules", "@grafana", "data", "dist", "cjs", "datetime");
const rangeutil = require(path.join(dist, "rangeutil.cjs"));
const datemath = require(path.join(dist, "datemath.cjs"));
const { dateTime } = require(path.join(dist, "moment_wrapper.cjs"));

function attempt(fn) {
  try {
    const value = fn();
    return { value: typeof value === "number" && !Number.isFinite(value) ? String(value) : value };
  } catch (e) {
    return { error: String(e.message || e) };
  }
}

const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
// datemath.parse reads the clock for each end: one fixed `now` for both (parseDateMath).
const now = dateTime(input.now).utc();
const at = (text, roundUp) =>
  text.startsWith("now") ? datemath.parseDateMath(text.slice(3), now, roundUp) : datemath.parse(text, roundUp, "utc");

const out = {
  round: input.round.map((ms) => attempt(() => rangeutil.roundInterval(ms))),
  intervalToMs: input.intervalToMs.map((s) => attempt(() => rangeutil.intervalToMs(s))),
  secondsToHms: input.secondsToHms.map((s) => attempt(() => rangeutil.secondsToHms(s))),
  calculate: input.calculate.map(([range, resolution, low]) =>
    attempt(() => {
      const [from, to] = typeof range === "number" ? [dateTime(0), dateTime(range)] : [at(range[0], false), at(range[1], true)];
      return { rangeMs: to.valueOf() - from.valueOf(), ...rangeutil.calculateInterval({ from, to }, resolution, low) };
    })),
  version: require(path.join(npm, "node_modules", "@grafana", "data", "package.json")).version,
};
process.stdout.write(JSON.stringify(out));
