#!/usr/bin/env python3
"""Entry point the Makefile and the playbooks call; the logic lives in vllm_lab.cli."""
import sys

from vllm_lab.cli import main

sys.exit(main())
