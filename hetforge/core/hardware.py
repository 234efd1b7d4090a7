"""What the GPUs a lab actually owns can do: datasheet memory, dense peak TFLOP/s per precision,
compute capability and board power. Used to predict wall time and energy before a run (`hetforge
size`), to estimate energy after one when nothing better is known, and to choose a precision.

Figures are per device as PyTorch sees it (one GK210 of a K80 board, one GCD of an MI250X), dense
(no sparsity), tensor-core rates with fp32 accumulation where the card has tensor cores (GeForce
cards run those at half their fp16-accumulate rate). None = the card has no such arithmetic. A
device that is here is described by `detect` in the same terms as a table entry (`DeviceInfo.caps`).

A mixed cluster trains in one precision, set by its weakest device, so that every rank computes the
same numbers the same way and the loss scaler (fp16) means the same thing everywhere:

* bf16 where every device has it (compute capability 8.0 and up: A100, RTX 30xx, H100...);
* else fp16 with dynamic loss scaling where every device runs fp16 at least as fast as fp32
  (tensor cores from 7.0: V100, T4, RTX 20xx; and the P100, 6.0, with its double-rate fp16);
* else fp32: consumer Pascal (6.1: GTX 10xx) runs fp16 at 1/64 rate, Maxwell and Kepler have no
  fast fp16, and a CPU in the mix trains fp32 too.
"""

from __future__ import annotations

import re
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




@dataclass(frozen=True)
class DeviceInfo:
    name: str
    memory_gb: float
    fp32_tflops: float
    fp16_tflops: float
    bf16_tflops: float | None
    compute_capability: tuple[int, int] | None
    power_w: float
    link_gbps: float = 12.0  # host link as pinned copies see it: PCIe 3 x16 ~12, 4 ~24, 5 ~50 GB/s
    memory_gbps: float = 900.0  # the card's memory bandwidth (datasheet), what elementwise kernels run at

    def caps(self):
        """As `detect` describes the card when it is here."""
        return Capability(self.name, "cuda", self.compute_capability, self.memory_gb * 2**30,
                          bf16=self.bf16_tflops is not None, fast_fp16=self.fp16_tflops >= self.fp32_tflops)

    def peak_tflops(self, precision: str) -> float:
        if precision == "bf16":
            if self.bf16_tflops is None:
                raise ValueError(f"{self.name} has no bf16 arithmetic; use fp16 or fp32")
            return self.bf16_tflops
        return self.fp16_tflops if precision == "fp16" else self.fp32_tflops


DEVICES: tuple[DeviceInfo, ...] = (
    DeviceInfo("K80", 12, 4.37, 4.37, None, (3, 7), 150, memory_gbps=240),
    DeviceInfo("P100", 16, 9.3, 18.7, None, (6, 0), 250, memory_gbps=732),
    DeviceInfo("GTX 1080 Ti", 11, 11.3, 0.18, None, (6, 1), 250, memory_gbps=484),  # fp16 at 1/64 rate on GP102
    DeviceInfo("V100", 16, 15.7, 125.0, None, (7, 0), 300, memory_gbps=900),
    DeviceInfo("V100-32GB", 32, 15.7, 125.0, None, (7, 0), 300, memory_gbps=900),
    DeviceInfo("T4", 16, 8.1, 65.0, None, (7, 5), 70, memory_gbps=320),
    DeviceInfo("RTX 2080 Ti", 11, 13.4, 53.8, None, (7, 5), 250, memory_gbps=616),
    DeviceInfo("RTX 3090", 24, 35.6, 71.0, 71.0, (8, 6), 350, 24.0, memory_gbps=936),
    DeviceInfo("A100-40GB", 40, 19.5, 312.0, 312.0, (8, 0), 400, 24.0, memory_gbps=1555),
    DeviceInfo("A100-80GB", 80, 19.5, 312.0, 312.0, (8, 0), 400, 24.0, memory_gbps=2039),
    DeviceInfo("H100", 80, 67.0, 989.0, 989.0, (9, 0), 700, 50.0, memory_gbps=3350),
    DeviceInfo("H200", 141, 67.0, 989.0, 989.0, (9, 0), 700, 50.0, memory_gbps=4800),
    DeviceInfo("MI250X-GCD", 64, 23.9, 191.5, 191.5, None, 280, 24.0, memory_gbps=1638),
)


