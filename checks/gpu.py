"""GPUs per host (nvidia-smi), against the host's slots, with driver and NCCL.

The probe runs ``nvidia-smi --query-gpu=index,name,driver_version,memory.total
--format=csv,noheader`` and lists libnccl.so* it can see; ``parse_nvidia_smi`` and
``gpu_findings`` are pure. A host without nvidia-smi is "not applicable".
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Optional, Union

from dtrun.checks.probereport import ProbeReport, probe_report
from dtrun.checks.result import FAIL, NA, OK, WARN, Finding

CHECK = "gpu"


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    driver: str
    memory: str = ""


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """CSV lines ``0, NVIDIA H100 80GB HBM3, 550.54.15, 81559 MiB`` → Gpu values (bad lines skipped)."""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        gpus.append(Gpu(int(parts[0]), parts[1], parts[2], parts[3] if len(parts) > 3 else ""))
    return gpus


@dataclass(frozen=True)
class HostGpus:
    host: str
    slots: int
    smi: Optional[str]  # path of nvidia-smi, None when there is none
    gpus: tuple[Gpu, ...] = ()
    error: str = ""
    nccl: tuple[str, ...] = ()


def host_gpus(host: str, slots: int, report: Union[ProbeReport, Mapping]) -> HostGpus:
    g = probe_report(report).gpu
    if not g.get("nvidia_smi"):
        return HostGpus(host, slots, None)
    text = g.get("query") or ""
    gpus = tuple(parse_nvidia_smi(text))
    err = "" if g.get("rc") == 0 and gpus else (text.strip().splitlines() or ["no output"])[-1]
    return HostGpus(host, slots, g["nvidia_smi"], gpus, err, tuple(g.get("nccl") or ()))


def gpu_findings(hosts: list[HostGpus]) -> list[Finding]:
    out = []
    with_gpus = [h for h in hosts if h.gpus]
    drivers = Counter(h.gpus[0].driver for h in with_gpus)
    common = drivers.most_common(1)[0][0] if drivers else None
    for h in hosts:
        if h.smi is None:
            note = "; other hosts have GPUs" if with_gpus else ""
            out.append(Finding(h.host, CHECK, NA if not with_gpus else WARN,
                               f"no NVIDIA GPU (nvidia-smi not found){note}",
                               "" if not with_gpus else f"mixing GPU and CPU-only hosts: check that {h.host} belongs in this job"))
            continue
        if h.error:
            out.append(Finding(h.host, CHECK, FAIL, f"nvidia-smi at {h.smi} failed: {h.error}",
                               f"check the NVIDIA driver on {h.host} (nvidia-smi; dmesg | grep -i nvrm)"))
            continue
        names = Counter(g.name for g in h.gpus)
        summary = ", ".join(f"{n}× {name}" for name, n in names.items())
        problems = []
        if len(h.gpus) < h.slots:
            n = len(h.gpus)
            problems.append((WARN, f"{n} GPU{'s' if n != 1 else ''} for {h.slots} slots: ranks would share GPUs",
                             f"give {h.host} at most {n} slot{'s' if n != 1 else ''}"))
        drv = h.gpus[0].driver
        if common and drv != common:
            others = sorted(x.host for x in with_gpus if x.gpus[0].driver == common)
            problems.append((WARN, f"driver {drv} while {', '.join(others)} run {common}",
                             f"install driver {common} on {h.host}"))
        if not h.nccl:
            problems.append((WARN, "no libnccl.so found on the library path, in the system library directories "
                                   "or in the Python's nvidia-nccl package",
                             "pip install nvidia-nccl-cu12 (or the NCCL that matches your CUDA)"))
        for status, detail, fix in problems:
            out.append(Finding(h.host, CHECK, status, f"{summary} (driver {drv}): {detail}", fix))
        if not problems:
            out.append(Finding(h.host, CHECK, OK, f"{summary}, driver {drv}, NCCL {h.nccl[0]}"))
    return out
