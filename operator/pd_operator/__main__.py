"""`python -m pd_operator` is the same as the `pd-operator` command."""

import sys

from pd_operator.cli import main

sys.exit(main())
