"""What each rank's device can do, and the one precision a whole run uses.

A mixed cluster trains in one precision, set by its weakest device, so that every rank computes the
same numbers the same way and the loss scaler (fp16) means the same thing everywhere:

* bf16 where every device has it (compute capability 8.0 and up: A100, RTX 30xx, H100...);
* else fp16 with dynamic loss scaling where every device runs fp16 at least as fast as fp32
  (tensor cores from 7.0: V100, T4, RTX 20xx; and the P100, 6.0, with its double-rate fp16);
* else fp32: consumer Pascal (6.1: GTX 10xx) runs fp16 at 1/64 rate, Maxwell and Kepler have no
  fast fp16, and a CPU in the mix trains fp32 too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Capability:
    name: str
    kind: str  # "cuda" | "cpu"
    compute_capability: tuple[int, int] | None
    memory_bytes: float | None
    bf16: bool
    fast_fp16: bool

    def describe(self) -> str:
        cc = f", compute capability {self.compute_capability[0]}.{self.compute_capability[1]}" \
            if self.compute_capability else ""
        return f"{self.name}{cc}"

    def to_dict(self) -> dict:
        return asdict(self)


def from_compute_capability(name: str, cc: tuple[int, int], memory_bytes: float | None = None) -> Capability:
    return Capability(name, "cuda", tuple(cc), memory_bytes, bf16=tuple(cc) >= (8, 0),
                      fast_fp16=tuple(cc) == (6, 0) or tuple(cc) >= (7, 0))


def detect(device: torch.device) -> Capability:
    """This rank's device as the driver reports it."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return from_compute_capability(props.name, (props.major, props.minor), float(props.total_memory))
    return Capability("cpu", "cpu", None, None, bf16=False, fast_fp16=False)


def run_precision(caps: list[Capability]) -> tuple[str, str]:
    """(precision, why) for a run on these devices (one per rank)."""
    if not caps:
        return "fp32", "no devices described"
    cpus = [i for i, c in enumerate(caps) if c.kind != "cuda"]
    if cpus:
        return "fp32", f"rank {cpus[0]} is a CPU"
    no_bf16 = [i for i, c in enumerate(caps) if not c.bf16]
    if not no_bf16:
        return "bf16", f"every device has bf16 ({len(caps)} rank(s))"
    slow = [i for i, c in enumerate(caps) if not c.fast_fp16]
    if slow:
        i = slow[0]
        return "fp32", f"rank {i} ({caps[i].describe()}) has neither bf16 nor fast fp16"
    i = no_bf16[0]
    return "fp16", f"rank {i} ({caps[i].describe()}) has no bf16; fp16 with dynamic loss scaling for all ranks"
