#!/usr/bin/env python3
"""Entry point the Makefile and the playbooks call; the logic lives in vllm_lab.cli."""
import sys

from vllm_lab.cli import main

# Guarded: autotune's search predicts in spawned processes, which import this file again.
if __name__ == "__main__":
    sys.exit(main())
