"""Names, units and attribute keys of the hardware gauges (docs/telemetry.md, "Hardware gauges")."""

# --- attributes ------------------------------------------------------------------
HOST_NAME = "host.name"
HW_ID = "hw.id"  # GPU UUID
HW_TYPE = "hw.type"  # always "gpu" here
HW_MODEL = "hw.model"
GPU_INDEX = "gpu.index"  # NVML index
PROCESS_PID = "process.pid"
NETWORK_DIRECTION = "network.io.direction"  # "transmit" | "receive"
DISK_DIRECTION = "disk.io.direction"  # "read" | "write"
THROTTLE_REASON = "hw.gpu.throttle.reason"

# --- host ------------------------------------------------------------------------
CPU_UTILIZATION = "system.cpu.utilization"
MEMORY_AVAILABLE = "system.linux.memory.available"
NETWORK_THROUGHPUT = "system.network.throughput"
DISK_OPERATION_RATE = "system.disk.operation_rate"
DISK_THROUGHPUT = "system.disk.throughput"

# --- per GPU ---------------------------------------------------------------------
GPU_UTILIZATION = "hw.gpu.utilization"
GPU_MEMORY_USAGE = "hw.gpu.memory.usage"
GPU_MEMORY_FREE = "hw.gpu.memory.free"
GPU_MEMORY_LIMIT = "hw.gpu.memory.limit"
GPU_MEMORY_CONTROLLER_UTILIZATION = "hw.gpu.memory.controller.utilization"
GPU_CLOCK_SM = "hw.gpu.clock.sm"
GPU_POWER_DRAW = "hw.gpu.power.draw"
GPU_TEMPERATURE = "hw.gpu.temperature"
GPU_THROTTLE = "hw.gpu.throttle"
GPU_PCIE_THROUGHPUT = "hw.gpu.pcie.throughput"

# --- this process on each GPU ----------------------------------------------------------
PROCESS_GPU_MEMORY_USAGE = "process.gpu.memory.usage"
PROCESS_GPU_UTILIZATION = "process.gpu.utilization"

# name -> (unit, description); the order is the contract table's.
GAUGES = {
    CPU_UTILIZATION: ("1", "Host CPU utilization averaged across cores"),
    MEMORY_AVAILABLE: ("By", "Host memory available to new processes"),
    NETWORK_THROUGHPUT: ("By/s", "Host network throughput, all interfaces but loopback"),
    DISK_OPERATION_RATE: ("{operation}/s", "Host disk operations per second"),
    DISK_THROUGHPUT: ("By/s", "Host disk throughput"),
    GPU_UTILIZATION: ("1", "Share of time one or more kernels ran on the GPU"),
    GPU_MEMORY_USAGE: ("By", "GPU memory used"),
    GPU_MEMORY_FREE: ("By", "GPU memory free"),
    GPU_MEMORY_LIMIT: ("By", "GPU memory total"),
    GPU_MEMORY_CONTROLLER_UTILIZATION: ("1", "Share of time device memory was being read or written"),
    GPU_CLOCK_SM: ("Hz", "GPU SM clock"),
    GPU_POWER_DRAW: ("W", "GPU power draw"),
    GPU_TEMPERATURE: ("Cel", "GPU core temperature"),
    GPU_THROTTLE: ("1", "Share of samples with this clock throttle reason active"),
    GPU_PCIE_THROUGHPUT: ("By/s", "GPU PCIe throughput"),
    PROCESS_GPU_MEMORY_USAGE: ("By", "GPU memory used by this process"),
    PROCESS_GPU_UTILIZATION: ("1", "SM utilization of this process on the GPU"),
}

HOST_GAUGES = (CPU_UTILIZATION, MEMORY_AVAILABLE, NETWORK_THROUGHPUT, DISK_OPERATION_RATE, DISK_THROUGHPUT)
GPU_GAUGES = tuple(name for name in GAUGES if name not in HOST_GAUGES)
