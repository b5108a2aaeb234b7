"""Every environment variable otel-training reads (the only way to configure it).

Each constant's docstring is the documentation; ``otel_training.config`` parses
them and README.md lists them. Malformed values stop the run with one line that
names the variable and what it accepts.
"""

OTEL_TRAINING_ENABLED = "OTEL_TRAINING_ENABLED"
"""
.. envvar:: OTEL_TRAINING_ENABLED

``true`` (default) or ``false``. ``false`` installs no hook at all.
"""

OTEL_TRAINING_TRACE_SLOW_FACTOR = "OTEL_TRAINING_TRACE_SLOW_FACTOR"
"""
.. envvar:: OTEL_TRAINING_TRACE_SLOW_FACTOR

Tail capture: a step slower than this factor times the running median step
duration is traced. A number >= 1; ``0`` turns slow-step capture off. Default ``2``.
"""

OTEL_TRAINING_TRACE_EVERY_N = "OTEL_TRAINING_TRACE_EVERY_N"
"""
.. envvar:: OTEL_TRAINING_TRACE_EVERY_N

Also trace one step in N (the first step, then every N-th). A whole number >= 0;
``0`` turns it off, ``1`` traces every step. Default ``100``.
"""

OTEL_TRAINING_TRACE_MAX_PER_SECOND = "OTEL_TRAINING_TRACE_MAX_PER_SECOND"
"""
.. envvar:: OTEL_TRAINING_TRACE_MAX_PER_SECOND

Upper bound on traced steps per second (a token bucket), so that a burst of slow
steps cannot overflow the SDK's span queue and tracing stays a small share of the
pipeline's work at millisecond steps. One-in-N steps only use the bucket's upper
half: the first step, slow steps and errors keep the rest. A number > 0.
Default ``5``.
"""

OTEL_TRAINING_GPU_TIMING = "OTEL_TRAINING_GPU_TIMING"
"""
.. envvar:: OTEL_TRAINING_GPU_TIMING

How phase boundaries are timed on CUDA: ``events`` (CUDA events observed off the
training thread), ``sync`` (``torch.cuda.synchronize()`` at each boundary: exact but
perturbing), ``off`` (host clocks only) or ``auto`` (default: ``events`` when CUDA is
in use, else ``off``).
"""

OTEL_TRAINING_SUMMARY = "OTEL_TRAINING_SUMMARY"
"""
.. envvar:: OTEL_TRAINING_SUMMARY

``true`` prints the run-end breakdown table (per-phase mean, total and share of
step time, untracked time, verdict) to standard error at exit. Default ``false``.
"""

OTEL_TRAINING_SUMMARY_FILE = "OTEL_TRAINING_SUMMARY_FILE"
"""
.. envvar:: OTEL_TRAINING_SUMMARY_FILE

A path: the run-end summary is also written there as JSON (read by
``otel-training report --summary``). Unset by default. ``{rank}`` and ``{pid}`` in the
path are replaced, so ranks do not overwrite each other (``{rank}`` by the rank once
known, docs/distributed.md; ``unknown-<pid>`` in a process that never learned it).
"""

OTEL_TRAINING_TRACE_FILE = "OTEL_TRAINING_TRACE_FILE"
"""
.. envvar:: OTEL_TRAINING_TRACE_FILE

A path: the traced steps (the same tail-capture sample as the spans) are also
written there as Chrome trace-event JSON, for Perfetto UI or chrome://tracing.
Unset by default. ``{rank}`` and ``{pid}`` are replaced as in
``OTEL_TRAINING_SUMMARY_FILE``. ``ts`` counts microseconds from the file's
``baseTimeNanoseconds`` on the spans' clock, as torch.profiler's traces do
(``otel-training trace-merge`` puts ranks and profiles in one file); at most 32 MiB
of events (the oldest traced steps are dropped beyond); written at exit and on
SIGTERM. See docs/report.md.
"""

OTEL_TRAINING_HARDWARE = "OTEL_TRAINING_HARDWARE"
"""
.. envvar:: OTEL_TRAINING_HARDWARE

``true`` (default) samples host and GPU hardware into observable gauges;
``false`` turns the sampler off.
"""

OTEL_TRAINING_HARDWARE_INTERVAL = "OTEL_TRAINING_HARDWARE_INTERVAL"
"""
.. envvar:: OTEL_TRAINING_HARDWARE_INTERVAL

Seconds between hardware samples (independent of the metric export interval); a
number > 0. Gauges report the average of the samples taken during each export
interval. Default ``1``.
"""

OTEL_TRAINING_SHUTDOWN_TIMEOUT = "OTEL_TRAINING_SHUTDOWN_TIMEOUT"
"""
.. envvar:: OTEL_TRAINING_SHUTDOWN_TIMEOUT

Seconds the process may spend at exit flushing telemetry (a number > 0, default
``2``), so that an unreachable Collector never holds a finished job.
"""

OTEL_TRAINING_INTEGRATIONS = "OTEL_TRAINING_INTEGRATIONS"
"""
.. envvar:: OTEL_TRAINING_INTEGRATIONS

Comma-separated framework integrations to enable when the framework is installed:
any of ``lightning``, ``transformers``, or ``all`` (default) / ``none``.
"""

