// Checks JSON values against TypeScript types, strictly, with the TypeScript compiler's
// own type checker: the types of @grafana/schema and @grafana/data as the installed npm
// packages declare them (tests/stack/npm/dashboard.ts says which type checks what).
//
//   node schema.cjs <npm dir>
//   stdin:  {files: {name: TypeScript source}, checks: [{file, type, value}]}
//   stdout: {errors: [[message, ...] per check], schemaVersion, versions: {package: version}}
//
// A value matches a type when: an object has every required property (unless the
// package's generated default for its interface supplies it: Grafana fills those in) and
// no property the type lacks, unless the type has a string index signature; a union
// when one member matches; literals and enums by value; arrays element by element.
// `any` and `unknown` accept anything: that is where the types themselves are open.
"use strict";
const fs = require("fs");
const path = require("path");

const npm = path.resolve(process.argv[2]);
const ts = require(path.join(npm, "node_modules", "typescript"));
const input = JSON.parse(fs.readFileSync(0, "utf8"));

// The sources are virtual files inside the npm folder, so their imports resolve from its
// node_modules. Node10 resolution reads the packages' dist/types paths as they are.
const dir = path.join(npm, "__checked__");
const sources = Object.fromEntries(Object.entries(input.files).map(([name, text]) => [path.join(dir, name), text]));
const options = {
  strict: true,
  noEmit: true,
  skipLibCheck: true,
  types: [],
  target: ts.ScriptTarget.ES2022,
  module: ts.ModuleKind.CommonJS,
  moduleResolution: ts.ModuleResolutionKind.Node10,
};
const host = ts.createCompilerHost(options);
const { getSourceFile, fileExists, readFile } = host;
host.getSourceFile = (file, lang, ...rest) =>
  file in sources ? ts.createSourceFile(file, sources[file], lang, true) : getSourceFile.call(host, file, lang, ...rest);
host.fileExists = (file) => file in sources || fileExists.call(host, file);
host.readFile = (file) => (file in sources ? sources[file] : readFile.call(host, file));
const program = ts.createProgram(Object.keys(sources), options, host);

// The binding files must compile: a type or import that no longer exists is an error.
const diagnostics = ts.getPreEmitDiagnostics(program).filter((d) => d.file && d.file.fileName in sources);
if (diagnostics.length) {
  for (const d of diagnostics) {
    const { line } = d.file.getLineAndCharacterOfPosition(d.start);
    console.error(`${path.basename(d.file.fileName)}:${line + 1}: ${ts.flattenDiagnosticMessageText(d.messageText, "\n")}`);
  }
  process.exit(2);
}
const checker = program.getTypeChecker();
const F = ts.TypeFlags;

function exported(file, name) {
  const module = checker.getSymbolAtLocation(program.getSourceFile(path.join(dir, file)));
  const symbol = checker.getExportsOfModule(module).find((s) => s.getName() === name);
  if (!symbol) throw new Error(`${file} exports no type ${name}`);
  return checker.getDeclaredTypeOfSymbol(symbol);
}

// @grafana/schema's generated default for the interface declaring `prop` (`defaultOptions`
// for `Options`, from the schema's CUE defaults), in the compiled module next to the
// declaration: a required field with a default may be left out, Grafana fills it in.
const schemaTypes = path.join(npm, "node_modules", "@grafana", "schema", "dist", "types") + path.sep;
const modules = new Map();
function hasDefault(prop) {
  const decl = prop.declarations && prop.declarations[0];
  const owner = decl && decl.parent;
  if (!owner || !ts.isInterfaceDeclaration(owner)) return false;
  const file = path.resolve(decl.getSourceFile().fileName);
  if (!file.startsWith(schemaTypes)) return false;
  const compiled = path.join(schemaTypes, "..", "cjs", file.slice(schemaTypes.length).replace(/\.d\.ts$/, ".cjs"));
  if (!modules.has(compiled)) modules.set(compiled, fs.existsSync(compiled) ? require(compiled) : {});
  const defaults = modules.get(compiled)[`default${owner.name.text}`];
  return typeof defaults === "object" && defaults !== null && prop.getName() in defaults;
}

const literal = (t) => (t.flags & F.BooleanLiteral ? t.intrinsicName === "true" : t.value);
const isLiteral = (t) => !!(t.flags & (F.StringLiteral | F.NumberLiteral | F.BooleanLiteral));
const isPlainObject = (v) => typeof v === "object" && v !== null && !Array.isArray(v);
const show = (v) => JSON.stringify(v);

const listed = (values) => values.slice(0, 12).map(show).join(", ") + (values.length > 12 ? ", ..." : "");

// The literal-typed properties of an object type (a panel's `type`, an override's `id`).
const discriminants = (t) =>
  t.flags & (F.Object | F.Intersection)
    ? checker.getPropertiesOfType(t).filter((p) => isLiteral(checker.getTypeOfSymbol(p)))
    : [];

