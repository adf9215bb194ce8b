"""GPU telemetry (telemetry/gpu.py) against a stand-in NVML module: keys, per-step summaries, the
GPUs CUDA_VISIBLE_DEVICES names, and quiet absence without NVML."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rl.telemetry.gpu import GpuTelemetry


class FakeNvml:
    """The pynvml calls GpuTelemetry makes; each GPU's readings come from a script of values."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2

    def __init__(self, readings):
        self.readings = readings  # {nvml index: [(util, mem bytes, power mW, sm MHz, mem MHz), ...]}
        self.calls = {i: 0 for i in readings}
        self.shut = False

    def nvmlDeviceGetCount(self):
        return len(self.readings)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def _now(self, h):
        return self.readings[h][min(self.calls[h], len(self.readings[h]) - 1)]

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self._now(h)[0], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=self._now(h)[1], total=141 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h):
        return self._now(h)[2]

    def nvmlDeviceGetClockInfo(self, h, kind):
        value = self._now(h)[3] if kind == self.NVML_CLOCK_SM else self._now(h)[4]
        if kind == self.NVML_CLOCK_MEM:
            self.calls[h] += 1  # the last call of one reading
        return value

    def nvmlShutdown(self):
        self.shut = True


GIB = 2**30


def test_step_metrics_summarise_the_samples_of_each_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml({0: [(10, 4 * GIB, 100_000, 1000, 3000), (30, 8 * GIB, 300_000, 2000, 3000),
                         (50, 6 * GIB, 200_000, 1500, 3000)],
                     1: [(90, 1 * GIB, 500_000, 1980, 3200)] * 3})
    telemetry = GpuTelemetry(interval_s=1.0, nvml=nvml)
    assert telemetry.enabled
    telemetry.sample()
    telemetry.sample()
    step = telemetry.step_metrics()
    assert step["gpu/0/util_percent"] == pytest.approx(20.0)
    assert step["gpu/0/mem_used_gib"] == pytest.approx(8.0)  # the last reading
    assert step["gpu/0/mem_peak_gib"] == pytest.approx(8.0)
    assert step["gpu/0/power_w"] == pytest.approx(200.0)
    assert step["gpu/0/sm_clock_mhz"] == pytest.approx(1500.0)
    assert step["gpu/0/mem_clock_mhz"] == pytest.approx(3000.0)
    assert step["gpu/1/util_percent"] == pytest.approx(90.0)
    assert step["gpu/util_percent"] == pytest.approx(55.0)
    # The next step sees only its own samples (here none yet: one fresh reading).
    nxt = telemetry.step_metrics()
    assert nxt["gpu/0/util_percent"] == pytest.approx(50.0) and nxt["gpu/0/mem_peak_gib"] == pytest.approx(6.0)
    telemetry.close()
    assert nvml.shut and not telemetry.enabled and telemetry.step_metrics() == {}


def test_only_the_visible_gpus_numbered_as_this_process_sees_them(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    nvml = FakeNvml({i: [(10 * i, GIB, 1000, 1, 1)] for i in range(4)})
    step = GpuTelemetry(nvml=nvml).step_metrics()
    assert step["gpu/0/util_percent"] == 20.0  # NVML's GPU 2 is this process's cuda:0
    assert not any(k.startswith("gpu/1/") for k in step)


def test_quietly_empty_without_nvml_or_when_off(monkeypatch):
    import megatron_rl.telemetry.gpu as gpu

    monkeypatch.setattr(gpu, "_load_nvml", lambda: None)
    telemetry = GpuTelemetry(interval_s=0.5).start()
    assert not telemetry.enabled and telemetry.step_metrics() == {}
    telemetry.close()
    assert GpuTelemetry(interval_s=0).nvml is None  # 0 turns it off without touching NVML


def test_sampling_thread_collects_readings():
    nvml = FakeNvml({0: [(i, GIB, 1000, 1, 1) for i in range(1000)]})
    telemetry = GpuTelemetry(interval_s=0.001, nvml=nvml).start()
    import time

    deadline = time.monotonic() + 5
    while nvml.calls[0] < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    telemetry.close()
    assert nvml.calls[0] >= 5  # the thread sampled on its own
