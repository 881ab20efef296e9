"""The server's side of the privacy ledger (docs/dp-accounting.md §5): the per-round noise μ, the ε every
round reserves, and the ledger all cohorts and instances share in the database — without aiohttp, time
or global randomness.

Invariants:
- The stored ledger is the truth; this copy follows it (`PrivacyAccount.refresh`) before a round opens
  and after one ends, since other cohorts (and instances) charge it too.
- A round's ε is reserved in the transaction that opens it (`Storage.start_round` calls a `Reservation`
  with the stored ledger, under the rounds lock), so rounds of several cohorts can never overspend; a
  round that ends without committing gives the reservation back only if it was never revealed (the
  storage does that in the transaction that closes it).
- The budget (ε, δ) of a data directory cannot change during a run.
"""

from __future__ import annotations

from typing import Any

from agg_server.config import ServerConfig
from agg_server.storage import Storage
from protocol.accounting import PrivacyLedger, calibrate_mu
from protocol.errors import ConfigError
from protocol.quantization import QuantizationConfig, sensitivity

__all__ = ["PrivacyAccount", "Reservation", "ledger_charged"]


def ledger_charged(storage: Storage) -> bool:
    """Whether the stored privacy ledger charged any round (DP noise was released in this data_dir)."""
    ledger = storage.load_ledger()
    return bool(ledger and ledger.get("rounds"))


class PrivacyAccount:
    """The privacy ledger of one coordinator (None without ``privacy.enabled``), the noise μ each round
    adds, and the update's sensitivities (L1, L2) the ledger charges with.

    Parameters
    ----------
    config : the server configuration (``[privacy]``, ``data_dir``).
    storage : the opened storage (the shared ledger).
    quantization, vector_length : the rounds' clipping and update length (the sensitivities).

    Raises
    ------
    ConfigError
        ``privacy.epsilon``/``delta`` differ from the stored ledger's.
    """

    def __init__(
        self, config: ServerConfig, storage: Storage, quantization: QuantizationConfig, vector_length: int
    ) -> None:
        self.storage = storage
        self.ledger: PrivacyLedger | None = None
        self.mu = 0.0
        self.l2, self.l1 = sensitivity(quantization, vector_length)
        if config.privacy.enabled:
            saved = storage.load_ledger()
            self.ledger = (
                PrivacyLedger.from_dict(saved)
                if saved is not None
                else PrivacyLedger(epsilon_budget=config.privacy.epsilon, delta=config.privacy.delta)
            )
            if (self.ledger.epsilon_budget, self.ledger.delta) != (config.privacy.epsilon, config.privacy.delta):
                raise ConfigError(
                    f"privacy.epsilon/delta ({config.privacy.epsilon:g}, {config.privacy.delta:g}) differ from the "
                    f"ledger in {config.data_dir} ({self.ledger.epsilon_budget:g}, {self.ledger.delta:g}); a budget "
                    "cannot change during a run (start a new data_dir for a new run)"
                )
            self.mu = calibrate_mu(
                config.privacy.epsilon, config.privacy.delta, config.privacy.planned_rounds, self.l1, self.l2
            )

    def refresh(self) -> None:
        """Follow the stored ledger (other cohorts charge and give back reservations too)."""
        if self.ledger is None:
            return
        saved = self.storage.load_ledger()
        if saved is not None:
            self.ledger = PrivacyLedger.from_dict(saved)

    def check_round(self) -> None:
        """Raise `PrivacyBudgetExceeded` if one more round would overspend the budget."""
        if self.ledger is not None:
            self.ledger.check_round(self.mu, self.l1, self.l2)

    def reservation(self, round_id: int) -> Reservation | None:
        """What `Storage.start_round` calls to reserve round ``round_id``'s ε (None without DP)."""
        return None if self.ledger is None else Reservation(self, round_id)

    def adopt(self, reservation: Reservation | None) -> None:
        """The round of ``reservation`` opened: its ledger is the stored one now."""
        if reservation is not None and reservation.ledger is not None:
            self.ledger = reservation.ledger

    def spent(self) -> float | None:
        """ε spent (reserved included); None without DP."""
        return self.ledger.spent() if self.ledger is not None else None

    def status(self) -> dict[str, Any] | None:
        """The ``privacy`` part of the status snapshot (None without DP)."""
        if self.ledger is None:
            return None
        return {
            "epsilon_spent": self.ledger.spent(),
            "epsilon_budget": self.ledger.epsilon_budget,
            "delta": self.ledger.delta,
            "mu": self.mu,
            "rounds_charged": len(self.ledger.rounds),
        }


class Reservation:
    """Reserves one round's ε on the stored ledger, inside `Storage.start_round`'s transaction (under the
    rounds lock: the ledger every instance shares); ``ledger`` is the result once it ran."""

    def __init__(self, account: PrivacyAccount, round_id: int) -> None:
        self.account = account
        self.round_id = round_id
        self.ledger: PrivacyLedger | None = None

    def __call__(self, stored: dict[str, Any] | None) -> dict[str, Any]:
        own = self.account.ledger
        assert own is not None
        ledger = (
            PrivacyLedger.from_dict(stored)
            if stored is not None
            else PrivacyLedger(epsilon_budget=own.epsilon_budget, delta=own.delta)
        )
        ledger.record_round(self.account.mu, self.account.l1, self.account.l2, round_id=self.round_id)
        self.ledger = ledger
        return ledger.to_dict()
