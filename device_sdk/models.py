"""`LightFRModel`: the on-device LightFR recommender with an implicit-style API.

Invariants:
- The model holds the global item codes ``D`` as received from the server, packed (w, m) words (ranking and
  fold-in read them, and the rows they need), and the ±1 matrix (m, f) only once something asks for all of
  it (`item_codes`: local training); and this device's private user code(s) ``B`` (n_users, f); a phone has
  n_users = 1, a cross-silo client or a simulator may hold more.
- `fit_local` and `fold_in` change only user codes; item codes change only through `set_item_codes`
  (a new global model).  Ratings never leave the object except through the update `fit_local`
  returns, which is what the secure-aggregation client uploads.
- All randomness comes from a generator passed in (or one the model was constructed with).
"""

from __future__ import annotations

import math
import os
from dataclasses import InitVar, dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from device_sdk import lightfr, lightfr_rank, realvalued
from device_sdk.codes import all_signs, pack_rows
from device_sdk.family import LocalRatings, LocalResult, RoundHooks
from device_sdk.lightfr_config import _KIND, LightFRConfig, LocalUpdate, apply_plan
from device_sdk.lightfr_store import load_model, save_model
from device_sdk.retrieval import Recommender, as_items, check_userid, fold_in_items
from device_sdk.topk import HammingIndex
from protocol.codes import from_bytes, pack_signs, random_signs, unpack_signs, words_for
from protocol.errors import ModelError
from protocol.families.lightfr import UploadLayout, bias_from_levels, clip_parts
from protocol.plan import LightFRParams, TrainingPlan
from protocol.spec import Aggregation

if TYPE_CHECKING:
    from protocol.messages import RoundInvite

#: LightFRConfig, LocalUpdate and apply_plan live in `device_sdk.lightfr_config`, the store format in
#: `device_sdk.lightfr_store`; this module is where callers import the LightFR model's names from.
__all__ = ["LightFRConfig", "LightFRModel", "LocalUpdate", "apply_plan"]


