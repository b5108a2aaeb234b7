"""The ``otel-training`` command line."""

from __future__ import annotations

import sys

_COMMANDS = {
    "demo": ("otel_training.cli.demo", "run a small training job with a slow data pipeline and print its breakdown"),
    "report": ("otel_training.cli.report", "explain a run from Prometheus or a run-end summary file"),
    "compare": ("otel_training.cli.compare", "compare two runs: what got faster or slower, beyond the noise"),
    "top": ("otel_training.cli.top", "watch a run live in the terminal (launch it, or receive its OTLP)"),
    "trace-merge": ("otel_training.cli.trace_merge", "merge trace files (ranks, torch.profiler) on one clock"),
    "profile": ("otel_training.cli.profile", "record a few steps of a running job with torch.profiler"),
    "bench-data": ("otel_training.cli.bench_data", "benchmark a Dataset and DataLoader settings"),
    "agent": ("otel_training.cli.agent", "sample host and GPU hardware and export it (no training needed)"),
    "stack": ("otel_training.cli.stack", "stack files (init, check), the stack without Docker (up, status, down)"),
    "config": ("otel_training.cli", "show every OTEL_TRAINING_* variable, its value and whether it is valid"),
}


def _usage() -> str:
    lines = ["usage: otel-training COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in _COMMANDS.items()]
    lines += [
        "",
        "Zero-code instrumentation: opentelemetry-instrument python train.py",
        "Run 'otel-training COMMAND --help' for a command's options.",
    ]
    return "\n".join(lines)


def show_config(argv: list[str] | None = None) -> int:
    """Print each variable with its value, or what it means unset (``(default: auto)``);
    a malformed one says INVALID and what it accepts, and the status is 2."""
    import os

    from otel_training.config import ConfigError, default_text, load_config, variables

    if argv and argv[0] in ("-h", "--help"):
        print("usage: otel-training config\n\n" + _COMMANDS["config"][1] + " (exit status 2 if any is malformed)")
        return 0
    if argv:
        print(f"otel-training config: takes no arguments (got {' '.join(argv)})", file=sys.stderr)
        return 2
    status = 0
    width = max(len(var) for var in variables())
    for var in variables():
        raw = os.environ.get(var)
        if raw is None or not raw.strip():
            print(f"{var:<{width}}  (default: {default_text(var)})")
            continue
        try:
            load_config({var: raw})
            print(f"{var:<{width}}  {raw}")
        except ConfigError as exc:
            status = 2
            print(f"{var:<{width}}  {raw}  INVALID: {exc}")
    return status


def main(argv: list[str] | None = None) -> int:
    """Run a command. Output into a closed pipe (``| head -1``) ends it quietly, as a
    process killed by SIGPIPE does (status 141)."""
    try:
        status = _run(argv)
        sys.stdout.flush()  # (here, not at exit, where a closed pipe prints a traceback)
        return status
    except BrokenPipeError:
        # What is left to write goes nowhere (the Python documentation's recipe).
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13  # SIGPIPE


def _run(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from otel_training.version import __version__

        print(__version__)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in _COMMANDS:
        print(f"otel-training: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if command == "config":
        return show_config(rest)
    import importlib

    from otel_training.config import ConfigError

    try:
        module = importlib.import_module(_COMMANDS[command][0])
        return int(module.main(rest) or 0)
    except ConfigError as exc:
        print(f"otel-training: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
