"""`python -m pd_devcluster` is the same as the `pd-dev` command."""

import sys

from pd_devcluster.cli import main

sys.exit(main())
