"""GPU utilisation, memory, power and clocks per training step, read through NVML (nvidia-ml-py).

A background thread samples every GPU this process can see (CUDA_VISIBLE_DEVICES, else all) at a
fixed interval; ``step_metrics`` returns what the samples since the previous call say, under keys
``gpu/<index>/<what>`` (index: the CUDA device number this process uses), plus the mean
utilisation over the GPUs as ``gpu/util_percent``. Without NVML (no driver, no GPU, no package)
it is quietly empty: a CPU run's metrics carry no gpu/ keys.

Keys, per GPU: util_percent (mean of the samples), mem_used_gib (last sample), mem_peak_gib (the
largest sample), power_w (mean), sm_clock_mhz and mem_clock_mhz (mean).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Dict, List, Optional

logger = logging.getLogger(__name__)

_GIB = 1024 ** 3


def _load_nvml() -> Optional[Any]:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound / DriverNotLoaded: no GPU here
        return None
    return pynvml


def visible_indices(nvml: Any) -> List[int]:
    """NVML indices of the GPUs this process uses: CUDA_VISIBLE_DEVICES's (integers) or all."""
    count = nvml.nvmlDeviceGetCount()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return list(range(count))
    indices = []
    for item in visible.split(","):
        item = item.strip()
        if not item.isdigit():  # UUIDs / MIG names: fall back to every GPU rather than guess
            return list(range(count))
        if int(item) < count:
            indices.append(int(item))
    return indices


class GpuTelemetry:
    """Samples NVML in a thread; ``step_metrics()`` summarises the samples since the last call.
    ``nvml``: the pynvml module or a stand-in (tests); None loads nvidia-ml-py if it works here."""

    def __init__(self, interval_s: float = 1.0, nvml: Optional[Any] = None):
        self.nvml = nvml if nvml is not None else (_load_nvml() if interval_s > 0 else None)
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._handles: List[Any] = []
        self._samples: List[List[Dict[str, float]]] = []
        if self.nvml is None:
            return
        try:
            self._handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in visible_indices(self.nvml)]
        except Exception as exc:  # noqa: BLE001 - a broken NVML must not stop training
            logger.warning("GPU telemetry off: NVML could not list the GPUs (%s)", exc)
            self.nvml = None
            return
        self._samples = [[] for _ in self._handles]

    @property
    def enabled(self) -> bool:
        return self.nvml is not None and bool(self._handles)

    def start(self) -> "GpuTelemetry":
        if self.enabled and self._thread is None:
            self.sample()
            self._thread = threading.Thread(target=self._loop, name="gpu-telemetry", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """One reading of every GPU (the thread calls this; tests call it directly)."""
        nvml = self.nvml
        readings = []
        for handle in self._handles:
            try:
                readings.append({
                    "util_percent": float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                    "mem_used_gib": nvml.nvmlDeviceGetMemoryInfo(handle).used / _GIB,
                    "power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                    "sm_clock_mhz": float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
                    "mem_clock_mhz": float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)),
                })
            except Exception:  # noqa: BLE001 - a reading NVML refuses (e.g. power on some boards) is skipped
                readings.append({})
        with self._lock:
            for per_gpu, reading in zip(self._samples, readings):
                if reading:
                    per_gpu.append(reading)

    def step_metrics(self) -> Dict[str, float]:
        """gpu/<i>/... over the samples since the previous call (a fresh reading if there are none)."""
        if not self.enabled:
            return {}
        with self._lock:
            empty = not any(self._samples)
        if empty:
            self.sample()
        with self._lock:
            taken, self._samples = self._samples, [[] for _ in self._handles]
        out: Dict[str, float] = {}
        utils = []
        for i, samples in enumerate(taken):
            if not samples:
                continue
            mean = {k: sum(s[k] for s in samples) / len(samples) for k in samples[0]}
            out[f"gpu/{i}/util_percent"] = mean["util_percent"]
            out[f"gpu/{i}/mem_used_gib"] = samples[-1]["mem_used_gib"]
            out[f"gpu/{i}/mem_peak_gib"] = max(s["mem_used_gib"] for s in samples)
            out[f"gpu/{i}/power_w"] = mean["power_w"]
            out[f"gpu/{i}/sm_clock_mhz"] = mean["sm_clock_mhz"]
            out[f"gpu/{i}/mem_clock_mhz"] = mean["mem_clock_mhz"]
            utils.append(mean["util_percent"])
        if utils:
            out["gpu/util_percent"] = sum(utils) / len(utils)
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self.nvml = None
