"""Refresh ``docs/img/dashboard.png``: the dashboard of a real server after a short run, as headless
Chromium renders it.

    python benchmarks/dashboard_screenshot.py            # 6 rounds, 15% announced dropouts
    python benchmarks/dashboard_screenshot.py --rounds 3 --dropout 0 --out /tmp/dashboard.png

It runs the scenario of ``tests/test_dashboard_browser.py`` (a server on loopback, ten real devices
over HTTP, a quality figure reported through ``/v1/admin/quality``, a provoked 401 and a 404 whose
path holds a ``<script>`` tag, shown as text) and writes the PNG.  Needs ``/usr/bin/chromium``
(``apt-get install chromium``).  Run it by hand from a checkout; tests never write into ``docs/``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6, help="rounds to run before the screenshot")
    p.add_argument("--dropout", type=float, default=0.15, help="probability a device drops in a round")
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=1200)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    args = p.parse_args()

    sys.path.insert(0, str(ROOT))  # the scenario lives in the test suite
    from tests.test_dashboard_browser import CHROMIUM, run_scenario

    if not CHROMIUM.is_file():
        sys.exit(f"{CHROMIUM} is missing: apt-get install chromium")
    with tempfile.TemporaryDirectory(prefix="fedrec-dashboard-") as tmp:
        result = asyncio.run(
            run_scenario(Path(tmp), rounds=args.rounds, dropout=args.dropout, width=args.width, height=args.height)
        )
    if result.page_errors:
        sys.exit(f"the page reported errors: {result.page_errors}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(result.png)
    facts = result.facts
    print(
        f"wrote {args.out} ({len(result.png) / 1e3:.0f} kB): model version {facts['modelVersion']}, "
        f"{facts['roundsCommitted']} rounds committed, ε {facts['epsilonText']}, "
        f"{len(facts['errorRows'])} error rows"
    )


if __name__ == "__main__":
    main()