// Members of a union whose discriminants agree with value; [] with an error when none
// does and they all share one (`type` of a panel that is no known kind).
function matchingMembers(members, value, where, errors) {
  if (!isPlainObject(value)) return members;
  const fits = members.filter((m) =>
    discriminants(m).every((p) =>
      p.getName() in value
        ? value[p.getName()] === literal(checker.getTypeOfSymbol(p))
        : !!(p.flags & ts.SymbolFlags.Optional)));
  if (fits.length) return fits;
  for (const name of Object.keys(value)) {
    const allowed = members.map((m) => discriminants(m).find((p) => p.getName() === name));
    if (allowed.every(Boolean)) {
      errors.push(`${where}.${name}: ${show(value[name])} is not one of ${listed(allowed.map((p) => literal(checker.getTypeOfSymbol(p))))}`);
      return [];
    }
  }
  return members;
}

function check(value, type, where, errors) {
  if (type.flags & (F.Any | F.Unknown)) return;
  if (type.isUnion()) {
    const members = type.types.filter((t) => !(t.flags & F.Undefined));
    if (members.every(isLiteral)) {
      if (!members.some((t) => literal(t) === value)) {
        errors.push(`${where}: ${show(value)} is not one of ${listed(members.map(literal))}`);
      }
      return;
    }
    if (!members.some((t) => t.flags & (F.Object | F.Intersection))) {  // number | null, string | string[]
      const found = [];
      for (const member of members) {
        found.length = 0;
        check(value, member, where, found);
        if (!found.length) return;
      }
      errors.push(`${where}: ${show(value)} is not ${members.map((t) => checker.typeToString(t)).join(" | ")}`);
      return;
    }
    let best = null;
    for (const member of matchingMembers(members, value, where, errors)) {
      const found = [];
      check(value, member, where, found);
      if (!found.length) return;
      if (best === null || found.length < best.length) best = found;
    }
    if (best) errors.push(...best);
    return;
  }
  if (isLiteral(type)) {
    if (value !== literal(type)) errors.push(`${where}: ${show(value)} is not ${show(literal(type))}`);
    return;
  }
  const primitive = [[F.String, "string"], [F.Number, "number"], [F.Boolean, "boolean"]].find(([f]) => type.flags & f);
  if (primitive) {
    if (typeof value !== primitive[1]) errors.push(`${where}: ${show(value)} is not a ${primitive[1]}`);
    return;
  }
  if (type.flags & F.Null) {
    if (value !== null) errors.push(`${where}: ${show(value)} is not null`);
    return;
  }
  if (type.flags & F.Never) {
    errors.push(`${where}: not allowed`);
    return;
  }
  if (type.flags & F.NonPrimitive) {
    if (typeof value !== "object" || value === null) errors.push(`${where}: ${show(value)} is not an object`);
    return;
  }
  if (checker.isArrayType(type)) {
    if (!Array.isArray(value)) return void errors.push(`${where}: ${show(value)} is not an array`);
    const [element] = checker.getTypeArguments(type);
    value.forEach((v, i) => check(v, element, `${where}[${i}]`, errors));
    return;
  }
  if (checker.isTupleType(type)) {
    const elements = checker.getTypeArguments(type);
    if (!Array.isArray(value) || value.length !== elements.length) {
      return void errors.push(`${where}: ${show(value)} is not a ${elements.length}-tuple`);
    }
    value.forEach((v, i) => check(v, elements[i], `${where}[${i}]`, errors));
    return;
  }
  if (type.flags & (F.Object | F.Intersection)) {
    if (!isPlainObject(value)) return void errors.push(`${where}: ${show(value)} is not an object`);
    const props = new Map(checker.getPropertiesOfType(type).map((p) => [p.getName(), p]));
    const index = checker.getIndexInfosOfType(type).find((i) => i.keyType.flags & F.String);
    for (const [name, prop] of props) {
      if (name in value) check(value[name], checker.getTypeOfSymbol(prop), `${where}.${name}`, errors);
      else if (!(prop.flags & ts.SymbolFlags.Optional) && !hasDefault(prop)) errors.push(`${where}.${name}: missing (required)`);
    }
    for (const name of Object.keys(value)) {
      if (props.has(name)) continue;
      if (index) check(value[name], index.type, `${where}.${name}`, errors);
      else errors.push(`${where}.${name}: unknown field (${checker.typeToString(type).slice(0, 80)} has no such property)`);
    }
    return;
  }
  errors.push(`${where}: the checker cannot read the type ${checker.typeToString(type)}`);
}

const out = { errors: [], versions: {} };
for (const { file, type, value } of input.checks) {
  const errors = [];
  check(value, exported(file, type), "$", errors);
  out.errors.push(errors);
}
// The newest dashboard schemaVersion this Grafana knows (what it saves).
out.schemaVersion = require(path.join(npm, "node_modules", "@grafana", "schema")).defaultDashboard.schemaVersion;
for (const name of ["@grafana/schema", "@grafana/data", "typescript"]) {
  out.versions[name] = require(path.join(npm, "node_modules", name, "package.json")).version;
}
process.stdout.write(JSON.stringify(out));
