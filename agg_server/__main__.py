"""``python -m agg_server``: the same as ``fedrec-server``."""

from __future__ import annotations

from agg_server.cli import main

raise SystemExit(main())
