"""`python -m vllm_lab.twin serve MODEL ...`: the twin's server, as `vllm serve`."""

import sys

from vllm_lab.twin.server import main

sys.exit(main())