def sdpa_backend(card: DeviceInfo, precision: str, head_dim: int) -> str:
    """The kernel PyTorch's scaled_dot_product_attention picks on this card (its sdp_utils rules):
    flash from compute capability 8.0 in 16-bit types, memory-efficient from 5.0, both needing the
    head size aligned (a multiple of 8 in 16-bit types, of 4 in fp32); otherwise the math kernel,
    which keeps the whole (sequence x sequence) attention matrix for the backward. AMD cards take
    ROCm's flash kernels under the same 16-bit and alignment conditions."""
    half = precision in ("bf16", "fp16")
    aligned = head_dim % (8 if half else 4) == 0
    if card.compute_capability is None:  # AMD: ROCm's AOTriton kernels (MI200 / MI300)
        return "flash" if half and aligned and head_dim <= 256 else "math"
    cc = card.compute_capability
    if cc >= (8, 0) and half and aligned and head_dim <= 256:
        return "flash"
    if cc >= (5, 0) and aligned:
        return "mem-efficient"
    return "math"


def padded_head_dim(card, precision: str, head_dim: int, mode: str | int = "auto") -> int:
    """The head size attention runs at (`model.pad_head_dim`). Zero channels added to q, k and v
    change no score and no output (the softmax scale stays 1/sqrt(head_dim)); where the true size
    sends PyTorch to the math kernel, which keeps a (sequence x sequence) matrix per head, the next
    multiple of 8 lets a fused one run. `auto` pads only where that makes a fused kernel apply
    (FORGE-s: 86 -> 88); never on a CPU, whose kernel takes any size."""
    if mode == "off":
        return head_dim
    if isinstance(mode, int) and not isinstance(mode, bool):
        if mode < head_dim:
            raise ValueError(f"model.pad_head_dim={mode} is smaller than the head size {head_dim}")
        return mode
    if getattr(card, "kind", "cuda") == "cpu" or sdpa_backend(card, precision, head_dim) != "math":
        return head_dim
    padded = -(-head_dim // 8) * 8
    return padded if sdpa_backend(card, precision, padded) != "math" else head_dim


def _key(name: str) -> str:
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    for word in ("nvidia", "geforce", "tesla", "gtx", "rtx", "amd", "instinct"):
        key = key.replace(word, "")
    return key


def lookup(name: str, memory_gb: float | None = None) -> DeviceInfo | None:
    """The table's entry for a device name as a user or `torch.cuda.get_device_name` writes it
    ("V100", "Tesla V100-SXM2-32GB", "NVIDIA A100-SXM4-80GB", "rtx3090"); None when unknown."""
    key = _key(name)
    if memory_gb is None:
        m = re.search(r"(\d+)\s*gb", name.lower())
        memory_gb = float(m.group(1)) if m else None
    best = None
    for d in DEVICES:
        base = _key(d.name.split("-")[0])
        if base and base in key:
            # the longest matching model name, then the memory variant closest to what is declared
            score = (len(base), -abs((memory_gb or d.memory_gb) - d.memory_gb))
            if best is None or score > best[0]:
                best = (score, d)
    return best[1] if best else None


def choose_precision(devices: list[DeviceInfo]) -> str:
    """The run's one precision on these cards (`run_precision`'s rule)."""
    return run_precision([d.caps() for d in devices])[0]


def compile_decision(mode: str, device: torch.device, memory_plan: bool) -> tuple[bool, str]:
    """(compile?, why). Under a memory plan the branches kept or recomputed whole run compiled;
    those whose plan caches, offloads or rebuilds some of their units run eager
    (`memory.executor.per_op_decisions`), and the plan is priced on the eager profile. Here, below
    the planner, because the planner's menu depends on it (`memory.rebuild: auto`)."""
    if mode == "off":
        return False, "train.compile=off"
    plan = " (a memory plan's per-op choices run eager)" if memory_plan else ""
    if mode == "on":
        return True, "train.compile=on" + plan
    if device.type == "cuda":
        return True, "auto: on a GPU, compiled blocks are typically 1.2-1.5x faster" + plan
    return False, "auto: off on a CPU, where compiling gains little and costs a cold start"
