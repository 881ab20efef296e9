"""The protocol version, and the model vocabulary and wire limits both sides agree on: which model family a
round trains, how the LightFR uploads are combined, FELB's step rule, FNMF's alignment, and the largest sizes
a message may carry.  String values are stable wire/config names; never rename one."""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "Aggregation",
    "Alignment",
    "DEFAULT_VALID_DAYS",
    "MAX_ITEMS",
    "MAX_LEVEL_WEIGHT",
    "MAX_LOCAL_STEPS",
    "MAX_QUERY_PLANES",
    "MAX_RANK",
    "MAX_TEXT",
    "MAX_VECTOR_LENGTH",
    "ModelKind",
    "PROTOCOL_VERSION",
    "DP_COLLUDERS_SINCE",
    "StepRule",
    "USER_REG_RANGE",
]

PROTOCOL_VERSION: tuple[int, int] = (1, 12)
"""(major, minor): what the codec writes in every envelope (`protocol.codec.is_compatible` decides who can
talk) and whose major version `protocol.crypto` binds into every derived key and `protocol.identity` into
every signed round payload."""

DP_COLLUDERS_SINCE: tuple[int, int] = (1, 12)
"""The first version whose devices size their DP noise for the colluders an invite states (``dp_colluders``):
a server adding DP noise refuses the check-in of an older device, whose noise colluders could thin."""

MAX_VECTOR_LENGTH = 1 << 28
"""Largest update vector L (uint32 ring elements, 1 GiB masked)."""
MAX_RANK = 4096
"""Largest code length / factor count / component count: the ``bits`` wire field."""
MAX_ITEMS = 1 << 26
"""Largest catalogue a model payload may describe."""
MAX_LEVEL_WEIGHT = 1000.0
"""Largest weight w of an iALS model's item levels (protocol 1.10): a device scores u·v + w·level / 255."""
MAX_LOCAL_STEPS = 1000
"""Largest count of local epochs, DCD sweeps, local steps or pre-training epochs a plan may ask."""
MAX_QUERY_PLANES = 8
"""Most bit-planes a LightFR plan may ask a device to keep its user vector as (protocol 1.6): scoring
costs one XOR + popcount pass over the item codes per plane."""
USER_REG_RANGE = (1e-6, 1e6)
"""Bounds of the ridge weight of a LightFR device's user solve (protocol 1.6), inclusive: the solve's
matrix stays well away from singular and the vector finite whatever item codes a server ships."""
MAX_TEXT = 4096
"""Longest human-readable reason or detail in a message."""
DEFAULT_VALID_DAYS = 365
"""How long a device certificate `protocol.enrollment.EnrollmentAuthority.issue` writes is valid by default
(days); here, beside the other limits, so the operator's CLI shows it without loading the crypto."""


class ModelKind(StrEnum):
    """Model families fedrec trains."""

    LIGHTFR = "lightfr"  # binary codes, Hamming top-k (LightFR paper)
    MF = "mf"  # real-valued MF with embedding clipping (federated MF with privacy guarantee)
    FELB = "felb"  # Boolean MF with the ELB proximal operator (federated binary MF)
    FNMF = "fnmf"  # coherent federated NMF with client-side alignment
    IALS = "ials"  # real-valued implicit ALS: exact user step on the device, shared-curvature item solve


class Aggregation(StrEnum):
    """LightFR aggregation rule (LightFR paper, section 3.3.2)."""

    GRAD = "grad"  # eq. 14–16: devices upload item gradients; the default
    PARA = "para"  # eq. 17: devices upload locally updated item codes; the paper's ablation


class StepRule(StrEnum):
    """FELB local step sizes."""

    LIPSCHITZ = "lipschitz"  # η = 1/(1.1 L) per block (FELB)
    MU = "mu"  # elementwise multiplicative-update steps (FELB^MU)


class Alignment(StrEnum):
    """FNMF client-side alignment of the local components to the broadcast V̄ (`protocol.families.fnmf`)."""

    NONE = "none"  # P = I: FedAvg / FedProx
    LAP = "lap"  # D1: the permutation minimising ‖V̄ − PV‖ (the default)
    LAP_RHO = "lap_rho"  # D2: partial permutation over significantly correlated pairs
    SINKHORN = "sinkhorn"  # D3: entropic (soft) transport plan