@dataclass
class LightFRModel(Recommender, RoundHooks):
    """LightFR binary-code recommender for one device (or a small batch of users).

    Parameters
    ----------
    n_items : number of items m in the global catalogue.
    config : hyper-parameters.
    n_users : user codes held (1 on a phone).
    rng : generator for initial codes, negative sampling and tie-breaking.

    Attributes
    ----------
    item_levels : (m,) uint8 item term (for example a quantized popularity bias), or None for none.
    hamming_weight : B >= 1; `recommend` ranks item i by the integer score
        (f − Hamming(b_u, d_i)) · B + item_levels[i] (levels None count as 0), higher is better.
    """

    n_items: int
    config: LightFRConfig = field(default_factory=LightFRConfig)
    n_users: int = 1
    rng: np.random.Generator = field(default_factory=np.random.default_rng, repr=False)
    model_version: int = 0
    #: False: start from read-only all-+1 placeholders instead of drawing random codes, for a caller that
    #: installs every code next (`load`: drawing the 64·10^6 signs of 10^6 items it would throw away took
    #: 70 ms, and held 64 MB while the stored codes were unpacked beside them).
    _random_codes: InitVar[bool] = True
    #: (words, the (m, f) ±1 item codes unpacked from them) once `item_codes` asked; used only while ``words``
    #: is still ``_item_words``, so a model swap racing an unpack never leaves a stale matrix (no lock).
    _item_signs: tuple[NDArray[np.uint64], NDArray[np.int8]] | None = field(default=None, init=False, repr=False)
    user_codes: NDArray[np.int8] = field(init=False, repr=False)
    _item_words: NDArray[np.uint64] = field(init=False, repr=False)
    _user_words: NDArray[np.uint64] = field(init=False, repr=False)
    user_trained: NDArray[np.bool_] = field(init=False, repr=False)
    _levels: NDArray[np.uint8] | None = field(default=None, init=False, repr=False)
    _weight: int = field(default=1, init=False, repr=False)
    _index: HammingIndex | None = field(default=None, init=False, repr=False)
    #: (words, levels, weight, `item_gram`) and (words, levels, G, Dl) of `lightfr.gram_sums` (kept in the store
    #: file): each used only while the words and levels it was made from are the model's (as ``_item_signs``).
    _gram: tuple[Any, ...] | None = field(default=None, init=False, repr=False)
    _gram_sums: tuple[Any, ...] | None = field(default=None, init=False, repr=False)
    #: Asymmetric scoring (``config.query_planes``): each user's odd integers q (n, f) and weight a (n,),
    #: a = 0 for a user who has a ±1 code instead.
    user_q: NDArray[np.int16] = field(init=False, repr=False)
    user_weight: NDArray[np.int64] = field(init=False, repr=False)
    #: Whether the last round this device trained in added DP noise (`RoundInvite.dp_mu` > 0; set by
    #: `device_sdk.training.local_round`, kept in the store).  Symmetric training then ranks with the ±1
    #: code whatever ``config.rank_planes`` says: against noised item codes and levels the ranking vector
    #: fell to a third of popularity's HR@10 on real devices (docs/dp-accounting.md §8).
    private_rounds: bool = field(default=False, init=False, repr=False)
    #: Whether the server said DP noise trained the global model held (`ModelPayload.dp_trained`, protocol
    #: 1.7, set by `set_global`, kept in the store): the same rule as ``private_rounds``, for a device that
    #: only downloads.  Trusting the server here costs no privacy: ranking is local, so a false flag can only
    #: make the device rank with its ±1 code (a lie that it is private) or with its planes (a lie that it is
    #: not), a quality question, never a leak.
    private_model: bool = field(default=False, init=False, repr=False)
    #: Real-valued item embeddings E (m, d) float16 kept beside the codes (`set_embeddings`), their Gram EᵀE
    #: (d, d) float32 and the implicit-ALS α and reg of the user step; None without them.  Each user's
    #: real-valued vector (n_users, d) float32, solved by `fold_in` / `fit_local` / `refresh_ranking`, and
    #: whether it is solved against the embeddings held now.
    _embeddings: NDArray[np.float16] | None = field(default=None, init=False, repr=False)
    _embedding_gram: NDArray[np.float32] | None = field(default=None, init=False, repr=False)
    ials_alpha: float = field(default=0.0, init=False, repr=False)
    ials_reg: float = field(default=1.0, init=False, repr=False)
    user_vectors: NDArray[np.float32] = field(init=False, repr=False)
    user_vector_ok: NDArray[np.bool_] = field(init=False, repr=False)
    #: Each user's ranking query as `device_sdk.lightfr_rank` derives it from its vector, kept while that
    #: vector, code and weights stay the same (a cache: checked against them on every use).
    _queries: dict[int, Any] = field(default_factory=dict, init=False, repr=False)

    def _derived_clear(self) -> None:
        """Forget what is derived from the item codes, levels or embeddings (the ranking queries)."""
        self._queries.clear()

    def __post_init__(self, _random_codes: bool) -> None:
        if self.n_items <= 0:
            raise ValueError(f"n_items must be positive, got {self.n_items}")
        if self.n_users <= 0:
            raise ValueError(f"n_users must be positive, got {self.n_users}")
        f = self.config.bits
        if _random_codes:
            signs = random_signs(self.n_items, f, self.rng)
            signs.flags.writeable = False  # as `item_codes` hands it out
            self.user_codes = random_signs(self.n_users, f, self.rng)
            self._item_words = pack_rows(signs)
            self._item_signs = (self._item_words, signs)
            self._user_words = pack_signs(self.user_codes)
        else:
            # Read-only all-+1 placeholders holding no memory, until the caller installs codes.
            ones = pack_signs(np.ones((1, f), dtype=np.int8))  # (w, 1): the words of an all-+1 code
            self.user_codes = np.broadcast_to(np.int8(1), (self.n_users, f))
            self._item_words = np.broadcast_to(ones, (ones.shape[0], self.n_items))
            self._user_words = np.broadcast_to(ones, (ones.shape[0], self.n_users))
        self.user_trained = np.zeros(self.n_users, dtype=bool)
        self.user_q = np.zeros((self.n_users, f), dtype=np.int16)
        self.user_weight = np.zeros(self.n_users, dtype=np.int64)
        self.user_vectors = np.zeros((self.n_users, 0), dtype=np.float32)
        self.user_vector_ok = np.zeros(self.n_users, dtype=bool)

    KIND: ClassVar[str] = _KIND

    # -- the item codes ---------------------------------------------------------------------------
    @property
    def item_codes(self) -> NDArray[np.int8]:
        """(m, f) int8 ±1 item codes, read-only (`set_item_codes` changes them).  Unpacked from the
        packed words on first use and kept until the codes change.  Ranking, the item Gram and fold-in
        under the all-items objective (the default) read the words and the rows they need alone, so a
        device that only downloads, folds in and ranks holds 8 bytes an item at f = 64, not 72."""
        words = self._item_words
        held = lightfr.held_for(self._item_signs, words)
        signs = unpack_signs(words, self.config.bits) if held is None else held[0]
        self._item_signs = (words, signs)
        signs.flags.writeable = False  # a write would part it from the words that rank (also after a deepcopy)
        return signs

    def _item_rows(self, ids: NDArray[np.int64]) -> NDArray[np.int8]:
        """Rows ``ids`` of `item_codes`, (k, f), unpacked from their words alone when the matrix is not held."""
        words = self._item_words
        held = lightfr.held_for(self._item_signs, words)
        return unpack_signs(words[:, ids], self.config.bits) if held is None else held[0][ids]

    # -- the item term ----------------------------------------------------------------------------
    @property
    def item_levels(self) -> NDArray[np.uint8] | None:
        """(m,) uint8 level of every item added to its score, or None (all 0)."""
        return self._levels

    @item_levels.setter
    def item_levels(self, levels: ArrayLike | None) -> None:
        if levels is None:
            self._levels = None
        else:
            lv = np.asarray(levels)
            if lv.shape != (self.n_items,):
                raise ValueError(f"item_levels must have shape ({self.n_items},), got {lv.shape}")
            if lv.size and (not np.issubdtype(lv.dtype, np.integer) or lv.min() < 0 or lv.max() > 255):
                raise ValueError("item_levels must be integers in [0, 255]")
            self._levels = lv.astype(np.uint8)
        self._index = None
        self._gram = self._gram_sums = None
        self._derived_clear()

    @property
    def hamming_weight(self) -> int:
        """B: the score of one bit of Hamming similarity, counted against one item level."""
        return self._weight

    @hamming_weight.setter
    def hamming_weight(self, weight: int) -> None:
        if isinstance(weight, bool) or int(weight) != weight or weight < 1:
            raise ValueError(f"hamming_weight must be an integer >= 1, got {weight!r}")
        self._weight = int(weight)
        self._index = None
        self._gram = None
        self._derived_clear()

    def item_gram(self) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
        """(G_D = DᵀD (f, f), Dᵀβ (f,), β (m,)) of the current item codes and the item biases β the
        levels stand for (`protocol.families.lightfr.bias_from_levels`): what the all-items objective
        needs of the catalogue.  The sums (`lightfr.gram_sums`, exact) are computed once per new model, or
        read from the store file with the codes; Dᵀβ = 2/(f·B)·Dᵀ(level − 128)."""
        words, lv, weight = self._item_words, self._levels, self._weight
        held = lightfr.held_for(self._gram, words, lv)
        if held is not None and held[0] == weight:
            return held[1]
        f, m = self.config.bits, self.n_items
        sums = lightfr.held_for(self._gram_sums, words, lv) or lightfr.gram_sums(words, f, lv)
        self._gram_sums = (words, lv, *sums)
        gram = (sums[0], sums[1] * (2.0 / (f * weight)), bias_from_levels(lv, m, f, weight))
        self._gram = (words, lv, weight, gram)
        return gram

    # -- real-valued item embeddings (stage 2 of the ranking) ------------------------------------
    @property
    def item_embeddings(self) -> NDArray[np.float16] | None:
        """(m, d) float16 real-valued item embeddings, or None (`set_embeddings`)."""
        return self._embeddings

    @property
    def embedding_gram(self) -> NDArray[np.float32] | None:
        """(d, d) float32 EᵀE of the embeddings held, or None."""
        return self._embedding_gram

    def set_embeddings(
        self, embeddings: ArrayLike | None, *, alpha: float = 0.0, reg: float = 1.0, gram: ArrayLike | None = None
    ) -> None:
        """Adopt real-valued item embeddings E (m, d), kept as float16, and the implicit-ALS α >= 0 and
        reg > 0 of the user step (`device_sdk.realvalued.ials_user_vectors`); ``gram`` is EᵀE (d, d) as
        trained (computed from the float16 rows when None).  None drops them.  Every user's vector is then
        stale until `fold_in`, `fit_local` or `refresh_ranking` solves it again: until then it ranks as a
        model without embeddings does.

        Raises ValueError for a wrong shape, a non-float or non-finite array, values beyond float16, or
        α / reg out of range; nothing changes then."""
        lightfr_rank.adopt_embeddings(self, embeddings, alpha, reg, gram)

    def _solve_user_vectors(self, users: NDArray[np.int64], item_lists: list[NDArray[np.int64]]) -> None:
        """Each of ``users``' real-valued vector from its items (`realvalued.ials_user_vectors`), when the
        model holds embeddings."""
        if self._embeddings is None or self._embedding_gram is None:
            return
        U = realvalued.ials_user_vectors(
            self._embeddings, self._embedding_gram, item_lists, self.ials_alpha, self.ials_reg
        )
        self.user_vectors[users] = U
        self.user_vector_ok[users] = True

    def _hamming_index(self) -> HammingIndex:
        """The retrieval index of the current item codes and levels, built once per change."""
        if self._index is None:
            self._index = HammingIndex(
                self._item_words,
                self.config.bits,
                self._levels,
                self._weight,
                substring_index=self.config.substring_index,
            )
        return self._index

    @property
    def rank(self) -> int:
        """Code length f (the ``bits`` field of the wire messages)."""
        return self.config.bits

    # -- the global model -------------------------------------------------------------------------
    def set_global(
        self,
        words: bytes,
        values: bytes,
        version: int,
        *,
        item_levels: bytes = b"",
        hamming_weight: int = 1,
        unobserved_weight: float = 0.0,
        confidence: float = 0.0,
        dp_trained: bool = False,
    ) -> None:
        """Adopt a `ModelPayload`'s packed item codes (and item levels, protocol 1.3) as global model
        ``version``.

        Protocol 1.7: ``unobserved_weight`` > 0 is the w0 (with its α ``confidence``) the server's model goes
        with, the one its next plan carries; the device takes it, as it takes a plan's (`apply_plan`), so
        it ranks (ridge ``rank_ridge``·w0·m) and folds in with the server's w0, not the first round's floor.
        0 (a 1.6 server, or the sampled-negatives objective) keeps the device's own.  A w0 outside
        [0, 1 + α] or not a finite number is refused (ValueError) before anything changes.
        ``dp_trained`` sets ``private_model``: a DP-trained model ranks with the ±1 code.
        """
        if values:
            raise ValueError("a LightFR model takes packed item codes, not float values")
        if item_levels and len(item_levels) != self.n_items:
            raise ValueError(f"item_levels has {len(item_levels)} bytes for {self.n_items} items")
        if type(dp_trained) is not bool:
            raise ValueError(f"dp_trained must be a bool, got {dp_trained!r}")
        config = self.config
        if unobserved_weight != 0 or confidence != 0:
            for name, value in (("unobserved_weight", unobserved_weight), ("confidence", confidence)):
                if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                    raise ValueError(f"the server's {name} must be a finite number, got {value!r}")
            if not (unobserved_weight > 0 and 0 <= confidence and unobserved_weight <= 1.0 + confidence):
                raise ValueError(
                    f"the server's unobserved_weight must be in (0, 1 + confidence] with confidence >= 0, got "
                    f"w0={unobserved_weight!r}, confidence={confidence!r}"
                )
            # The plan's bounds (LightFRConfig → LightFRParams) check it once more.
            config = replace(config, unobserved_weight=float(unobserved_weight), confidence=float(confidence))
        levels = np.frombuffer(item_levels, dtype=np.uint8).copy() if item_levels else None
        self.set_item_codes(from_bytes(words, self.config.bits, self.n_items), version)
        self.item_levels = levels
        self.hamming_weight = hamming_weight
        self.config = config
        self.private_model = dp_trained
        if dp_trained and not config.query_planes:
            # Ranking vectors solved before (symmetric training keeps them for ranking only) give way to the
            # ±1 codes at once, not at the next fit_local or fold_in.
            self.user_weight[:] = 0

    def local_update(self, plan: TrainingPlan, data: LocalRatings, rng: np.random.Generator) -> LocalResult:
        """One round of local training as ``plan`` says; the upload is the item gradient
        (Agg_grad) or the change D^u − D of the local item codes (Agg_para), flattened.

        Draws from ``rng`` in a fixed order: a first-round user code, the θ ratings kept, the
        negatives and DCD tie-breaks inside `fit_local`.
        """
        apply_plan(self, plan)
        if data.n_users != 1 or self.n_users != 1:
            raise ValueError("a LightFR device trains one user per round")
        data.check_items(self.n_items)
        if not self.user_trained[0]:
            # The first round starts from a random code drawn from the round's generator, so that a
            # seeded simulation is reproducible and a real device's start is cryptographically random.
            self.reset_user(rng)
        item_ids, values = data.items, data.ratings
        if plan.example_cap and item_ids.size > plan.example_cap:
            # θ of the device's ratings per round bound its contribution (per-user DP).
            keep = np.sort(rng.choice(item_ids.size, plan.example_cap, replace=False))
            item_ids = item_ids[keep]
            values = None if values is None else values[keep]
        assert isinstance(plan.params, LightFRParams)  # apply_plan checked the kind
        aggregation = plan.params.aggregation
        update = self.fit_local(item_ids, values, aggregation=aggregation, rng=rng)
        if update.parts is not None:
            layout = UploadLayout(self.n_items, self.config.bits, full=True)
            vec = layout.join(**update.parts)
            share = plan.params.counts_share
            if share > 0 and math.isfinite(plan.clip_norm):  # the private popularity channel's part of C
                vec = clip_parts(vec, layout, plan.clip_norm, share)
            return LocalResult(vector=vec, examples=update.n_examples, info={"flips": update.flips})
        x = update.values.astype(np.float64)
        if aggregation is Aggregation.PARA:
            x = x - self.item_codes
        return LocalResult(vector=x.ravel(), examples=update.n_examples, info={"flips": update.flips})

    def set_item_codes(self, codes: NDArray[np.int8] | NDArray[np.uint64], version: int) -> None:
        """Install new global item codes, as ±1 (m, f) int8 or packed (w, m) uint64 words."""
        f, m = self.config.bits, self.n_items
        arr = np.asarray(codes)
        if arr.dtype == np.uint64:
            if arr.shape != (words_for(f), m):
                raise ValueError(f"packed item codes must be {(words_for(f), m)}, got {arr.shape}")
            words = np.array(arr, dtype=np.uint64, order="C")  # a copy the model owns
            if f % 64:  # bits above the code length carry nothing: cleared, as unpacking and packing would
                words[-1] &= np.uint64((1 << (f % 64)) - 1)
        else:
            if arr.shape != (m, f) or not all_signs(arr):
                raise ValueError(f"item codes must be a ({m}, {f}) matrix of ±1")
            words = pack_rows(arr.astype(np.int8, copy=False))
        self._item_words = words
        self._item_signs = None  # unpacked again from the words if something needs the ±1 matrix
        self._index = None
        self._gram = self._gram_sums = None
        self._derived_clear()
        self.model_version = int(version)

    # -- training -------------------------------------------------------------------------------
    def _user_csr(
        self, items: NDArray[np.int64], targets: NDArray[np.float64], rng: np.random.Generator, negatives: int
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64]]:
        indptr = np.array([0, items.size], dtype=np.int64)
        if negatives == 0 or items.size == 0:
            return indptr, items, targets
        _, neg = lightfr.sample_negatives(indptr, items, self.n_items, negatives, rng)
        all_items = np.concatenate([items, neg])
        return (
            np.array([0, all_items.size], np.int64),
            all_items,
            np.concatenate([targets, np.zeros(neg.size)]),
        )

    def fit_local(
        self,
        user_items: ArrayLike,
        ratings: ArrayLike | None = None,
        *,
        userid: int = 0,
        aggregation: Aggregation = Aggregation.GRAD,
        rng: np.random.Generator | None = None,
    ) -> LocalUpdate:
        """One local round (LightFR Algorithm 1, ClientUpdate): E epochs of DCD on the user code with
        the item codes fixed, then the upload for the server.

        Parameters
        ----------
        user_items : ids of the items this user rated (array or a 1 × m sparse row).
        ratings : raw ratings of those items (normalised with ``config.rating_range``); None for
            implicit feedback (every observed item counts as 1).
        userid : which of the held user codes to train.
        aggregation : upload item gradients (GRAD, eq. 12) or locally updated codes (PARA, eq. 17).
        rng : generator for negative sampling (defaults to the model's).

        Returns
        -------
        LocalUpdate with the dense (m, f) upload, averaged over epochs for GRAD; under the all-items
        objective (``config.unobserved_weight > 0``) E epochs of `lightfr.dcd_full` against the item
        codes and levels, and every part of the upload in ``parts``.
        """
        rng = rng or self.rng
        cfg = self.config
        items = as_items(user_items, self.n_items)
        check_userid(userid, self.n_users)
        targets = cfg.normalize(None if ratings is None else np.asarray(ratings, float), items.size)
        b = self.user_codes[userid : userid + 1]
        if cfg.unobserved_weight > 0:
            if aggregation is not Aggregation.GRAD:
                raise ValueError("the all-items objective uploads gradients (aggregation 'grad')")
            full = self._fit_full(items, targets, b, userid)
            self._solve_user_vectors(np.array([userid]), [items])
            return full
        acc: NDArray[Any] | None = None
        flips = 0
        n_examples = 0
        for _ in range(cfg.local_epochs):
            indptr, all_items, r = self._user_csr(items, targets, rng, cfg.negatives)
            b, stats = lightfr.dcd_update(indptr, all_items, r, b, self.item_codes, cfg.lam, max_sweeps=cfg.max_sweeps)
            flips += stats.flips
            n_examples = all_items.size
            if aggregation is Aggregation.GRAD:
                g = lightfr.item_gradient_sum(indptr, all_items, r, b, self.item_codes)
                acc = g if acc is None else acc + g
            else:
                acc = lightfr.item_codes_sum(indptr, all_items, r, b, self.item_codes, cfg.lam)
        if acc is None:  # pragma: no cover - local_epochs >= 1 is validated in the config
            raise ModelError("no local epoch ran")
        if aggregation is Aggregation.GRAD:
            acc = acc / cfg.local_epochs
        self._set_user(userid, b[0])
        self._solve_user_vectors(np.array([userid]), [items])
        return LocalUpdate(values=acc, aggregation=aggregation, n_examples=n_examples, flips=flips)

    def _fit_full(
        self, items: NDArray[np.int64], targets: NDArray[np.float64], b: NDArray[np.int8], userid: int
    ) -> LocalUpdate:
        cfg = self.config
        items, first = np.unique(items, return_index=True)  # each item once
        targets = targets[first]
        indptr = np.array([0, items.size], dtype=np.int64)
        beta = bias_from_levels(self.item_levels, self.n_items, cfg.bits, self.hamming_weight)
        w0, alpha = cfg.unobserved_weight, cfg.confidence
        if cfg.query_planes:
            q, a, vec = self._solve_vector(items, targets)
            parts = lightfr.full_upload(indptr, items, targets, vec[None, :], self.item_codes, beta, w0, alpha)
            self._set_vector(userid, q, a)
            return LocalUpdate(
                values=parts["gradient"], aggregation=Aggregation.GRAD, n_examples=int(items.size), flips=0, parts=parts
            )
        flips = 0
        for _ in range(cfg.local_epochs):
            b, stats = lightfr.dcd_full(
                indptr, items, targets, b, self.item_codes, beta, w0, alpha, max_sweeps=cfg.max_sweeps
            )
            flips += stats.flips
        parts = lightfr.full_upload(indptr, items, targets, b, self.item_codes, beta, w0, alpha)
        self._set_user(userid, b[0])
        if self._ranks_with_vector():
            self._set_ranking_vector(userid, items, targets)
        return LocalUpdate(
            values=parts["gradient"], aggregation=Aggregation.GRAD, n_examples=int(items.size), flips=flips, parts=parts
        )

    def fold_in(self, user_items: ArrayLike, ratings: ArrayLike | None = None, *, userid: int = 0) -> NDArray[np.int8]:
        """Cold-start code for a new user from its ratings against the current item codes, offline
        and without a server round (LightFR eq. 18–19: DCD without the balance term)."""
        cfg = self.config
        items = fold_in_items(user_items, self.n_items, userid, self.n_users)
        targets = cfg.normalize(None if ratings is None else np.asarray(ratings, float), items.size)
        if cfg.unobserved_weight > 0 and cfg.query_planes:
            uniq, first = np.unique(items, return_index=True)
            q, a, _ = self._solve_vector(uniq, targets[first])
            self._set_vector(userid, q, a)
            self._solve_user_vectors(np.array([userid]), [uniq])
            return self.user_codes[userid].copy()
        if cfg.unobserved_weight > 0:
            codes = self._fold_in_full(items, targets)
        else:
            indptr, all_items, r = self._user_csr(items, targets, self.rng, cfg.negatives)
            codes, _ = lightfr.fold_in_codes(indptr, all_items, r, self.item_codes, max_sweeps=cfg.max_sweeps)
        self._set_user(userid, codes[0])
        if self._ranks_with_vector():
            uniq, first = np.unique(items, return_index=True)
            self._set_ranking_vector(userid, uniq, targets[first])
        self._solve_user_vectors(np.array([userid]), [items])
        return codes[0].copy()

    def _fold_in_full(self, items: NDArray[np.int64], targets: NDArray[np.float64]) -> NDArray[np.int8]:
        """Fold-in under the all-items objective: DCD (`lightfr.dcd_full`) on the rated items' codes
        with the catalogue entering only through the cached item Gram, so a call costs
        O(f·|Ω_u| + f²) whatever m is.  Starts from the sign of the objective's linear part."""
        cfg = self.config
        G, Db, beta = self.item_gram()
        touched, local = np.unique(items, return_inverse=True)
        local = local.astype(np.int64).ravel()
        # Repeated ids count once, with the last rating given.
        r = np.zeros(touched.size)
        r[local] = targets
        D_sub = self._item_rows(touched)
        b_sub = beta[touched]
        c = 1.0 + cfg.confidence
        w0 = cfg.unobserved_weight
        lin = -(c * r - (c - w0) * b_sub) @ D_sub + w0 * Db  # C_k / f at b = 0
        B0 = np.where(lin > 0, -1, 1).astype(np.int8)[None, :]
        indptr = np.array([0, touched.size], dtype=np.int64)
        codes, _ = lightfr.dcd_full(
            indptr,
            np.arange(touched.size, dtype=np.int64),
            r,
            B0,
            D_sub,
            b_sub,
            w0,
            cfg.confidence,
            max_sweeps=cfg.max_sweeps,
            gram=(G, Db),
        )
        return codes

    def _ranks_with_vector(self) -> bool:
        """Symmetric training under the all-items objective ranks with the ridge vector (``rank_planes``),
        unless DP noise trained the model: this device's last round added noise (``private_rounds``) or
        the server says so of the model held (``private_model``)."""
        cfg = self.config
        private = self.private_rounds or self.private_model
        return bool(cfg.rank_planes) and cfg.unobserved_weight > 0 and not private

    def start_round(self, invite: RoundInvite) -> None:
        """Before training: a private round's model ranks with the ±1 code (``private_rounds``)."""
        self.private_rounds = invite.dp_mu > 0.0

    def adopted(self, data: LocalRatings) -> None:
        """Once per adopted version: the ranking vectors solved against the previous item codes are re-solved
        against these (`refresh_ranking`), in memory, so the client's next save writes codes and vectors in
        one atomic store file (a crash before it leaves the old model with its old vectors)."""
        self.refresh_ranking(data)

    def refresh_ranking(self, data: LocalRatings) -> int:
        """Re-solve the ranking vectors (``rank_planes``, symmetric training) of ``data``'s trained users
        against the item codes, levels and w0 held now: what a device that holds its ratings does once on
        adopting a new global model (`device_sdk.client.DeviceClient`), since a vector solved against the
        previous codes ranks the new ones with a stale vector until the next `fit_local` or `fold_in`.

        Only the vectors change (the ±1 codes the device trains with are kept); users without a rating or
        never trained keep what they hold.  Nothing to do (returns 0) when the device ranks with its ±1 codes
        (``rank_planes`` 0, the sampled-negatives objective, a DP-trained model) or trains with its vector
        (``query_planes``).  One batched ridge solve for all users, O(Σ|Ω_u|·f + n·f³) once the item Gram of
        the model is cached (one pass over the catalogue per model, shared with `fold_in`).  Returns how
        many vectors were solved.  With item embeddings (`set_embeddings`) the same users' real-valued
        vectors are solved again too (one batched implicit-ALS user step), whatever the ranking mode.

        Raises ValueError when ``data`` does not fit the model (users or items out of range)."""
        planes = self._ranks_with_vector() and not self.config.query_planes
        if not planes and self._embeddings is None:
            return 0
        if data.n_users != self.n_users:
            raise ValueError(f"the ratings are for {data.n_users} local users, the model holds {self.n_users}")
        data.check_items(self.n_items)
        targets = self.config.normalize(data.ratings, data.items.size)
        # Each (user, item) once, with its first rating (as `fold_in` and `fit_local` take it), users in order.
        _, first = np.unique(data.users * np.int64(self.n_items) + data.items, return_index=True)
        keep = first[self.user_trained[data.users[first]]]
        if keep.size == 0:
            return 0
        users, counts = np.unique(data.users[keep], return_counts=True)
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        items = data.items[keep]
        if self._embeddings is not None:
            self._solve_user_vectors(users, [items[indptr[k] : indptr[k + 1]] for k in range(users.size)])
        if planes:
            self._set_ranking_vectors(users, indptr, items, targets[keep])
        return int(users.size)

    def _set_ranking_vector(self, userid: int, items: NDArray[np.int64], targets: NDArray[np.float64]) -> None:
        """Symmetric training, asymmetric ranking (``rank_planes`` without ``query_planes``): keep the
        user's ±1 code (what it trains and uploads with) and rank with its vector solved against the item
        codes with ridge ``rank_ridge``·w0·m, as ``rank_planes`` planes.  ``items`` are unique."""
        self._set_ranking_vectors(np.array([userid]), np.array([0, items.size], dtype=np.int64), items, targets)

    def _set_ranking_vectors(
        self,
        users: NDArray[np.int64],
        indptr: NDArray[np.int64],
        items: NDArray[np.int64],
        targets: NDArray[np.float64],
    ) -> None:
        """`_set_ranking_vector` for several users at once: row k of the CSR (``indptr``, ``items``,
        ``targets``, items unique within a row) is user ``users[k]``'s."""
        cfg = self.config
        U = self._ridge_vector(items, targets, cfg.rank_ridge * cfg.unobserved_weight * self.n_items, indptr=indptr)
        q, scale = lightfr.quantize_planes(U, cfg.rank_planes)
        self.user_q[users] = q
        self.user_weight[users] = lightfr.snap_scale(scale, self._weight)[0]

    def _ridge_vector(
        self,
        items: NDArray[np.int64],
        targets: NDArray[np.float64],
        reg: float,
        *,
        indptr: NDArray[np.int64] | None = None,
    ) -> NDArray[np.float64]:
        """The users' exact (n, f) vectors against the item codes (`lightfr.ridge_users`), the catalogue
        entering through the cached item Gram, so O(|Ω|·f² + f³) a user.  One user (n = 1) unless
        ``indptr`` splits ``items`` into rows."""
        cfg = self.config
        G, Db, beta = self.item_gram()
        return lightfr.ridge_users(
            np.array([0, items.size], dtype=np.int64) if indptr is None else indptr,
            np.arange(items.size, dtype=np.int64),
            targets,
            self._item_rows(items),
            beta[items],
            cfg.unobserved_weight,
            cfg.confidence,
            float(reg),
            gram=(G, Db),
        )

    def _solve_vector(
        self, items: NDArray[np.int64], targets: NDArray[np.float64]
    ) -> tuple[NDArray[np.int16], int, NDArray[np.float64]]:
        """Asymmetric scoring: the user's exact vector against the item codes (`lightfr.ridge_users`, the
        catalogue entering through the cached item Gram, so O(|Ω|·f² + f³)): (q, a) of it as the rank
        planes (what the device keeps), and Δ'·q of it as the query planes (what it uploads with)."""
        cfg = self.config
        if cfg.unobserved_weight <= 0:
            raise ModelError("query_planes needs the all-items objective (unobserved_weight > 0)")
        U = self._ridge_vector(items, targets, cfg.user_reg)
        q, scale = lightfr.quantize_planes(U, cfg.query_planes)
        snapped = lightfr.snap_scale(scale, self._weight)[1]
        vec = snapped[0] * q[0].astype(np.float64)
        if cfg.rank_planes:
            q, scale = lightfr.quantize_planes(U, cfg.rank_planes)
        a = lightfr.snap_scale(scale, self._weight)[0]
        return q[0], int(a[0]), vec

    def _set_vector(self, userid: int, q: NDArray[np.int16], a: int) -> None:
        self._set_user(userid, np.where(q > 0, 1, -1).astype(np.int8))  # its sign, for code-only callers
        self.user_q[userid] = q
        self.user_weight[userid] = a

    def reset_user(self, rng: np.random.Generator, *, userid: int = 0) -> None:
        """Draw a fresh random code for a user (LightFR Algorithm 1: clients start from random codes).

        The code stays marked as untrained until `fit_local` or `fold_in` runs.
        """
        check_userid(userid, self.n_users)
        code = random_signs(1, self.config.bits, rng)[0]
        self.user_weight[userid] = 0
        self.user_vector_ok[userid] = False
        self.user_codes[userid] = code
        self._user_words[:, userid] = pack_signs(code[None, :])[:, 0]

    def set_user_code(self, code: ArrayLike, *, userid: int = 0) -> None:
        """Adopt a user code learnt elsewhere (e.g. exported from a simulated run); the user counts as
        trained.  ``code`` is (f,) of ±1."""
        check_userid(userid, self.n_users)
        c = np.asarray(code)
        if c.shape != (self.config.bits,) or not np.all(np.abs(c) == 1):
            raise ValueError(f"a user code is {self.config.bits} values of ±1, got shape {c.shape}")
        self._set_user(userid, c.astype(np.int8))

    def _set_user(self, userid: int, code: NDArray[np.int8]) -> None:
        self.user_weight[userid] = 0  # a ±1 code replaces any bit-plane vector (`_set_vector` sets it after)
        self.user_codes[userid] = code
        self._user_words[:, userid] = pack_signs(code[None, :])[:, 0]
        self.user_trained[userid] = True

    # -- retrieval ------------------------------------------------------------------------------
    def _held_users(self) -> int:
        return self.n_users

    def _check_ready(self, users: NDArray[np.int64]) -> None:
        if not self.user_trained[users].all():
            raise ModelError("this user has no trained code yet: call fit_local or fold_in first")

    def _top_n(
        self,
        users: NDArray[np.int64],
        N: int,
        exclude: list[NDArray[np.int64] | None],
        items: NDArray[np.int64] | None,
        rng: np.random.Generator,
    ) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
        """Hamming top-N (XOR + popcount, counting selection) for all ``users`` in one scan, or in two
        stages (`device_sdk.lightfr_rank`) for the users with a real-valued vector or bit-planes.

        Scores are the integer scores (f − dist)·B + level divided by f·B: without levels, the
        similarity 1 − dist/f in [0, 1] (LightFR eq. 4); each level adds 1/(f·B).  Two-stage users get
        their stage-2 scores (E·u, or the plane score Δ'·qᵀd/f + β).
        """
        two = lightfr_rank.two_stage_rows(self, users)
        if two.all():
            return lightfr_rank.top_n(self, users, N, exclude, items, rng)
        if two.any():
            out_ids = np.full((users.size, N), -1, dtype=np.int64)
            out_scores = np.full((users.size, N), -np.inf, dtype=np.float32)
            for sel in (np.flatnonzero(two), np.flatnonzero(~two)):
                out_ids[sel], out_scores[sel] = self._top_n(users[sel], N, [exclude[i] for i in sel], items, rng)
            return out_ids, out_scores
        if self.config.candidates == 0 and self._embeddings is not None and self.user_vector_ok[users].all():
            return lightfr_rank.top_n_real(self, users, N, exclude, items, rng)
        planes = np.flatnonzero(self.user_weight[users] > 0)
        if planes.size:
            return lightfr_rank.top_n_planes(self, users, planes, N, exclude, items, rng)
        return self._top_n_codes(users, N, exclude, items, rng)

    def _top_one(
        self, user: int, N: int, exclude: NDArray[np.int64] | None, rng: np.random.Generator
    ) -> tuple[NDArray[np.int64], NDArray[np.float32]] | None:
        """`_top_n` of one two-stage user over the whole catalogue, as 1-D arrays (`lightfr_rank.top_one`, the
        same result in fewer calls); None for a user ranked another way."""
        if not lightfr_rank.one_in_two_stages(self, user):
            return None
        return lightfr_rank.top_one(self, user, N, exclude, rng)

    def _top_n_codes(
        self,
        users: NDArray[np.int64],
        N: int,
        exclude: list[NDArray[np.int64] | None],
        items: NDArray[np.int64] | None,
        rng: np.random.Generator,
    ) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
        """The exact Hamming top-N of the users' ±1 codes with the item term (`HammingIndex.search`)."""
        ids, score = self._hamming_index().search(
            np.ascontiguousarray(self._user_words[:, users].T), N, rng, exclude=exclude, candidates=items
        )
        scores = (score / np.float64(self.config.bits * self._weight)).astype(np.float32)
        scores[ids < 0] = -np.inf
        return ids, scores

    def stage1_candidates(
        self,
        user_items: ArrayLike | None = None,
        *,
        userid: int = 0,
        candidates: int | None = None,
        rng: np.random.Generator | None = None,
    ) -> NDArray[np.int64]:
        """The items stage 1 of `recommend` keeps for one user before stage 2 re-scores them (see
        ``LightFRConfig.candidates``): its ``candidates`` (default the config's C) best by Hamming distance
        of its sign code plus the item term, ties at the C-th included (up to 2·C' + 256, C' = C +
        |user_items|), ``user_items`` left out; int64 ids in no particular order.  For measuring stage 1
        (`device_sdk.realvalued.stage1_recall`), whatever the ranking mode.

        Raises ValueError for a userid or item id out of range or ``candidates`` < 1, ModelError for an
        untrained user."""
        check_userid(userid, self.n_users)
        self._check_ready(np.array([userid], dtype=np.int64))
        liked = None if user_items is None else as_items(user_items, self.n_items)
        return lightfr_rank.stage1_of(self, userid, liked, candidates, self.rng if rng is None else rng)

    def similarity(self, item_ids: ArrayLike, *, userid: int = 0) -> NDArray[np.float64]:
        """sim(b_u, d_i) = 1/2 + b_uᵀd_i/(2f) (LightFR eq. 4) for the given items."""
        ids = as_items(item_ids, self.n_items)
        f = self.config.bits
        if self.user_weight[userid] > 0:  # a bit-plane vector: 1/2 + Δ'·qᵀd/(2f)
            delta = 2.0 * self.user_weight[userid] / (2**lightfr.LEVEL_SHIFT * self._weight)
            return 0.5 + delta * (self._item_rows(ids).astype(np.int64) @ self.user_q[userid].astype(np.int64)) / (
                2.0 * f
            )
        dots = self._item_rows(ids).astype(np.int32) @ self.user_codes[userid].astype(np.int32)
        return 0.5 + dots / (2.0 * f)

    # -- persistence ----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the model atomically to one store file (see `device_sdk.store`, `device_sdk.lightfr_store`)."""
        save_model(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, rng: np.random.Generator | None = None) -> LightFRModel:
        """Read a model written by `save`; raises `StorageError` on any problem with the file."""
        return load_model(cls, path, rng=rng)
