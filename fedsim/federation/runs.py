"""Saved runs (``fedrec simulate --save``): from a trained run to models the SDK loads and to
recommendations for one user.

A run file is one `device_sdk.store` file.  Two kinds:

- ``lightfr-run`` (LightFR): every user's code and the item codes as packed words, the item term when
  the run learnt one, and the dataset, protocol and seed that `fedrec eval` needs to re-score it.
- ``family-run`` (MF, FELB, FNMF, iALS): the device models of the run's clients, each stored as the bytes
  of the model file its own ``save`` writes (one MF or iALS model holding every user; one FELB / FNMF model
  per client holding its rows), plus which global users each client holds.

Both also keep every user's training items (so a recommendation never repeats an item the user
already rated) and the dataset's raw user / item ids when it has them.

Invariants:
- `export_model` writes exactly the file format of the family's ``save``, so ``LightFRModel.load`` /
  ``MFModel.load`` / ``FELBModel.load`` / ``FNMFModel.load`` / ``IALSModel.load`` read it; `recommend` ranks
  with that same device model's ``recommend`` (the SDK's filters and tie-breaking), never with a copy of its
  scoring.
- A file that is not a run, or a run whose fields do not fit together, is a `StorageError` naming it.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from device_sdk.felb import FELBModel
from device_sdk.fnmf import FNMFModel
from device_sdk.ials import IALSModel
from device_sdk.mf import MFModel
from device_sdk.models import LightFRConfig, LightFRModel
from device_sdk.store import load_store, save_store
from protocol.codes import from_bytes, pack_signs, to_bytes, unpack_signs
from protocol.errors import ConfigError, StorageError

__all__ = [
    "LIGHTFR_RUN",
    "FAMILY_RUN",
    "Run",
    "TrainItems",
    "load_run",
    "save_family_run",
    "lightfr_run_fields",
]

LIGHTFR_RUN = "lightfr-run"
FAMILY_RUN = "family-run"
_MODELS: dict[str, Any] = {"mf": MFModel, "felb": FELBModel, "fnmf": FNMFModel, "ials": IALSModel}


@dataclass(frozen=True)
class TrainItems:
    """Every user's training items as CSR (``items[indptr[u]:indptr[u+1]]``)."""

    indptr: NDArray[np.int64]
    items: NDArray[np.int64]

    @classmethod
    def from_pairs(cls, users: NDArray[Any], items: NDArray[Any], n_users: int) -> TrainItems:
        order = np.argsort(users, kind="stable")
        counts = np.bincount(np.asarray(users, dtype=np.int64), minlength=n_users)
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return cls(indptr, np.asarray(items, dtype=np.int64)[order])

    def of(self, user: int) -> NDArray[np.int64]:
        return self.items[self.indptr[user] : self.indptr[user + 1]]

    def to_fields(self) -> dict[str, Any]:
        return {
            "train_indptr": self.indptr.astype("<i8").tobytes(),
            "train_items": self.items.astype("<i4").tobytes(),
        }

    @classmethod
    def from_fields(cls, state: dict[str, Any]) -> TrainItems:
        indptr = np.frombuffer(state["train_indptr"], dtype="<i8").astype(np.int64)
        items = np.frombuffer(state["train_items"], dtype="<i4").astype(np.int64)
        if indptr.size < 1 or indptr[0] != 0 or indptr[-1] != items.size or np.any(np.diff(indptr) < 0):
            raise ValueError("training items are not a valid CSR")
        return cls(indptr, items)


def _ids(values: NDArray[Any] | None) -> list[Any] | None:
    if values is None:
        return None
    return [v.item() if isinstance(v, np.generic) else v for v in np.asarray(values).tolist()]


def lightfr_run_fields(
    user_codes: NDArray[np.int8],
    item_codes: NDArray[np.int8],
    train: TrainItems,
    *,
    item_levels: NDArray[np.uint8] | None,
    hamming_weight: int,
    user_ids: NDArray[Any] | None,
    item_ids: NDArray[Any] | None,
    user_q: NDArray[np.int16] | None = None,
    user_weight: NDArray[np.int64] | None = None,
) -> dict[str, Any]:
    """The fields a ``lightfr-run`` adds to its dataset description (see `fedrec simulate --save`); with
    ``user_q`` / ``user_weight`` the vectors every user ranks with (`LightFRConfig.rank_planes`)."""
    vectors = {}
    if user_q is not None and user_weight is not None:
        vectors = {
            "user_q": np.asarray(user_q, dtype="<i2").tobytes(),
            "user_weight": np.asarray(user_weight, dtype="<i8").tobytes(),
        }
    return {
        **vectors,
        "bits": int(user_codes.shape[1]),
        "n_users": int(user_codes.shape[0]),
        "n_items": int(item_codes.shape[0]),
        "user_words": to_bytes(pack_signs(user_codes)),
        "item_words": to_bytes(pack_signs(item_codes)),
        "item_levels": None if item_levels is None else np.asarray(item_levels, dtype=np.uint8).tobytes(),
        "hamming_weight": int(hamming_weight),
        "user_ids": _ids(user_ids),
        "item_ids": _ids(item_ids),
        **train.to_fields(),
    }


