"""`python -m planner ...`: the same command as `memtrain plan`."""

import sys

from .plan import main_plan

sys.exit(main_plan())
