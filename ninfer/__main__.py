"""`python -m ninfer` is the `ninfer` command."""

from __future__ import annotations

import sys

from ninfer._cli import main

sys.exit(main())