def _model_bytes(model: Any) -> bytes:
    with tempfile.TemporaryDirectory(prefix="fedrec-run-") as tmp:
        path = Path(tmp) / "model.fedrec"
        model.save(path)
        return path.read_bytes()


def _model_from_bytes(family: str, data: bytes) -> Any:
    with tempfile.TemporaryDirectory(prefix="fedrec-run-") as tmp:
        path = Path(tmp) / "model.fedrec"
        path.write_bytes(data)
        return _MODELS[family].load(path)


def save_family_run(
    path: Path,
    family: str,
    clients: list[tuple[Any, int]],
    train: TrainItems,
    description: dict[str, Any],
    *,
    user_ids: NDArray[Any] | None = None,
    item_ids: NDArray[Any] | None = None,
) -> None:
    """Write a ``family-run``: ``clients`` are (device model, rows it holds) in global user order."""
    save_store(
        path,
        FAMILY_RUN,
        {
            **description,
            "family": family,
            "clients": [{"rows": int(rows), "model": _model_bytes(model)} for model, rows in clients],
            "user_ids": _ids(user_ids),
            "item_ids": _ids(item_ids),
            **train.to_fields(),
        },
    )


@dataclass
class Run:
    """A loaded run file."""

    path: Path
    family: str
    state: dict[str, Any]
    train: TrainItems
    n_users: int
    n_items: int

    def user_index(self, user: str) -> int:
        """The dense index of ``user``: its raw id in the dataset when the run kept them, else the index."""
        ids = self.state.get("user_ids")
        if ids is not None:
            for u, raw in enumerate(ids):
                if str(raw) == user:
                    return u
            raise ConfigError(f"{self.path}: no user {user!r} in this run (raw ids, e.g. {ids[0]!r}..{ids[-1]!r})")
        try:
            u = int(user)
        except ValueError:
            raise ConfigError(f"{self.path}: users are numbered 0..{self.n_users - 1}, got {user!r}") from None
        if not 0 <= u < self.n_users:
            raise ConfigError(f"{self.path}: users are numbered 0..{self.n_users - 1}, got {u}")
        return u

    def item_label(self, item: int) -> Any:
        """The dataset's id of item ``item`` (a 0-based index in the model's item order, as the SDK's
        ``recommend`` returns): its raw id when the run kept them, else the index itself."""
        ids = self.state.get("item_ids")
        return ids[item] if ids is not None else int(item)

    def user_label(self, user: int) -> Any:
        """The dataset's id of user ``user`` (a 0-based row); `user_index` is the inverse."""
        ids = self.state.get("user_ids")
        return ids[user] if ids is not None else int(user)

    def device_model(self, user: int | None) -> tuple[Any, int]:
        """(model, userid inside it): for ``user``, the model a device holding that user would load;
        for None, the run's whole model (LightFR, MF and iALS: every user; FELB/FNMF: needs a user)."""
        if self.family == "lightfr":
            return self._lightfr_model(user), 0
        clients = self.state["clients"]
        start = 0
        for client in clients:
            rows = int(client["rows"])
            if user is None and len(clients) == 1:
                return _model_from_bytes(self.family, client["model"]), 0
            if user is not None and start <= user < start + rows:
                model = _model_from_bytes(self.family, client["model"])
                if self.family in ("mf", "ials"):  # one model holds every user: hand out that user's own model
                    return _one_user(model, user), 0
                return model, user - start
            start += rows
        if user is None:
            raise ConfigError(f"{self.path}: a {self.family} run has {len(clients)} client models; pass --user")
        raise StorageError(f"{self.path}: no client holds user {user}")

    def _lightfr_model(self, user: int | None) -> LightFRModel:
        s = self.state
        bits = int(s["bits"])
        codes = unpack_signs(from_bytes(s["user_words"], bits, self.n_users), bits)
        items = unpack_signs(from_bytes(s["item_words"], bits, self.n_items), bits)
        rows = codes if user is None else codes[user : user + 1]
        model = LightFRModel(self.n_items, LightFRConfig(bits=bits), n_users=rows.shape[0])
        model.set_item_codes(items, 1)
        for u, code in enumerate(rows):
            model.set_user_code(code, userid=u)
        levels = s.get("item_levels")
        if levels is not None:
            model.item_levels = np.frombuffer(levels, dtype=np.uint8).copy()
            model.hamming_weight = int(s.get("hamming_weight", 1))
        if s.get("user_q") is not None:  # runs saved before ranking vectors hold none: the codes rank
            q = np.frombuffer(s["user_q"], dtype="<i2")
            a = np.frombuffer(s.get("user_weight") or b"", dtype="<i8")
            if q.size != self.n_users * bits or a.shape != (self.n_users,) or np.any(a < 1):
                raise StorageError(
                    f"{self.path}: user_q / user_weight must hold {bits} values and one weight >= 1 per user"
                )
            q = q.reshape(self.n_users, bits)
            rows_q, rows_a = (q, a) if user is None else (q[user : user + 1], a[user : user + 1])
            model.user_q[:] = rows_q
            model.user_weight[:] = rows_a
        return model

    def recommend(self, user: int, n: int, seed: int = 0) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
        """The top ``n`` items for ``user`` that it did not rate in training, as its device ranks them
        (random ties from ``seed``)."""
        model, row = self.device_model(user)
        liked = self.train.of(user)
        ids, scores = model.recommend(liked, N=n, userid=row, rng=np.random.default_rng(seed))
        keep = ids >= 0
        return np.asarray(ids[keep], dtype=np.int64), np.asarray(scores[keep], dtype=np.float32)


