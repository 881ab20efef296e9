"""Model vocabulary both sides agree on: which model family a round trains and how the LightFR
uploads are combined.  String values are stable wire/config names; never rename one."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Aggregation", "ModelKind"]


class ModelKind(StrEnum):
    """Model families fedrec trains."""

    LIGHTFR = "lightfr"  # binary codes, Hamming top-k (LightFR paper)
    MF = "mf"  # real-valued MF with embedding clipping (federated MF with privacy guarantee)
    FELB = "felb"  # Boolean MF with the ELB proximal operator (federated binary MF)
    FNMF = "fnmf"  # coherent federated NMF with client-side alignment


class Aggregation(StrEnum):
    """LightFR aggregation rule (LightFR paper, section 3.3.2)."""

    GRAD = "grad"  # eq. 14–16: devices upload item gradients; the default
    PARA = "para"  # eq. 17: devices upload locally updated item codes; the paper's ablation
