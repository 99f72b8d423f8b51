import sys

from dpep_parity.checks.targets.sglang.museum import main

sys.exit(main())
