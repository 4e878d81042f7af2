"""`python -m streamdiff.cli`: the `streamdiffd` console script without installing it."""

import sys

from . import main

sys.exit(main())
