"""Names of every span, metric and attribute otel-training emits.

docs/telemetry.md is the contract that documents them (with units, instruments
and Prometheus 3 names); tests check that the two agree.
"""

SCOPE = "otel_training"

# --- spans -------------------------------------------------------------------
SPAN_STEP = "step"
PHASE_DATALOADER_NEXT = "dataloader_next"
PHASE_TO_DEVICE = "to_device"
PHASE_TRAIN_BATCH = "train_batch"
PHASE_EVAL_BATCH = "eval_batch"
PHASE_FORWARD = "forward"
PHASE_BACKWARD = "backward"
PHASE_OPTIMIZER_STEP = "optimizer_step"
PHASE_LR_SCHEDULERS = "step_lr_schedulers"
PHASE_FROM_DEVICE = "from_device"
PHASE_REDUCE_METRICS = "reduce_metrics"
# The exposed wait for DDP's gradient sync (and FSDP's collectives): a child of backward.
PHASE_COMMUNICATION = "communication"
PHASE_UNTRACKED = "untracked"  # metric only: step time outside every phase

BATCH_CHILDREN = (PHASE_FORWARD, PHASE_BACKWARD, PHASE_OPTIMIZER_STEP)

# --- attributes --------------------------------------------------------------
ATTR_HOST_NAME = "host.name"
ATTR_MODE = "training.mode"  # "train" | "eval" | "between_steps"
ATTR_PHASE = "training.phase"
ATTR_PHASE_PARENT = "training.phase.parent"  # "step" for top-level phases
ATTR_STEP = "training.step"
ATTR_EPOCH = "training.epoch"
ATTR_BATCH_SIZE = "training.batch_size"
ATTR_RANK = "training.rank"
ATTR_LOCAL_RANK = "training.local_rank"
ATTR_WORLD_SIZE = "training.world_size"
ATTR_RUN_ID = "training.run.id"  # resource attribute
ATTR_UNTRACKED = "training.untracked.duration"
ATTR_HOST_DURATION = "training.phase.host_duration"
ATTR_DEVICE_DURATION = "training.phase.device_duration"
ATTR_GPU_IDLE = "training.gpu.idle_duration"
ATTR_TIMING = "training.timing"  # "events" | "sync" | "off"
ATTR_TRACE_REASON = "training.trace.reason"  # "slow" | "sampled" | "error" | "first" | "profile"
TRACE_REASON_PROFILE = "profile"  # a step a profile recorded (traced whatever the sample)
EVENT_PROFILE = "training.profile"  # on a profiled step's span: the profile's trace file
ATTR_PROFILE_FILE = "training.profile.file"
ATTR_PROFILE_TRIGGER = "training.profile.trigger"  # slow | periodic | straggler | recompile | demand
ATTR_MICROBATCHES = "training.step.microbatches"  # train steps: batches accumulated
ATTR_UPDATE_SKIPPED = "training.step.update_skipped"  # a GradScaler step skipped the update
ATTR_COMPONENT = "training.telemetry.component"
ATTR_TOKENS = "training.step.tokens"  # token ids in the step's batches (padding left out)
ATTR_HW_ID = "hw.id"  # the GPU's UUID (memory metrics of a CUDA device), as the hardware gauges
ATTR_ACTIVITY = "training.activity"  # what the process's wall time went to (training.job.time)
ACTIVITY_RESTART = "restart"  # training.job.time: the gap before a restarted run's attempt

MODE_TRAIN = "train"
MODE_EVAL = "eval"
# A user's phase() with no step open (a checkpoint between epochs): named time between
# steps. Its mode, and the parent of its top-level phases.
MODE_BETWEEN = "between_steps"

# --- training metrics ----------------------------------------------------------
METRIC_STEP_DURATION = "training.step.duration"
METRIC_PHASE_DURATION = "training.phase.duration"
METRIC_STEPS = "training.steps"
METRIC_SAMPLES = "training.samples"
METRIC_MICROBATCHES = "training.microbatches"
METRIC_SKIPPED_UPDATES = "training.skipped_updates"
METRIC_GPU_IDLE = "training.gpu.idle"
METRIC_PHASE_OPEN_DURATION = "training.phase.open.duration"  # gauge: a hang shows here
METRIC_TOKENS = "training.tokens"
METRIC_FLOPS = "training.flops"
METRIC_MFU = "training.mfu"  # gauge: achieved FLOP/s / peak FLOP/s

# --- the whole process's wall time ---------------------------------------------------
METRIC_JOB_TIME = "training.job.time"  # counter (s) by training.activity
METRIC_GOODPUT = "training.goodput"  # gauge: train time / wall time so far

# --- memory per step ---------------------------------------------------------------
METRIC_MEMORY_ALLOCATED = "training.memory.allocated"  # CUDA: bytes allocated at step end
METRIC_MEMORY_PEAK_ALLOCATED = "training.memory.peak_allocated"
METRIC_MEMORY_PEAK_RESERVED = "training.memory.peak_reserved"
METRIC_MEMORY_ALLOC_RETRIES = "training.memory.alloc_retries"
METRIC_MEMORY_OOMS = "training.memory.ooms"
METRIC_MEMORY_RSS = "training.memory.rss"  # CPU: process RSS at step end

# --- self-telemetry --------------------------------------------------------------
METRIC_SPANS_DROPPED = "training.telemetry.spans.dropped"
METRIC_STEPS_DROPPED = "training.telemetry.steps.dropped"
METRIC_EXPORT_FAILURES = "training.telemetry.export.failures"
METRIC_INTERNAL_ERRORS = "training.telemetry.errors"

# Histogram buckets (seconds): sub-millisecond to minutes.
DURATION_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
