"""`python -m bench.cuda_check`: the GPU check (bench/cuda_check/runner.py)."""

import sys

from bench.cuda_check.runner import main

sys.exit(main())
