"""Jinja filters for the vllm role: classify a failed start and scrub secrets from log text.

The patterns live in one place, vllm_lab.serving, so the playbook and the Python side agree.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from vllm_lab import serving as _serving
except ImportError:  # ansible-playbook from another Python: use the checkout this role sits in
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
    from vllm_lab import serving as _serving


def vllm_failure_cause(log_tail: str, status: str) -> str:
    """oom | refused-flag | start-timeout | crashed, from the log tail and the wait status."""
    return _serving.classify_failure(log_tail or "", status)


def vllm_scrub(text: str, secrets: list) -> str:
    """Text with every secret replaced by ***."""
    return _serving.scrub(text or "", secrets or [])


class FilterModule:
    """vllm role filters."""

    def filters(self):
        return {"vllm_failure_cause": vllm_failure_cause, "vllm_scrub": vllm_scrub}
