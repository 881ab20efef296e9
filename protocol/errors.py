"""The one exception tree of fedrec.

Every problem with data, peers, configuration or cryptography raises a subclass of `FedRecError`.
The server's error middleware maps these classes to HTTP statuses and the SDK maps an encoded
`ErrorMessage` back to the same class, so each boundary translates exactly once.  Stable string
codes (``code``) identify a class on the wire; never rename or reuse one.
"""

from __future__ import annotations

__all__ = [
    "FedRecError",
    "ConfigError",
    "DatasetError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "DecodeError",
    "VersionMismatch",
    "CryptoError",
    "CertificateExpired",
    "CertificateNotYetValid",
    "CertificateRevoked",
    "RevocationListInvalid",
    "RoundError",
    "StaleRound",
    "SessionReplayed",
    "SurvivorSetSplit",
    "RoundClosed",
    "NotEnoughParticipants",
    "PrivacyBudgetExceeded",
    "StorageError",
    "ModelError",
    "AuthError",
    "PermissionDenied",
    "PayloadTooLarge",
    "PrivacyFloorViolation",
    "EnrollmentRefused",
    "RateLimited",
    "error_class_for_code",
]


class FedRecError(Exception):
    """Base class of every error fedrec raises on purpose."""

    code = "fedrec_error"


class ConfigError(FedRecError, ValueError):
    """A configuration value (file, CLI flag, constructor argument) is invalid or unsafe."""

    code = "config_error"


class DatasetError(FedRecError, ValueError):
    """A dataset file is missing or malformed; the message names the file, line and reason."""

    code = "dataset_error"


class ProtocolError(FedRecError):
    """A protocol rule was broken (by us or by the peer)."""

    code = "protocol_error"


class LocalProtocolError(ProtocolError):
    """We were asked to do something the protocol forbids in the current state."""

    code = "local_protocol_error"


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids."""

    code = "remote_protocol_error"


class DecodeError(RemoteProtocolError):
    """Bytes from outside could not be decoded into a valid message."""

    code = "decode_error"


class VersionMismatch(RemoteProtocolError):
    """The peer speaks an incompatible protocol version."""

    code = "version_mismatch"


class CryptoError(FedRecError):
    """Authentication of ciphertext failed, or key material is invalid."""

    code = "crypto_error"


class CertificateExpired(CryptoError):
    """An enrollment certificate whose validity period ended (its ``not_after`` is in the verifier's past,
    beyond the allowed clock skew)."""

    code = "certificate_expired"


class CertificateNotYetValid(CryptoError):
    """An enrollment certificate whose validity period has not begun (its ``not_before`` is in the
    verifier's future, beyond the allowed clock skew)."""

    code = "certificate_not_yet_valid"


class CertificateRevoked(CryptoError):
    """An enrollment certificate whose device key is on the enrollment authority's revocation list."""

    code = "certificate_revoked"


class RevocationListInvalid(CryptoError):
    """A revocation list that is malformed, not signed by the enrollment authority, or older than the one
    in force (a rollback)."""

    code = "revocation_list_invalid"


class RoundError(FedRecError):
    """A problem with the training round itself."""

    code = "round_error"


class StaleRound(RoundError):
    """The message belongs to a round or session that is no longer current."""

    code = "stale_round"


class RoundClosed(RoundError):
    """The round or phase the message was meant for has already closed."""

    code = "round_closed"


class NotEnoughParticipants(RoundError):
    """Too few devices remain for the round to proceed safely; nothing was revealed."""

    code = "not_enough_participants"


class PrivacyBudgetExceeded(FedRecError):
    """Running another round would spend more privacy budget than configured."""

    code = "privacy_budget_exceeded"


class StorageError(FedRecError):
    """A stored file or database is missing, truncated or corrupted."""

    code = "storage_error"


class ModelError(FedRecError):
    """A model is degenerate or not in a usable state (e.g. not fitted)."""

    code = "model_error"


class AuthError(FedRecError):
    """Missing, unknown or wrong credentials."""

    code = "auth_error"


class PermissionDenied(AuthError):
    """Valid credentials, but for another device than the message names."""

    code = "permission_denied"


class PrivacyFloorViolation(RemoteProtocolError):
    """A round asks less privacy than the device's `PrivacyPolicy` allows; the device sits it out."""

    code = "privacy_floor"


class SessionReplayed(RemoteProtocolError):
    """A server opened a second session for a round id this device already took part in (a device keeps
    the history of its rounds and signs for each round id at most once)."""

    code = "session_replayed"


class SurvivorSetSplit(RemoteProtocolError):
    """Protocol 1.11: a signed survivor set under which the server could unmask the sum of only part of the
    honest survivors: a ring neighbour counted as a survivor that this device never masked with, or two runs
    of the roster ring whose survivors the allowed colluders could all be (`protocol.graph.survivor_cut`)."""

    code = "survivor_set_split"


class PayloadTooLarge(RemoteProtocolError):
    """A message exceeds a configured size limit."""

    code = "payload_too_large"


class EnrollmentRefused(PermissionDenied):
    """A registration without a valid enrollment credential: none given where one is required, a forged or
    foreign certificate, a certificate or one-time token used before, or a proof of possession that does
    not verify (protocol 1.4)."""

    code = "enrollment_refused"


class RateLimited(FedRecError):
    """Too many requests from one source (registrations per credential source, protocol 1.4); try again
    after ``retry_after`` seconds (the server sends it as ``Retry-After``)."""

    code = "rate_limited"

    def __init__(self, message: str = "", retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def _all_subclasses(cls: type[FedRecError]) -> list[type[FedRecError]]:
    out: list[type[FedRecError]] = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


def error_class_for_code(code: str) -> type[FedRecError]:
    """Map a wire error code back to its exception class (unknown codes map to `FedRecError`)."""
    for cls in _all_subclasses(FedRecError):
        if cls.code == code:
            return cls
    return FedRecError
