"""The CPU this runs on, as config.json records it (train.versions) and bench/seeds.py compares
it with a finished cell's: its model name and which of the flags that pick oneDNN's matmul kernels
it has. Two CPUs of one model name with other flags (AMX or not) round bf16 otherwise, and the same
seed plays other episodes. Standard library only: bench/seeds.py does not import torch."""

import os
import platform

KERNEL_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def cpu():
    """{"device": the model name, "cpu_flags": which of KERNEL_FLAGS the CPU has, or "none"};
    the device is platform.machine() where /proc/cpuinfo names no model (not Linux)."""
    names, flags = [], set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    names.append(value.strip())
                elif key.strip() == "flags":
                    flags.update(value.split())
    return {
        "device": names[0] if names else platform.machine(),
        "cpu_flags": " ".join(f for f in KERNEL_FLAGS if f in flags) or "none",
    }


def label(recorded):
    """A machine kind as a line names it: the model name, and the kernel flags where recorded
    (a config.json from before cpu_flags names the model alone)."""
    flags = recorded.get("cpu_flags")
    return recorded.get("device", "unknown") + (f" ({flags})" if flags else "")
