"""Model-family logic that the device and the server must compute identically, once.

`device_sdk` and `agg_server` never import each other (docs/design.md §1), so what both sides of a family
compute — a projection, a proximal map and its schedule, the alignment of component matrices, the
layout of an upload — lives here, under `protocol`, and both import it.  The vocabularies
(`protocol.spec.Alignment`, `protocol.spec.StepRule`) and the wire limits (`protocol.spec`) sit beside
`ModelKind`.

Invariants of every module in this package: pure, sans-IO numpy (no scipy, no I/O, no logging, no
global randomness); arrays in, new arrays out; a bad argument raises `ValueError` naming it.
"""

from __future__ import annotations

__all__: list[str] = []
