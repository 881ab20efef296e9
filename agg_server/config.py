"""The aggregation server's configuration: frozen dataclasses built once at the edge and passed down.

Invariants of this module:

* A config object that exists is valid: every dataclass checks its fields in ``__post_init__`` (types,
  ranges, cross-field rules), so an invalid configuration cannot be built from TOML or from code.
* Every error is a `ConfigError` whose message starts with the exact TOML key (``rounds.cohort_size:``),
  so an operator can find the line to fix.  The [server] table maps to `ListenConfig` plus ``data_dir``.
* Numbers are normalised on construction: an int given for a float field is stored as a float; bools
  are never accepted as numbers (in Python ``True`` is an int, in TOML it is not a number).
* Relative paths in a file resolve against the file's folder, never the process's working directory,
  so a config means the same thing wherever the server is started from.
* Apart from checking that TLS files exist, nothing here does I/O; reading the file is `load_config`.

Why one module of ~700 lines: one table, one dataclass, each with its checks and the docstring an
operator reads.  The model families' tables ([model], [lightfr], [mf], [felb], [fnmf], [ials]) and the older
[model] LightFR keys are in `agg_server.config_families` (re-exported here); the field checks all sections
share are in `agg_server.config_fields`.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from agg_server.config_families import (
    FELBSection,
    FNMFSection,
    IALSSection,
    LightFRSection,
    MFSection,
    ModelSection,
    _lightfr_table,
    _refuse_unused_lightfr,
    _unused_table,
    lightfr_default,
    lightfr_keys,
)
from agg_server.config_fields import _bool, _choice, _fail, _float, _int, _is_default, _optional_path, _path, _set
from agg_server.storage.database import is_keyword_dsn, mask_secrets
from protocol.errors import ConfigError
from protocol.graph import find_parameters, validate_parameters
from protocol.quantization import DEFAULT_SCALE_BITS, MAX_SCALE_BITS, QuantizationConfig
from protocol.spec import MAX_VECTOR_LENGTH, ModelKind

__all__ = [
    "MIN_COHORT",
    "ListenConfig",
    "ModelSection",
    "LightFRSection",
    "RoundSection",
    "PrivacySection",
    "LogSection",
    "StorageSection",
    "EnrollmentSection",
    "MFSection",
    "FELBSection",
    "FNMFSection",
    "IALSSection",
    "ServerConfig",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MAX_VECTOR_LENGTH",
    "load_config",
    "config_from_dict",
    "lightfr_keys",
    "lightfr_default",
]


LOG_FORMATS = ("text", "json")
"""Accepted values of ``log.format``."""

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
"""Accepted values of ``log.level`` (case-insensitive on input, stored lower-case)."""

_MIB = 1 << 20


# -- sections ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ListenConfig:
    """Where and how the HTTP server listens (TOML table ``[server]``, minus ``data_dir``).

    Attributes
    ----------
    host : str
        Interface to bind, e.g. "127.0.0.1" or "0.0.0.0".
    port : int
        TCP port in [0, 65535]; 0 lets the OS pick a free port.
    max_body_bytes : int
        Largest request body accepted, in bytes (>= 1); larger requests get 413.
    tls_cert, tls_key : Path or None
        PEM certificate chain and private key; both or neither, and both files must exist.
    admin_token_sha256 : str or None
        Hex SHA-256 of the operator's admin bearer token (for ``/v1/admin/*``); None disables
        the admin endpoints.  The token itself is never written to the configuration.
    body_timeout : float
        Seconds a request body may take to arrive, from the start of its handler (> 0, at most a day); a
        slow or partial body is cut with 408 and its connection closed.
    protect_operator_endpoints : bool or None
        Put ``/metrics``, ``/v1/status`` and the dashboard's data (``/v1/dashboard``; the page itself holds
        none) behind the admin token.  None (the default) means on when ``host`` is not a loopback address and
        off on loopback.  On without ``admin_token_sha256`` leaves those endpoints closed (403).
    max_connections_per_source : int
        Most connections one source address may hold open (default 64; 0 = no cap).  Connections beyond it
        are closed at accept, before a byte is read (docs/threat-model.md §3.5): one address opening
        hundreds of partial bodies cannot slow ``/v1/health``.  Behind a reverse proxy, or with devices
        behind one carrier NAT address, list those addresses in ``uncapped_sources``.
    uncapped_sources : tuple of str
        Networks (``"10.0.0.0/8"``) or addresses never capped: the proxy, the load balancer's health
        checker, the other instances of a cluster.  Default: loopback (``127.0.0.1``, ``::1``).
    """

    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 64 * _MIB
    tls_cert: Path | None = None
    tls_key: Path | None = None
    admin_token_sha256: str | None = None
    body_timeout: float = 30.0
    protect_operator_endpoints: bool | None = None
    max_connections_per_source: int = 64
    uncapped_sources: tuple[str, ...] = ("127.0.0.1", "::1")

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip():
            raise _fail("server.host", "a non-empty string", self.host)
        _int("server.port", self.port, lo=0, hi=65535)
        _int("server.max_body_bytes", self.max_body_bytes, lo=1)
        _set(self, "tls_cert", _optional_path("server.tls_cert", self.tls_cert))
        _set(self, "tls_key", _optional_path("server.tls_key", self.tls_key))
        if (self.tls_cert is None) != (self.tls_key is None):
            missing = "server.tls_key" if self.tls_key is None else "server.tls_cert"
            raise ConfigError(f"{missing}: server.tls_cert and server.tls_key must be set together")
        for key, path in (("server.tls_cert", self.tls_cert), ("server.tls_key", self.tls_key)):
            if path is not None and not path.is_file():
                raise ConfigError(f"{key}: file {str(path)!r} does not exist")
        digest = self.admin_token_sha256
        if digest is not None and (
            not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)
        ):
            raise _fail("server.admin_token_sha256", "64 lowercase hex digits (sha256 of the token)", digest)
        _set(self, "body_timeout", _float("server.body_timeout", self.body_timeout, lo=0.0, hi=86400.0, lo_open=True))
        if self.protect_operator_endpoints is not None:
            _bool("server.protect_operator_endpoints", self.protect_operator_endpoints)
        _int("server.max_connections_per_source", self.max_connections_per_source, lo=0)
        sources = self.uncapped_sources
        if not isinstance(sources, list | tuple) or not all(isinstance(x, str) for x in sources):
            raise _fail("server.uncapped_sources", "a list of addresses or networks", sources)
        for text in sources:
            try:
                ipaddress.ip_network(text.strip(), strict=False)
            except ValueError:
                raise _fail("server.uncapped_sources", "addresses or networks like 10.0.0.0/8", text) from None
        _set(self, "uncapped_sources", tuple(s.strip() for s in sources))

    @property
    def uncapped_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """``uncapped_sources`` as networks."""
        return tuple(ipaddress.ip_network(s, strict=False) for s in self.uncapped_sources)

    @property
    def operator_endpoints_protected(self) -> bool:
        """Whether ``/metrics``, ``/v1/status`` and the dashboard need the admin token."""
        if self.protect_operator_endpoints is not None:
            return self.protect_operator_endpoints
        return not is_loopback(self.host)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1); False for anything else,
    wildcard binds and names included."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


#: The smallest cohort a secure-aggregation round accepts (``rounds.cohort_size`` and ``min_cohort``).
MIN_COHORT = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundSection:
    """How rounds are run (TOML table ``[rounds]``).

    Attributes
    ----------
    cohort_size : int
        Devices invited per round, n >= 3.
    min_cohort : int
        Fewest waiting devices a round starts with, 3 <= min_cohort <= cohort_size.
    dropout_rate : float
        ω in [0, 1): the fraction of the cohort SecAgg+ must tolerate losing.
    adversary_rate : float
        γ in [0, 1): the fraction of the cohort assumed malicious; sizes the graph and, with DP, the noise
        (the honest survivors alone carry μ when ⌊γ n⌋ colluders add none).  Devices refuse a γ below
        their own policy's.
    k, t : int or None
        SecAgg+ graph overrides (neighbourhood size incl. self, Shamir threshold); both or neither,
        1 <= t <= k <= cohort_size, and safe for cohort_size under ω and γ.  None: derived per round.
    clip_norm : float
        L2 clipping norm C > 0 of each device's update, in model units.
    scale_bits : int
        Fixed-point scale s in [0, 30]; C * 2**s must fit a signed 32-bit ring element.
    example_cap : int
        θ >= 0: at most this many ratings per device per round (0 = all); bounds DP sensitivity.
    advertise_timeout, share_keys_timeout, masked_input_timeout, unmask_timeout : float
        Per-phase deadlines in seconds (> 0).
    round_interval : float
        Pause between rounds in seconds (>= 0).
    disconnect_grace : float
        Seconds (>= 0) a device whose long-poll connection closed before its answer may take to come
        back; after that it counts as dropped and the phase closes without it (the deadlines stay the
        upper bound).  A device that checks in again while in a round has left it at once.
    max_rounds : int
        Stop after this many rounds (>= 0; 0 = unlimited).
    seed : int or None
        Seeds the server's cohort and damping generator for reproducible simulations only (>= 0);
        production leaves it unset and the server seeds from `secrets`.
    """

    cohort_size: int = 50
    min_cohort: int = 3
    dropout_rate: float = 0.33
    adversary_rate: float = 0.05
    k: int | None = None
    t: int | None = None
    clip_norm: float = 64.0
    scale_bits: int = DEFAULT_SCALE_BITS
    example_cap: int = 0
    advertise_timeout: float = 60.0
    share_keys_timeout: float = 30.0
    masked_input_timeout: float = 120.0
    unmask_timeout: float = 30.0
    round_interval: float = 1.0
    disconnect_grace: float = 3.0
    max_rounds: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        _int("rounds.cohort_size", self.cohort_size, lo=MIN_COHORT)
        _int("rounds.min_cohort", self.min_cohort, lo=MIN_COHORT)
        if self.min_cohort > self.cohort_size:
            raise ConfigError(
                f"rounds.min_cohort: must be <= rounds.cohort_size ({self.cohort_size}), got {self.min_cohort}"
            )
        for name in ("dropout_rate", "adversary_rate"):
            key = f"rounds.{name}"
            _set(self, name, _float(key, getattr(self, name), lo=0.0, hi=1.0, hi_open=True))
        self._check_graph()
        _set(self, "clip_norm", _float("rounds.clip_norm", self.clip_norm, lo=0.0, lo_open=True))
        _int("rounds.scale_bits", self.scale_bits, lo=0, hi=MAX_SCALE_BITS)
        try:
            self.quantization()
        except ConfigError as exc:
            raise ConfigError(f"rounds.scale_bits: {exc}") from None
        _int("rounds.example_cap", self.example_cap, lo=0)
        for name in ("advertise_timeout", "share_keys_timeout", "masked_input_timeout", "unmask_timeout"):
            _set(self, name, _float(f"rounds.{name}", getattr(self, name), lo=0.0, lo_open=True))
        _set(self, "round_interval", _float("rounds.round_interval", self.round_interval, lo=0.0))
        _set(self, "disconnect_grace", _float("rounds.disconnect_grace", self.disconnect_grace, lo=0.0))
        _int("rounds.max_rounds", self.max_rounds, lo=0)
        if self.seed is not None:
            # numpy's SeedSequence refuses negative entropy.
            _int("rounds.seed", self.seed, lo=0)

    def quantization(self) -> QuantizationConfig:
        """How the rounds' uploads become ring elements (``clip_norm``, ``scale_bits``); every invite of
        these rounds carries the same (`protocol.messages.RoundInvite.quantization`)."""
        return QuantizationConfig(clip_norm=self.clip_norm, scale_bits=self.scale_bits)

    def _check_graph(self) -> None:
        if (self.k is None) != (self.t is None):
            missing = "rounds.t" if self.t is None else "rounds.k"
            raise ConfigError(f"{missing}: rounds.k and rounds.t must be set together (or both left out)")
        n, omega, gamma = self.cohort_size, self.dropout_rate, self.adversary_rate
        if self.k is not None and self.t is not None:
            _int("rounds.k", self.k, lo=1, hi=n)
            _int("rounds.t", self.t, lo=1, hi=self.k)
            try:
                validate_parameters(n, self.k, self.t, omega, gamma)
            except ConfigError as exc:
                raise ConfigError(f"rounds.t: unsafe for rounds.cohort_size={n}: {exc}") from None
            return
        # With no override the coordinator derives (k, t) for every cohort between min_cohort and
        # cohort_size; refusing rates no cohort size can meet turns a failure at the first round into
        # an error at start-up.  The search is a few milliseconds.
        for key, size in (("rounds.cohort_size", n), ("rounds.min_cohort", self.min_cohort)):
            try:
                find_parameters(size, omega, gamma)
            except ConfigError as exc:
                raise ConfigError(
                    f"{key}: no safe SecAgg+ graph for {size} devices with rounds.dropout_rate={omega} "
                    f"and rounds.adversary_rate={gamma}: {exc}"
                ) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageSection:
    """Where the durable state lives (TOML table ``[storage]``).

    Attributes
    ----------
    url : str or None
        None (default): SQLite in ``server.data_dir``.  ``"postgresql://user:password@host:port/db"``
        (or ``?host=/socket/dir`` for a Unix socket, or PostgreSQL's keyword style
        ``"host=db dbname=fedrec user=fedrec password=..."``): a PostgreSQL database, which needs the
        ``postgres`` extra (psycopg 3).  Model checkpoint files stay in ``server.data_dir`` (on PostgreSQL
        the model bytes are in the database too, so every instance reads every version).
    cohorts : int
        Devices are split into this many cohorts (device id d is in cohort (d - 1) mod cohorts); each
        cohort runs its own rounds, led by one instance at a time.  The same on every instance.
    cohorts_per_instance : int
        Cohorts one instance leads at most (its round coordinators), <= ``cohorts``.
    lease_seconds : float
        How long a cohort lease lasts without renewal (renewed every third of it): after an instance
        dies, another one may take its cohorts over this much later.
    instance_id : str or None
        This instance's name in the leases; unique per instance, stable across restarts (a restarted
        instance takes its cohorts back at once).  Default: the host name and ``server.data_dir``.
    advertise_url : str or None
        Where the other instances forward the requests of devices of this instance's cohorts, e.g.
        ``"http://10.0.0.5:8080"``.  Default: ``http(s)://server.host:server.port`` (none for port 0).
    connect_timeout : float
        Seconds one connection attempt to PostgreSQL may take; after a lost connection the server
        reconnects by itself, backing off from 0.25 s to 5 s between attempts.
    statement_timeout : float
        Seconds one PostgreSQL statement may run before the database cancels it (a commit writes the
        whole model: keep it well above a commit's time).
    lock_timeout : float
        Seconds a statement may wait for a lock another session holds before giving up (PostgreSQL's
        ``lock_timeout``; SQLite's busy timeout).  The round goes on or retries; nothing waits longer.
    """

    url: str | None = None
    cohorts: int = 1
    cohorts_per_instance: int = 1
    lease_seconds: float = 15.0
    instance_id: str | None = None
    advertise_url: str | None = None
    connect_timeout: float = 5.0
    statement_timeout: float = 60.0
    lock_timeout: float = 5.0

    def __post_init__(self) -> None:
        _set(self, "cohorts", _int("storage.cohorts", self.cohorts, lo=1, hi=4096))
        _set(self, "connect_timeout", _float("storage.connect_timeout", self.connect_timeout, lo=1.0, hi=300.0))
        _set(self, "statement_timeout", _float("storage.statement_timeout", self.statement_timeout, lo=1.0, hi=3600.0))
        _set(self, "lock_timeout", _float("storage.lock_timeout", self.lock_timeout, lo=0.1, hi=600.0))
        if self.lock_timeout > self.statement_timeout:
            raise _fail("storage.lock_timeout", "at most storage.statement_timeout", self.lock_timeout)
        _set(
            self,
            "cohorts_per_instance",
            _int("storage.cohorts_per_instance", self.cohorts_per_instance, lo=1, hi=self.cohorts),
        )
        _set(self, "lease_seconds", _float("storage.lease_seconds", self.lease_seconds, lo=1.0, hi=3600.0))
        if self.instance_id is not None and (
            not isinstance(self.instance_id, str) or not self.instance_id.strip() or len(self.instance_id) > 200
        ):
            raise _fail("storage.instance_id", "a non-empty string of at most 200 characters", self.instance_id)
        if self.advertise_url is not None:
            parts = urlsplit(self.advertise_url) if isinstance(self.advertise_url, str) else None
            bad = parts is None or parts.scheme not in ("http", "https") or not parts.hostname
            if bad or parts is None or parts.path not in ("", "/"):
                raise _fail("storage.advertise_url", "an absolute http(s) URL without a path", self.advertise_url)
        if self.url is None:
            return
        if not isinstance(self.url, str) or not self.url.strip():
            raise _fail("storage.url", "a database URL string", self.url)
        if is_keyword_dsn(self.url):
            return  # PostgreSQL's keyword style: "host=db dbname=fedrec user=fedrec password=..."
        scheme = self.url.split(":", 1)[0].lower() if ":" in self.url else ""
        if scheme not in ("postgresql", "postgres", "sqlite"):
            raise ConfigError(
                f"storage.url: must start with postgresql:// (or sqlite://), got a {scheme or 'scheme-less'} URL "
                f"({mask_secrets(self.url)!r})"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class PrivacySection:
    """Distributed differential privacy (TOML table ``[privacy]``).

    Attributes
    ----------
    enabled : bool
        Add Skellam noise and keep a privacy ledger.  While false, the other keys must be left out or at
        their defaults (nothing reads them; one changed is refused, naming it).
    epsilon : float
        ε > 0: the budget over the whole run.
    delta : float
        δ in (0, 1) at which ε is accounted.
    planned_rounds : int
        Rounds the noise is calibrated for (>= 1); the ledger refuses rounds beyond the budget.
    """

    enabled: bool = False
    epsilon: float = 8.0
    delta: float = 1e-5
    planned_rounds: int = 10

    def __post_init__(self) -> None:
        _bool("privacy.enabled", self.enabled)
        _set(self, "epsilon", _float("privacy.epsilon", self.epsilon, lo=0.0, lo_open=True))
        _set(self, "delta", _float("privacy.delta", self.delta, lo=0.0, hi=1.0, lo_open=True, hi_open=True))
        _int("privacy.planned_rounds", self.planned_rounds, lo=1)
        if not self.enabled:
            # Without DP nothing reads these: a budget set here would let an operator believe the rounds are
            # noised.  Left out or at their defaults (examples/server.toml) they are fine.
            for f in dataclasses.fields(self):
                value = getattr(self, f.name)
                if f.name != "enabled" and not _is_default(value, f.default):
                    raise ConfigError(
                        f"privacy.{f.name}: set to {value!r} while privacy.enabled is false, so the rounds run "
                        "without noise and nothing reads it: set privacy.enabled = true, or delete it"
                    )


@dataclass(frozen=True, slots=True, kw_only=True)
class EnrollmentSection:
    """Who may register a device (TOML table ``[enrollment]``, protocol 1.4; docs/threat-model.md §3.10).

    Attributes
    ----------
    authority_key : str or None
        Hex of the enrollment authority's 32-byte Ed25519 public key (``fedrec enroll-ca init`` prints
        it).  When set, a registration must carry a certificate of this authority and a proof that the
        device holds the certified key, and every round runs signed (protocol 1.3: signed key
        advertisements and the consistency check).  The authority's private key never comes near the
        server.
    open_registration : bool or None
        Accept registrations without a credential (development only: anyone may then register any number
        of devices).  Unset: true when ``server.host`` is a loopback address and no authority is set,
        false otherwise.  Cannot be true together with ``authority_key``.
    max_source_share : float
        Share in (0, 1] of a round's cohort that devices enrolled through one credential source (one
        certificate batch, one token batch, or open registration) may fill at most; 1 = no cap.
    registrations_per_second : float
        Sustained registrations accepted per credential source (> 0); beyond it 429 with ``Retry-After``.
    registration_burst : int
        Registrations one source may make at once before the rate applies (>= 1).  Rate-limit buckets
        live in each server instance's memory (docs/threat-model.md §6).
    revocation_list : Path or None
        The enrollment authority's signed revocation list (``fedrec enroll-ca revoke`` writes it; needs
        ``authority_key``).  It must exist and verify when the server starts; the server re-reads it when
        the file changes, refuses the devices it names at registration and leaves them out of every cohort
        draw.  A replacement that does not verify or carries a lower number is refused (logged) and the
        list in force stays.
    """

    authority_key: str | None = None
    open_registration: bool | None = None
    max_source_share: float = 1.0
    registrations_per_second: float = 20.0
    registration_burst: int = 100
    revocation_list: Path | None = None

    def __post_init__(self) -> None:
        key = self.authority_key
        if key is not None and (
            not isinstance(key, str) or len(key) != 64 or any(c not in "0123456789abcdef" for c in key)
        ):
            raise _fail("enrollment.authority_key", "64 lowercase hex digits (an Ed25519 public key)", key)
        if self.open_registration is not None:
            _bool("enrollment.open_registration", self.open_registration)
            if self.open_registration and key is not None:
                raise ConfigError(
                    "enrollment.open_registration: cannot be true with enrollment.authority_key set "
                    "(signed rounds need certified devices)"
                )
        _set(
            self,
            "max_source_share",
            _float("enrollment.max_source_share", self.max_source_share, lo=0.0, hi=1.0, lo_open=True),
        )
        _set(
            self,
            "registrations_per_second",
            _float("enrollment.registrations_per_second", self.registrations_per_second, lo=0.0, lo_open=True),
        )
        _int("enrollment.registration_burst", self.registration_burst, lo=1)
        _set(self, "revocation_list", _optional_path("enrollment.revocation_list", self.revocation_list))
        if self.revocation_list is not None and key is None:
            raise ConfigError(
                "enrollment.revocation_list: needs enrollment.authority_key (the list is checked against it)"
            )

    @property
    def authority_public_key(self) -> bytes:
        """The authority key as 32 bytes (empty when none is set)."""
        return bytes.fromhex(self.authority_key) if self.authority_key else b""

    def registration_is_open(self, host: str) -> bool:
        """Whether registrations without a credential are accepted by a server bound to ``host``."""
        if self.open_registration is not None:
            return self.open_registration
        return self.authority_key is None and is_loopback(host)


@dataclass(frozen=True, slots=True, kw_only=True)
class LogSection:
    """Logging (TOML table ``[log]``).

    Attributes
    ----------
    format : str
        "text" or "json" (one object per line).
    level : str
        "debug", "info", "warning", "error" or "critical" (stored lower-case).
    """

    format: str = "text"
    level: str = "info"

    def __post_init__(self) -> None:
        _choice("log.format", self.format, LOG_FORMATS)
        _set(self, "level", _choice("log.level", self.level, LOG_LEVELS, fold_case=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """The whole server configuration.

    Attributes
    ----------
    data_dir : Path
        Folder of the SQLite database and model checkpoints (created on start-up if missing).
    listen : ListenConfig
    model : ModelSection
    rounds : RoundSection
    privacy : PrivacySection
    log : LogSection
    storage : StorageSection
    enrollment : EnrollmentSection
    lightfr, mf, felb, fnmf, ials : the model families' hyper-parameters (only ``model.kind``'s is used; another
        family's table must be absent or at its defaults, or the key changed is refused, naming it and the kind)
    """

    data_dir: Path
    model: ModelSection
    listen: ListenConfig = field(default_factory=ListenConfig)
    rounds: RoundSection = field(default_factory=RoundSection)
    privacy: PrivacySection = field(default_factory=PrivacySection)
    log: LogSection = field(default_factory=LogSection)
    storage: StorageSection = field(default_factory=StorageSection)
    enrollment: EnrollmentSection = field(default_factory=EnrollmentSection)
    lightfr: LightFRSection = field(default_factory=LightFRSection)
    mf: MFSection = field(default_factory=MFSection)
    felb: FELBSection = field(default_factory=FELBSection)
    fnmf: FNMFSection = field(default_factory=FNMFSection)
    ials: IALSSection = field(default_factory=IALSSection)

    def __post_init__(self) -> None:
        _set(self, "data_dir", _path("server.data_dir", self.data_dir))
        for name, cls in _SECTION_TYPES.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name}: must be a {cls.__name__}, got {getattr(self, name)!r}")
        for table, cls in (("mf", MFSection), ("felb", FELBSection), ("fnmf", FNMFSection), ("ials", IALSSection)):
            if table == self.model.kind:
                continue
            # Another family's table does nothing; left at its defaults (examples/server.toml lists them all)
            # it is fine, a value changed is refused.
            section, default = getattr(self, table), cls()
            for f in dataclasses.fields(cls):
                if not _is_default(getattr(section, f.name), getattr(default, f.name)):
                    raise _unused_table(table, f.name, self.model.kind, getattr(section, f.name))
        if self.model.kind != ModelKind.LIGHTFR.value:
            if self.lightfr != LightFRSection():  # built in code; a TOML file's keys are checked one by one
                raise ConfigError(
                    f'lightfr: the [lightfr] table configures model.kind = "lightfr", unused with '
                    f'model.kind = "{self.model.kind}": leave it out or set model.kind = "lightfr"'
                )
            if self.model.kind == ModelKind.IALS.value and self.privacy.enabled and not self.ials.theta:
                raise ConfigError(
                    "ials.theta: privacy.enabled needs the bounded upload, theta >= 1 (e.g. 10, with "
                    "rounds.clip_norm = sqrt(2 + gram_weight**2)); the plain upload's norm grows with a device's items"
                )
            section = getattr(self, self.model.kind)
            length = section.upload_length(self.model.n_items, section.rank)  # the family's own upload layout
            if length > MAX_VECTOR_LENGTH:
                raise ConfigError(
                    f"{self.model.kind}.rank: an upload of n_items = {self.model.n_items} and rank {section.rank} has "
                    f"{length} elements, above the largest update vector 2**28; lower {self.model.kind}.rank or "
                    "model.n_items"
                )
            return
        n_items, bits = self.model.n_items, self.lightfr.server.bits
        length = self.lightfr.params.upload_length(n_items, bits)  # m·f, plus 2m + f² + f under the all-items objective
        if length > MAX_VECTOR_LENGTH:
            raise ConfigError(
                f"model.n_items: an upload of n_items = {n_items} and bits = {bits} has {length} elements, "
                f"above the largest update vector 2**28 = {MAX_VECTOR_LENGTH}; lower lightfr.bits or model.n_items"
            )


_SECTION_TYPES: dict[str, type] = {
    "listen": ListenConfig,
    "model": ModelSection,
    "rounds": RoundSection,
    "privacy": PrivacySection,
    "log": LogSection,
    "storage": StorageSection,
    "enrollment": EnrollmentSection,
    "lightfr": LightFRSection,
    "mf": MFSection,
    "felb": FELBSection,
    "fnmf": FNMFSection,
    "ials": IALSSection,
}

# TOML table -> (attribute of ServerConfig, dataclass); [server] also carries data_dir.
_TABLES: dict[str, tuple[str, type]] = {
    "server": ("listen", ListenConfig),
    "model": ("model", ModelSection),
    "rounds": ("rounds", RoundSection),
    "privacy": ("privacy", PrivacySection),
    "log": ("log", LogSection),
    "storage": ("storage", StorageSection),
    "enrollment": ("enrollment", EnrollmentSection),
    "lightfr": ("lightfr", LightFRSection),
    "mf": ("mf", MFSection),
    "felb": ("felb", FELBSection),
    "fnmf": ("fnmf", FNMFSection),
    "ials": ("ials", IALSSection),
}
# Keys older files may hold that the server never read: each is refused with what to do instead.
_DEVICE_SIDE = (
    "the rating scale and how ratings become targets are each device's choice (device_sdk "
    "LightFRConfig(rating_range=..., binary_positives=...), DeviceClient(rating_range=..., binary_positives=...)); "
    "no server setting reaches a device: delete this line"
)
_REMOVED: dict[tuple[str, str], str] = {
    ("model", "rating_min"): _DEVICE_SIDE,
    ("model", "rating_max"): _DEVICE_SIDE,
    ("model", "binary_positives"): _DEVICE_SIDE,
}
_PATH_KEYS = {("server", "data_dir"), ("server", "tls_cert"), ("server", "tls_key"), ("enrollment", "revocation_list")}
_REQUIRED = (("server", "data_dir"), ("model", "n_items"))


def _table_keys(table: str) -> list[str]:
    if table == "lightfr":
        return lightfr_keys()
    names = [f.name for f in dataclasses.fields(_TABLES[table][1])]
    if table == "model":
        return [*names, *lightfr_keys()]  # LightFR's keys in their older place
    return ["data_dir", *names] if table == "server" else names


def _unknown(key: str, candidates: list[str], what: str) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], candidates, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{key}: unknown {what}{hint}")


def config_from_dict(data: Mapping[str, Any], *, base_dir: Path) -> ServerConfig:
    """Build and validate a server configuration from parsed TOML (or an equivalent mapping).

    Parameters
    ----------
    data : Mapping[str, Any]
        Tables ``server``, ``model``, ``rounds``, ``privacy``, ``log``; only ``server.data_dir`` and
        ``model.n_items`` are required, every other key has a default.
    base_dir : Path
        Folder that relative paths (``data_dir``, ``tls_cert``, ``tls_key``) resolve against,
        normally the TOML file's folder.

    Returns
    -------
    ServerConfig
        The validated configuration.

    Raises
    ------
    ConfigError
        Naming the offending key: an unknown table or key (with a "did you mean" hint), a missing
        required key, a wrong type, a value out of range or a broken cross-field rule.
    """
    values = _read_tables(data)
    _resolve_paths(values, Path(base_dir))
    data_dir = values["server"].pop("data_dir")
    lightfr, origin = _lightfr_table(values)
    sections = {attr: cls(**values[table]) for table, (attr, cls) in _TABLES.items() if table != "lightfr"}
    model = sections["model"]
    if model.kind == ModelKind.LIGHTFR.value:
        sections["lightfr"] = LightFRSection.from_table(lightfr, model.n_items, origin=origin)
    else:
        _refuse_unused_lightfr(lightfr, origin, model.kind)
    return ServerConfig(data_dir=data_dir, **sections)


def _read_tables(data: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Every known table of ``data`` as a dict (absent ones empty), after refusing an unknown table or key,
    a removed key and a missing required key."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"configuration must be a table of tables, got {type(data).__name__}")
    for table in data:
        if table not in _TABLES:
            raise _unknown(str(table), list(_TABLES), "section")
    values: dict[str, dict[str, Any]] = {}
    for table in _TABLES:
        section = data.get(table, {})
        if not isinstance(section, Mapping):
            raise ConfigError(f"{table}: must be a table, got {section!r}")
        allowed = _table_keys(table)
        for key in section:
            if (table, key) in _REMOVED:
                raise ConfigError(f"{table}.{key}: no longer a server setting: {_REMOVED[table, key]}")
            if key not in allowed:
                raise _unknown(f"{table}.{key}", allowed, "key")
        values[table] = dict(section)
    for table, key in _REQUIRED:
        if key not in values[table]:
            raise ConfigError(f"{table}.{key}: required key is missing")
    return values


def _resolve_paths(values: dict[str, dict[str, Any]], base_dir: Path) -> None:
    """Resolve the path keys given in ``values`` against ``base_dir``, in place (``~`` expanded)."""
    for table, key in _PATH_KEYS:
        if key in values[table]:
            path = _path(f"{table}.{key}", values[table][key]).expanduser()
            # An absolute path stays as it is: base_dir / "/abs" == "/abs".
            values[table][key] = base_dir / path


def load_config(path: Path) -> ServerConfig:
    """Read and validate a server TOML file.

    Parameters
    ----------
    path : Path
        The TOML file; relative paths inside it resolve against its folder.

    Returns
    -------
    ServerConfig
        The validated configuration.

    Raises
    ------
    ConfigError
        If the file cannot be read, is not valid TOML (the message carries the parser's line and
        column) or holds an invalid configuration (see `config_from_dict`).
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration file: {exc.strerror or exc}") from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: not UTF-8 (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    try:
        return config_from_dict(data, base_dir=path.resolve().parent)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
