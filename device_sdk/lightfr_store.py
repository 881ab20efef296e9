"""`LightFRModel`'s persistence: its state as one on-device store file (`device_sdk.store`, kind "lightfr").

The model's ``save`` and ``load`` are these two functions; they read and set its private arrays (the packed
words it keeps beside the ±1 codes) so that a load restores exactly what was saved.  Keys added later are
optional on load (a file written before the item term, asymmetric scoring, the DP flags or the real-valued
embeddings holds none).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import TYPE_CHECKING

import numpy as np

from device_sdk.lightfr import held_for
from device_sdk.lightfr_config import _KIND, LightFRConfig
from device_sdk.lightfr_rank import adopt_embeddings
from device_sdk.store import load_store, save_store
from protocol.codes import from_bytes, to_bytes, unpack_signs
from protocol.errors import StorageError
from protocol.families.lightfr import LEVEL_CENTER

if TYPE_CHECKING:
    from device_sdk.models import LightFRModel

__all__ = ["save_model", "load_model"]


def save_model(model: LightFRModel, path: str | os.PathLike[str]) -> None:
    """Write ``model`` atomically to one store file (see `device_sdk.store`): `LightFRModel.save`."""
    cfg = asdict(model.config)
    cfg["rating_range"] = list(cfg["rating_range"]) if cfg["rating_range"] is not None else None
    save_store(
        path,
        _KIND,
        {
            "config": cfg,
            "n_items": model.n_items,
            "n_users": model.n_users,
            "model_version": model.model_version,
            "item_words": to_bytes(model._item_words),
            "user_words": to_bytes(model._user_words),
            "user_trained": np.packbits(model.user_trained).tobytes(),
            "item_levels": None if model._levels is None else model._levels.tobytes(),
            "hamming_weight": model._weight,
            "user_q": model.user_q.astype("<i2").tobytes(),
            "user_weight": model.user_weight.astype("<i8").tobytes(),
            "private_rounds": model.private_rounds,
            "private_model": model.private_model,
            **_gram_state(model),
            **_embedding_state(model),
        },
    )


def _gram_state(model: LightFRModel) -> dict[str, object]:
    """The item Gram's sums once computed (`lightfr.gram_sums`, exact integers in float64): a file loaded for a
    fold-in then skips the pass over the catalogue (82 ms at 10^6 items, f = 64)."""
    sums = held_for(model._gram_sums, model._item_words, model.item_levels)
    if sums is None:  # none, or made from codes the model no longer holds
        return {}
    G, Dl = sums
    return {"item_gram": {"codes": G.astype("<f8").tobytes(), "levels": Dl.astype("<f8").tobytes()}}


def _load_gram(model: LightFRModel, state: dict[str, object]) -> None:
    """Install the stored Gram sums after checking they can be those of the model's m codes of ±1 and its levels
    (symmetric integers of m's parity, m on the diagonal; level sums bounded and of the right parity).  A wrong
    Gram that passes would change fold-ins, never what leaves the device: the file is the device's own."""
    raw = state.get("item_gram")  # files written before it, or before any fold-in, hold none
    if raw is None:
        return
    if (
        not isinstance(raw, dict)
        or set(raw) != {"codes", "levels"}
        or not all(isinstance(v, bytes) for v in raw.values())
    ):
        raise ValueError("item_gram must map codes and levels to bytes")
    f, m = model.config.bits, model.n_items
    G, Dl = np.frombuffer(raw["codes"], "<f8"), np.frombuffer(raw["levels"], "<f8")
    if G.size != f * f or Dl.size != f:
        raise ValueError(f"item_gram must hold {f}×{f} and {f} sums")
    G = G.reshape(f, f)
    whole = bool(np.all(G == np.round(G)) and np.all(Dl == np.round(Dl)))
    # Each entry of DᵀD sums m terms ±1: |entry| <= m, of m's parity, m on the diagonal.
    ok = whole and np.array_equal(G, G.T) and np.all(np.diag(G) == m) and np.all(np.abs(G) <= m)
    if not (ok and np.all(np.mod(G - m, 2) == 0)):
        raise ValueError(f"item_gram is not the Gram of {m} codes of ±1")
    # Each entry of Dᵀ(level − 128) sums ±(level_i − 128): at most Σ|level_i − 128|, of Σ(level_i − 128)'s parity.
    lv = model.item_levels
    c = np.zeros(m, np.int64) if lv is None else lv.astype(np.int64) - LEVEL_CENTER
    if not (np.all(np.abs(Dl) <= np.abs(c).sum()) and np.all(np.mod(Dl - c.sum(), 2) == 0)):
        raise ValueError("item_gram's level sums do not fit the item levels")
    model._gram_sums = (model._item_words, model.item_levels, G.astype(np.float64), Dl.astype(np.float64))


#: The layout of the real-valued embeddings in a store file: 1 = E as little-endian float16 rows (m, d),
#: EᵀE as float32 (d, d), each user's vector as float32 (n_users, d) and a packed bit per user saying it
#: is solved against E.  A file without the key holds no embeddings (written before they existed).
_EMBEDDING_FORMAT = 1


def _embedding_state(model: LightFRModel) -> dict[str, object]:
    E, G = model.item_embeddings, model.embedding_gram
    if E is None or G is None:
        return {}
    return {
        "embedding_format": _EMBEDDING_FORMAT,
        "embedding_dim": int(E.shape[1]),
        "item_embeddings": E.astype("<f2").tobytes(),
        "embedding_gram": G.astype("<f4").tobytes(),
        "ials_alpha": model.ials_alpha,
        "ials_reg": model.ials_reg,
        "user_vectors": model.user_vectors.astype("<f4").tobytes(),
        "user_vector_ok": np.packbits(model.user_vector_ok).tobytes(),
    }


def _load_embeddings(model: LightFRModel, state: dict[str, object]) -> None:
    """Restore what `_embedding_state` wrote (nothing for a file written before embeddings existed)."""
    fmt = state.get("embedding_format")
    if fmt is None:
        return
    if fmt != _EMBEDDING_FORMAT:
        raise ValueError(f"unknown embedding format {fmt!r} (this SDK reads format {_EMBEDDING_FORMAT})")
    d, m, n = state["embedding_dim"], model.n_items, model.n_users
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise ValueError(f"embedding_dim must be an integer >= 1, got {d!r}")
    raw: list[bytes] = []
    for key in ("item_embeddings", "embedding_gram", "user_vectors", "user_vector_ok"):
        value = state[key]
        if not isinstance(value, bytes):
            raise ValueError(f"{key} must be bytes")
        raw.append(value)
    E, G, U, ok = (np.frombuffer(b, dtype=t) for b, t in zip(raw, ("<f2", "<f4", "<f4", "u1"), strict=True))
    if E.size != m * d or G.size != d * d or U.size != n * d:
        raise ValueError(f"the embedding arrays do not hold {m} items, {n} users and d = {d}")
    alpha, reg = state["ials_alpha"], state["ials_reg"]
    # E views the file's bytes (immutable): installed without a copy of its 2·m·d bytes.
    adopt_embeddings(model, E.reshape(m, d), alpha, reg, G.reshape(d, d), immutable=True)  # type: ignore[arg-type]
    vectors = U.reshape(n, d).astype(np.float32)
    if not np.all(np.isfinite(vectors)):
        raise ValueError("user vectors must be finite")
    model.user_vectors = vectors
    model.user_vector_ok = np.unpackbits(ok)[:n].astype(bool)


def load_model(
    cls: type[LightFRModel], path: str | os.PathLike[str], *, rng: np.random.Generator | None = None
) -> LightFRModel:
    """Read a model of type ``cls`` written by `save_model`: `LightFRModel.load`; raises `StorageError` on any
    problem with the file."""
    state = load_store(path, _KIND)
    try:
        raw_cfg = dict(state["config"])
        if raw_cfg.get("rating_range") is not None:
            raw_cfg["rating_range"] = tuple(raw_cfg["rating_range"])
        if raw_cfg.get("unobserved_weight") == 0 and raw_cfg.get("query_planes"):
            # Stored by an SDK that accepted planes with w0 = 0 and trained ±1 codes for them: what P = 0 is.
            raw_cfg["query_planes"] = 0
        config = LightFRConfig(**raw_cfg)
        n_items, n_users = int(state["n_items"]), int(state["n_users"])
        model = cls(n_items, config, n_users=n_users, rng=rng or np.random.default_rng(), _random_codes=False)
        f = config.bits
        model.set_item_codes(from_bytes(state["item_words"], f, n_items), int(state["model_version"]))
        uw = from_bytes(state["user_words"], f, n_users)
        model.user_codes = unpack_signs(uw, f)
        model._user_words = uw.copy()
        trained = np.unpackbits(np.frombuffer(state["user_trained"], np.uint8))[:n_users]
        model.user_trained = trained.astype(bool)
        # Files written before the item term existed hold neither key.
        levels = state.get("item_levels")
        model.item_levels = None if levels is None else np.frombuffer(levels, dtype=np.uint8).copy()
        model.hamming_weight = int(state.get("hamming_weight", 1))
        # Files written before asymmetric scoring hold no vectors.
        if state.get("user_q") is not None:
            uq = np.frombuffer(state["user_q"], dtype="<i2").reshape(n_users, f).astype(np.int16)
            uwt = np.frombuffer(state["user_weight"], dtype="<i8").astype(np.int64)
            if uwt.shape != (n_users,) or np.any(uwt < 0):
                raise ValueError("user_weight must hold one weight >= 0 per user")
            model.user_q, model.user_weight = uq.copy(), uwt.copy()
        private = state.get("private_rounds", False)  # files written before the rule hold none
        if not isinstance(private, bool):
            raise ValueError(f"private_rounds must be a boolean, got {private!r}")
        model.private_rounds = private
        held = state.get("private_model", False)  # files written before protocol 1.7 hold none
        if not isinstance(held, bool):
            raise ValueError(f"private_model must be a boolean, got {held!r}")
        model.private_model = held
        _load_gram(model, state)  # after the levels and weight, whose setters forget a Gram
        _load_embeddings(model, state)  # files written before embeddings existed hold none
    except (KeyError, TypeError, ValueError) as exc:
        raise StorageError(f"{path} is a valid store file but its LightFR state is invalid: {exc}") from exc
    return model