OTEL_TRAINING_STEP_BOUNDARY = "OTEL_TRAINING_STEP_BOUNDARY"
"""
.. envvar:: OTEL_TRAINING_STEP_BOUNDARY

What one step is (docs/steps.md). ``auto`` (default): one optimizer update, or one
backward pass when no optimizer exists, and one forward batch without backward for
eval. The escape hatches, when the self-check says detection is in doubt:
``optimizer`` (everything between two updates is one step, even forwards without
backward), ``backward`` (each backward pass is a step), ``dataloader`` (each
DataLoader batch is a step), ``forward`` (each root forward begins a step). The
manual ``otel_training.step()`` always wins.
"""

OTEL_TRAINING_FLOPS_PER_STEP = "OTEL_TRAINING_FLOPS_PER_STEP"
"""
.. envvar:: OTEL_TRAINING_FLOPS_PER_STEP

Floating-point operations of one training step (all its micro-batches), e.g.
``6.2e12``: a number > 0, used instead of counting them. Unset (default): they are
counted once per run by ``torch.utils.flop_counter.FlopCounterMode`` on one real
training step after warm-up (docs/performance.md gives its one-off cost). ``0`` turns
FLOPs and MFU off.
"""

OTEL_TRAINING_PEAK_FLOPS = "OTEL_TRAINING_PEAK_FLOPS"
"""
.. envvar:: OTEL_TRAINING_PEAK_FLOPS

Peak FLOP/s of the device one process trains on, e.g. ``989e12``: a number > 0, the
denominator of ``training.mfu``. Unset (default): NVIDIA's dense peak for the GPU model
and the dtype most FLOPs ran in (``otel_training/record/peak_flops.py``); a CPU run, or a
GPU or dtype missing from the table, reports FLOP/s but no MFU.
"""

OTEL_TRAINING_MEMORY = "OTEL_TRAINING_MEMORY"
"""
.. envvar:: OTEL_TRAINING_MEMORY

``true`` (default) reads memory at step ends (CUDA caching-allocator statistics, or the
process's RSS without CUDA), at most every 10 ms, for the memory metrics and the
memory-creep finding; ``false`` turns the reads off.
"""

OTEL_TRAINING_ATTEMPTS_DIR = "OTEL_TRAINING_ATTEMPTS_DIR"
"""
.. envvar:: OTEL_TRAINING_ATTEMPTS_DIR

A folder where each rank of a restartable run keeps its attempt's record (one small
JSON file per run id and rank, rewritten every 10 s, after each checkpoint save and at
exit), so that a restarted attempt counts the restart time and the progress lost to
resuming from an earlier checkpoint (docs/telemetry.md, "A restarted run"). Kept for
runs under ``torchrun`` (restarts with ``--max-restarts``) and runs with
``OTEL_TRAINING_RUN_ID`` set (a requeued job that keeps its run id); a run id made up
for one process keeps none. Default: a folder in the node's temporary directory; use a
shared filesystem where a restarted rank may land on another node. A run's folder
with nothing written for 7 days is removed when a later run starts there. ``none``
keeps no record.
"""

OTEL_TRAINING_PROFILE = "OTEL_TRAINING_PROFILE"
"""
.. envvar:: OTEL_TRAINING_PROFILE

When torch.profiler records a few steps' operators (docs/profiles.md): ``auto``
(default: every trigger), ``off`` (none; ``otel-training profile PID`` is refused too),
or a comma-separated list of triggers: ``slow`` (a train step's own work, its time less
exposed communication, over 4x the rolling median and 100 ms over it), ``periodic``
(slow steps that recur every N steps: the next one is predicted and captured itself),
``straggler`` (this rank's own work stays 1.5x above its earlier median while the other
ranks wait on it), ``recompile`` (a burst of torch.compile recompilations after
warm-up), ``demand`` (``otel-training profile PID``).
"""

OTEL_TRAINING_PROFILE_STEPS = "OTEL_TRAINING_PROFILE_STEPS"
"""
.. envvar:: OTEL_TRAINING_PROFILE_STEPS

Steps one profile records (a whole number from 1 to 20). Default ``2``.
"""

OTEL_TRAINING_PROFILE_MAX = "OTEL_TRAINING_PROFILE_MAX"
"""
.. envvar:: OTEL_TRAINING_PROFILE_MAX

Profiles one process (one rank) records at most, over the run, by its triggers (a
whole number >= 0; ``0`` leaves only ``otel-training profile PID``). Default ``3``.
"""

OTEL_TRAINING_PROFILE_INTERVAL = "OTEL_TRAINING_PROFILE_INTERVAL"
"""
.. envvar:: OTEL_TRAINING_PROFILE_INTERVAL

Seconds between two profiles of the same trigger on one rank (a number >= 0).
Default ``300``.
"""

OTEL_TRAINING_PROFILE_DIR = "OTEL_TRAINING_PROFILE_DIR"
"""
.. envvar:: OTEL_TRAINING_PROFILE_DIR

The folder the profiles' trace files are written to (created when needed). Default:
the folder of ``OTEL_TRAINING_SUMMARY_FILE`` when one is set, else
``otel-training-profiles`` in the node's temporary directory. Files are named
``profile-<run id>-rank<rank>-<trigger>-step<step>.json``.
"""
