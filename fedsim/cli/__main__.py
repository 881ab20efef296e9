"""``python -m fedsim.cli``: the ``fedrec`` command line."""

from __future__ import annotations

from fedsim.cli import main

raise SystemExit(main())
