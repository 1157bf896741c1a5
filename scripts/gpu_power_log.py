#!/usr/bin/env python3
"""Log each GPU's power, energy counter, utilization and SM clock every few hundred ms (NVML).

    python scripts/gpu_power_log.py OUT.csv [--every-ms 250] [--seconds N]

Columns: unix time, GPU index, power (W), total energy since the driver loaded (J), GPU
utilization (%), SM clock (MHz), memory used (MiB). A run's energy is the counter's difference
between its start and end; idle power is what the GPU draws with nothing running. Needs
nvidia-ml-py (pynvml) and an NVIDIA driver.
"""

from __future__ import annotations

import argparse
import sys
import time

import pynvml


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--every-ms", type=float, default=250.0)
    ap.add_argument("--seconds", type=float, default=float("inf"))
    args = ap.parse_args()
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    end = time.time() + args.seconds
    with open(args.out, "a", buffering=1) as f:
        if f.tell() == 0:
            f.write("ts,gpu,power_w,energy_j,util_pct,sm_mhz,mem_used_mib\n")
        while time.time() < end:
            ts = time.time()
            for i, h in enumerate(handles):
                try:
                    power = pynvml.nvmlDeviceGetPowerUsage(h) / 1000
                    energy = pynvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000
                    util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
                    sm = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
                    mem = pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20
                except pynvml.NVMLError as e:
                    f.write(f"{ts:.3f},{i},,,,,# {e}\n")
                    continue
                f.write(f"{ts:.3f},{i},{power:.1f},{energy:.3f},{util},{sm},{mem:.0f}\n")
            time.sleep(max(0.0, args.every_ms / 1000 - (time.time() - ts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
