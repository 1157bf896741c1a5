"""Log lines in vLLM's format, so the lab's log parsing reads the twin as it reads vLLM."""

from __future__ import annotations

import os
import sys
import time


def log(level: str, where: str, msg: str, proc: str = "APIServer", err: bool = False) -> None:
    """One log line in vLLM's format: ``(APIServer pid=N) INFO 11-30 12:00:00 [file.py:1] msg``."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    line = f"({proc} pid={os.getpid()}) {level} {stamp} [{where}] {msg}\n"
    stream = sys.stderr if err else sys.stdout
    stream.write(line)
    stream.flush()
