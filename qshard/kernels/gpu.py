"""What a GPU is, as far as the kernels' configs care: compute capability, SM count, shared
memory per SM and peak memory bandwidth. The split rules size their grids by the SM count, the
Gluon kernels' rings by the shared memory, and the tuned files (`tuning.py`) are picked by the
nearest traits, not by the device's name (docs/kernels/w4a16.md, "Tuned configs").
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

__all__ = ["GpuTraits", "smem_budget", "traits"]

# Shared memory a block of the Gluon kernels leaves free for its barriers and the compiler's
# own: sm_90 has 228 KiB per SM, 227 KiB for one block; the rings take at most 200 KiB there.
SMEM_RESERVE = 28 * 1024
HOPPER_SMEM_KIB = 228


@dataclasses.dataclass(frozen=True)
class GpuTraits:
    capability: tuple[int, int]
    sms: int
    smem_kib: int  # shared memory per SM
    bandwidth_gbs: int  # peak DRAM bandwidth from the memory clock and bus width; 0: unknown

    @classmethod
    def from_json(cls, data: dict) -> GpuTraits:
        major, minor = data["capability"]
        gpu = cls(
            (int(major), int(minor)),
            int(data["sms"]),
            int(data["smem_kib"]),
            int(data.get("bandwidth_gbs", 0)),
        )
        if gpu.sms < 1 or gpu.smem_kib < 1 or gpu.bandwidth_gbs < 0:
            # `distance` takes their logarithms; a bandwidth of 0 is the unknown one
            raise ValueError(f"sms and smem_kib must be >= 1 and bandwidth_gbs >= 0, got {data}")
        return gpu

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "capability": list(self.capability)}

    def distance(self, other: GpuTraits) -> float | None:
        """How far apart two GPUs are for the kernels' configs: None across compute
        capabilities (different instructions, different kernels), else the summed |log ratio|
        of SM count, shared memory and bandwidth (the last where both are known)."""
        if self.capability != other.capability:
            return None
        pairs = [(self.sms, other.sms), (self.smem_kib, other.smem_kib)]
        if self.bandwidth_gbs and other.bandwidth_gbs:
            pairs.append((self.bandwidth_gbs, other.bandwidth_gbs))
        return sum(abs(math.log(a / b)) for a, b in pairs)


@functools.cache
def traits(index: int) -> GpuTraits:
    """The traits of CUDA device `index`, from its properties (DDR: two transfers per memory
    clock, over the bus width)."""
    props = torch.cuda.get_device_properties(index)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    return GpuTraits(
        capability=(props.major, props.minor),
        sms=props.multi_processor_count,
        smem_kib=getattr(props, "shared_memory_per_multiprocessor", HOPPER_SMEM_KIB * 1024) // 1024,
        bandwidth_gbs=round(2 * clock_khz * 1e3 * bus_bits / 8 / 1e9),
    )


def smem_budget(device: torch.device) -> int:
    """Bytes of shared memory the Gluon kernels' rings may fill on `device`; where there is no
    GPU to ask (the CPU, the tests' recorded launches and configs on a machine without CUDA)
    an sm_90 SM's, what those kernels are built for."""
    present = device.type == "cuda" and torch.cuda.is_available()
    kib = traits(device.index or 0).smem_kib if present else HOPPER_SMEM_KIB
    return kib * 1024 - SMEM_RESERVE
