"""`python -m specsplit.parallel.worker FD`: one tensor-parallel worker rank (see group.py)."""
from __future__ import annotations

import sys

from specsplit.parallel.group import worker_main

if __name__ == "__main__":
    sys.exit(worker_main(int(sys.argv[1])))