def _one_user(model: Any, user: int) -> Any:
    """A one-user copy of an MF or iALS model holding every user: the model that user's device holds."""
    one = type(model)(model.n_items, model.config, n_users=1)
    one.item_factors = model.item_factors.copy()
    one.model_version = model.model_version
    one.user_factors = model.user_factors[user : user + 1].copy()
    one.user_trained = model.user_trained[user : user + 1].copy()
    if isinstance(model, IALSModel):  # the item term the run ranks with (protocol 1.10)
        one.item_levels, one.level_weight = model.item_levels, model.level_weight
    return one


def _peek_kind(path: Path) -> str | None:
    """The kind a store file says it holds (unverified; `load_store` checks everything), or None."""
    import msgpack

    try:
        outer = msgpack.unpackb(path.read_bytes(), raw=False)
    except Exception:  # unreadable or not msgpack: the caller asks load_store for the precise error
        return None
    kind = outer.get("kind") if isinstance(outer, dict) else None
    return kind if isinstance(kind, str) else None


def load_run(path: Path) -> Run:
    """Read a run file written by ``fedrec simulate --save``.

    Raises
    ------
    StorageError
        Missing, corrupt, not a run file, or fields that do not fit together.
    """
    kind = _peek_kind(Path(path))
    if kind is None:  # unreadable or not a store file: let the store say exactly what is wrong
        load_store(path, LIGHTFR_RUN, move_aside=False)
        kind = LIGHTFR_RUN
    if kind not in (LIGHTFR_RUN, FAMILY_RUN):
        raise StorageError(
            f"{path} is a {kind!r} file, not a run written by 'fedrec simulate --save'"
            + (" (it is already an on-device model file)" if kind in ("lightfr", "mf", "felb", "fnmf") else "")
        )
    state = load_store(path, kind, move_aside=False)  # the user's file: report a damaged one, never rename it
    try:
        train = TrainItems.from_fields(state)
        family = "lightfr" if kind == LIGHTFR_RUN else str(state["family"])
        if family not in ("lightfr", *_MODELS):
            raise ValueError(f"unknown family {family!r}")
        if family == "lightfr":
            n_users, n_items = int(state["n_users"]), int(state["n_items"])
        else:
            n_users = sum(int(c["rows"]) for c in state["clients"])
            n_items = int(state["n_items"])
        if train.indptr.size != n_users + 1:
            raise ValueError(f"training items for {train.indptr.size - 1} users, the run has {n_users}")
    except (KeyError, TypeError, ValueError) as exc:
        raise StorageError(f"{path}: not a valid run file ({exc})") from exc
    return Run(path=Path(path), family=family, state=state, train=train, n_users=n_users, n_items=n_items)
