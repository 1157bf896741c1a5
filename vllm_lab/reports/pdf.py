"""A report page printed to PDF by headless Chromium."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from vllm_lab.store import StoreError

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class ReportError(StoreError):
    """The report cannot be built as asked; the message is one sentence for the user."""


def chromium() -> str | None:
    """The headless browser that prints the PDF, if one is installed."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def print_pdf(index: Path, pdf: Path, timeout_s: float = 120) -> Path:
    """Print the HTML to PDF with headless Chromium (its own process group, killed on timeout)."""
    exe = chromium()
    if exe is None:
        raise ReportError("the PDF needs Chromium (scripts/install-system-deps.sh installs it); "
                          "rerun with --no-pdf to skip it")
    with tempfile.TemporaryDirectory(prefix="vllm-lab-chromium-") as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run",
               "--no-pdf-header-footer", f"--user-data-dir={profile}",
               f"--print-to-pdf={pdf.resolve()}", index.resolve().as_uri()]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise ReportError(f"Chromium did not print {pdf} within {timeout_s:.0f} s") from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    if not pdf.exists() or pdf.stat().st_size == 0:
        raise ReportError(f"Chromium did not write {pdf}: {err.decode(errors='replace')[-300:]}")
    return pdf
