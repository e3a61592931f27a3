"""`python -m specsplit.cli ...` (how `specsplit up` starts its services)."""
import sys

from specsplit.cli import main

sys.exit(main())
