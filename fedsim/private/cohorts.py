"""Every device of a dataset at once, for the scale mode of the private-round simulator
(`fedsim.private.simulator.PrivateSimulator.run_scaled_round`).

A cohort holds each simulated device's private state (LightFR user codes and vectors, MF user vectors),
its ratings, and whether it has trained; `quantized_sum` runs one round of every cohort device and
returns Σ over the survivors of their quantized uploads as signed integers — the value secure
aggregation releases before the noise.  The device math is `device_sdk`'s: the per-device kernels
(`device_sdk.lightfr`, `device_sdk.mf`) and their batched form (`device_sdk.batched`: per-device update
layout, clipping, stochastic rounding, the all-items parts); what is here is the simulation's own part:
slicing the cohort into batches, one generator and one coin stream for the whole cohort (or, for MF,
each device's own, the test hook), and keeping each device's state between rounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from device_sdk import batched
from protocol.errors import ConfigError
from protocol.families.lightfr import UploadLayout
from protocol.messages import RoundInvite
from protocol.plan import LightFRParams, MFParams
from protocol.samplers import NoiseStream

__all__ = ["DeviceDraws", "LightFRCohort", "MFCohort", "cohort_rows"]


#: A device's training generator and noise stream (`device_sdk.client.insecure_seeded_rngs`).
DeviceDraws = Mapping[int, tuple[np.random.Generator, NoiseStream]]


def cohort_rows(
    index: Mapping[int, int], cohort: Iterable[int], survivors: Iterable[int]
) -> tuple[NDArray[np.bool_], NDArray[np.int64]]:
    """(whether each held device survives, the cohort's rows sorted) of a round; ``index`` maps every held
    device's id to its row."""
    alive = np.zeros(len(index), dtype=bool)
    alive[[index[d] for d in survivors]] = True
    return alive, np.array(sorted(index[d] for d in cohort), dtype=np.int64)


class MFCohort:
    """Every MF device of a dataset at once, for `PrivateSimulator.run_scaled_round`.

    Holds each device's private user vector u (``user_factors``) and its ratings, and runs one round of
    every device's `device_sdk.mf.MFModel.local_update` in batches with the device's own kernels
    (`fit_users`, `initial_factors`, `trim_per_user`, `sample_negatives`): stage 1 for a device seen for
    the first time, ``local_epochs`` steps on u against the downloaded V (projected with Π, as
    `MFModel.set_global` does), θ ratings kept, negatives drawn, then the V-gradient of the kept
    examples.  A device's dense (m·f,) upload is non-zero only on the rows of its kept and negative
    items, so only those rows are built: each device's rows are clipped with
    `protocol.quantization.clip_l2` and rounded with the formula of `stochastic_round`, and the
    survivors' rounded rows are summed sparsely.  The zero coordinates a device also uploads round to
    0 whatever their coins, so the sum is the one the devices' dense uploads give.

    Two sources of randomness:

    * one training generator and one coin stream for the whole cohort (the scale mode): the same
      law as the devices' draws, other words;
    * ``device_draws`` (``{device_id: (training generator, noise stream)}``, the test hook
      `insecure_seeded_rngs` of every device): each device draws exactly what its `local_update`
      draws, and its coins are words ``item·f + j`` of its stream, which is left after the m·f coin
      words of a device's `quantize`, where the device's DP noise starts.  The sum is then the devices'
      `local_round` sum bit for bit, up to one floating-point difference: a device's norm is summed over
      its non-zero coordinates rather than over the dense vector, which can move the clip factor by an
      ulp, and a rounded value changes only if a coin falls within that ulp of its threshold.

    Parameters
    ----------
    users : for each device (one user), its rated item ids and raw ratings (None: implicit, fitted as 1).
    n_items, factors : model shape (m, f).
    max_norm2 : R of the embedding clipping (must equal the round plan's).
    init_scale : a new user vector is Π(init_scale · Uniform[0, 1)) (`MFConfig.init_scale`).
    batch : devices per vectorised batch.
    """

    def __init__(
        self,
        users: Sequence[tuple[NDArray[np.int64], NDArray[np.float64] | None]],
        n_items: int,
        factors: int,
        *,
        max_norm2: float = 5.0,
        init_scale: float = 0.1,
        batch: int = 8192,
        first_id: int = 1,
    ) -> None:
        if n_items <= 0 or factors <= 0:
            raise ConfigError(f"need n_items > 0 and factors > 0, got {n_items}, {factors}")
        if not (math.isfinite(max_norm2) and max_norm2 > 0):
            raise ConfigError(f"max_norm2 must be finite and > 0, got {max_norm2}")
        self.n_items, self.factors, self.max_norm2 = int(n_items), int(factors), float(max_norm2)
        self.init_scale = float(init_scale)
        self.device_ids = list(range(first_id, first_id + len(users)))
        self._index = {d: i for i, d in enumerate(self.device_ids)}
        lengths = np.array([np.asarray(u[0]).size for u in users], dtype=np.int64)
        self.indptr = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        self.items = (
            np.concatenate([np.asarray(u[0], dtype=np.int64).ravel() for u in users])
            if users
            else np.zeros(0, np.int64)
        )
        if self.items.size and (self.items.min() < 0 or self.items.max() >= n_items):
            raise ConfigError(f"an item id is outside [0, {n_items})")
        self.targets = (
            np.concatenate(
                [np.ones(np.asarray(i).size) if r is None else np.asarray(r, np.float64).ravel() for i, r in users]
            )
            if users
            else np.zeros(0)
        )
        if self.targets.shape != self.items.shape:
            raise ConfigError("every device needs one rating per rated item (or None)")
        if self.targets.size and not (
            np.all(np.isfinite(self.targets)) and self.targets.min() >= 0 and self.targets.max() <= max_norm2
        ):
            # Outside [0, R] the per-example gradient bound 2R^{3/2} would not hold (`device_sdk.mf`).
            raise ConfigError(f"ratings must be finite and lie in [0, R] = [0, {max_norm2}]")
        self.user_factors = np.zeros((len(users), factors))
        self.trained = np.zeros(len(users), dtype=bool)
        self.batch = int(batch)

    def _gen(self, draws: DeviceDraws, row: np.integer | int) -> np.random.Generator:
        return draws[self.device_ids[int(row)]][0]

    def quantized_sum(
        self,
        V: NDArray[np.float64],
        invite: RoundInvite,
        cohort: Iterable[int],
        survivors: Iterable[int],
        rng: np.random.Generator,
        coins: NoiseStream,
        *,
        device_draws: DeviceDraws | None = None,
    ) -> NDArray[np.int64]:
        """Train every cohort device for one round against the item matrix ``V``; return Σ over
        ``survivors`` of their quantized uploads as signed integers (length m·f).  ``rng`` and ``coins``
        are the cohort's generator and coin stream; ``device_draws`` replaces both by each device's own
        (see the class)."""
        from protocol.families.mf import project_rows

        p = invite.plan.params
        if not isinstance(p, MFParams):
            raise ConfigError(f"an MF cohort needs an MF plan, got {type(p).__name__}")
        R = float(p.max_norm2)
        if R != self.max_norm2:
            raise ConfigError(f"the round's max_norm2 {R} differs from the cohort's {self.max_norm2}")
        m, f = self.n_items, self.factors
        if int(invite.vector_length) != m * f:
            raise ConfigError(f"the round expects {invite.vector_length} values, an MF upload has {m * f}")
        Vd = project_rows(np.asarray(V, dtype=np.float64).reshape(m, f), R)  # as the device's set_global
        qcfg = invite.quantization()
        alive, rows_all = cohort_rows(self._index, cohort, survivors)
        total = np.zeros(m * f, dtype=np.int64)
        for lo in range(0, rows_all.size, self.batch):
            rows = rows_all[lo : lo + self.batch]
            U, examples = self._train(rows, Vd, p, int(invite.example_cap), rng, device_draws)
            # The V-gradient rows, summed per (device, item) in example order (`item_gradient_sum`).
            owner, item, vals = batched.mf_gradient_rows(*examples, U, Vd)
            streams = None if device_draws is None else [device_draws[self.device_ids[int(r)]][1] for r in rows]
            batched.add_rounded_rows(total, owner, item, vals, alive[rows], qcfg, coins, streams=streams)
        return total

    def _train(
        self,
        rows: NDArray[np.int64],
        Vd: NDArray[np.float64],
        p: MFParams,
        cap: int,
        rng: np.random.Generator,
        device_draws: DeviceDraws | None,
    ) -> tuple[NDArray[np.float64], tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64]]]:
        """One batch of devices' `MFModel.local_update` up to the upload: their new user vectors (kept), and
        their examples (owner, item, rating) in each device's order (kept ratings, then negatives at 0)."""
        from device_sdk.mf import fit_users, initial_factors, trim_per_user

        f, R = self.factors, self.max_norm2
        lr, reg, neg = float(p.learning_rate), float(p.reg), int(p.negatives)
        counts = self.indptr[rows + 1] - self.indptr[rows]
        owner = np.repeat(np.arange(rows.size), counts)
        first = np.cumsum(counts) - counts
        take = np.arange(owner.size) - first[owner] + self.indptr[rows][owner]
        items, r = self.items[take], self.targets[take]
        U = self.user_factors[rows]
        # Stage 1 for devices seen for the first time (with ratings): a fresh small u, then pre-training.
        new = np.flatnonzero(~self.trained[rows] & (counts > 0))
        if new.size:
            if device_draws is None:
                U[new] = initial_factors(new.size, f, R, self.init_scale, rng)
            else:
                for jn in new.tolist():
                    U[jn] = initial_factors(1, f, R, self.init_scale, self._gen(device_draws, rows[jn]))[0]
            is_new = np.zeros(rows.size, dtype=bool)
            is_new[new] = True
            sel = is_new[owner]
            U = fit_users(U, Vd, owner[sel], items[sel], r[sel], lr, reg, R, int(p.pretrain_epochs))
            self.trained[rows[new]] = True
        U = fit_users(U, Vd, owner, items, r, lr, reg, R, int(p.local_epochs))
        self.user_factors[rows] = U
        # θ ratings per device (trimming keys are drawn for every rating, as the device draws them).
        if device_draws is None:
            keep = trim_per_user(owner, cap, rng)
        else:
            keep = np.concatenate(
                [np.zeros(0, np.int64)]
                + [
                    trim_per_user(np.zeros(int(counts[j]), np.int64), cap, self._gen(device_draws, rows[j])) + first[j]
                    for j in range(rows.size)
                ]
            )
        ku, ki, kr = owner[keep], items[keep], r[keep]
        if neg > 0 and ku.size:
            nu, ni = self._negatives(rows, ku, owner, items, counts, first, neg, rng, device_draws)
            # Each device's negatives after its kept ratings (the device's example order).
            ku, ki, kr = np.r_[ku, nu], np.r_[ki, ni], np.r_[kr, np.zeros(nu.size)]
            order = np.argsort(ku, kind="stable")
            ku, ki, kr = ku[order], ki[order], kr[order]
        return U, (ku, ki, kr)

    def _negatives(
        self,
        rows: NDArray[np.int64],
        ku: NDArray[np.int64],
        owner: NDArray[np.int64],
        items: NDArray[np.int64],
        counts: NDArray[np.int64],
        first: NDArray[np.int64],
        neg: int,
        rng: np.random.Generator,
        device_draws: DeviceDraws | None,
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """``neg`` negatives per kept rating: (owner, item)."""
        from device_sdk.mf import sample_negatives

        m = self.n_items
        if device_draws is None:
            return sample_negatives(np.repeat(ku, neg), owner, items, m, rng)
        parts = []  # a device with kept ratings draws its negatives after its trimming keys
        kc = np.bincount(ku, minlength=rows.size)
        for jk in np.flatnonzero(kc).tolist():
            g = self._gen(device_draws, rows[jk])
            own = items[first[jk] : first[jk] + counts[jk]]
            _, nj = sample_negatives(np.zeros(int(kc[jk]) * neg, np.int64), np.zeros(own.size, np.int64), own, m, g)
            parts.append((np.full(nj.size, jk), nj))
        nu = np.concatenate([a for a, _ in parts]).astype(np.int64)
        ni = np.concatenate([b for _, b in parts]).astype(np.int64)
        return nu, ni


class LightFRCohort:
    """Every LightFR device of a dataset at once, for `PrivateSimulator.run_scaled_round`.

    Holds each device's private user code b_u (``codes``, (n, f) ±1) and its ratings, and runs one
    round of every device's local work in batches with the device's own kernels
    (`device_sdk.lightfr.sample_negatives`, `dcd_update`, `inner_products`): θ ratings kept at
    random, negatives sampled, DCD sweeps, then the eq. 12 item gradient of the kept and sampled
    items only — the upload's non-zero part.  Each device's part is clipped with
    `protocol.quantization.clip_l2` and rounded with `protocol.quantization.stochastic_round`.

    Parameters
    ----------
    users : for each device (one user), its rated item ids and raw ratings (or None).
    n_items, bits : model shape.
    rating_range : raw rating range, None for implicit feedback.
    batch : devices per vectorised batch (memory: batch × entries × f floats).
    """

    def __init__(
        self,
        users: Sequence[tuple[NDArray[np.int64], NDArray[np.float64] | None]],
        n_items: int,
        bits: int,
        *,
        rating_range: tuple[float, float] | None = None,
        binary_positives: bool = True,
        batch: int = 4096,
        first_id: int = 1,
    ) -> None:
        from device_sdk.models import LightFRConfig

        self.n_items, self.bits = int(n_items), int(bits)
        self.device_ids = list(range(first_id, first_id + len(users)))
        self._index = {d: i for i, d in enumerate(self.device_ids)}
        self._cfg = LightFRConfig(bits=bits, rating_range=rating_range, binary_positives=binary_positives)
        lengths = np.array([np.asarray(u[0]).size for u in users], dtype=np.int64)
        self.indptr = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        self.items = (
            np.concatenate([np.asarray(u[0], dtype=np.int64) for u in users]) if users else np.zeros(0, np.int64)
        )
        self.targets = np.concatenate(
            [self._cfg.normalize(None if r is None else np.asarray(r, float), np.asarray(i).size) for i, r in users]
        )
        self.codes = np.ones((len(users), bits), dtype=np.int8)
        #: Each device's snapped real vector Δ'·q under asymmetric scoring (protocol 1.6); zeros otherwise.
        self.vectors = np.zeros((len(users), bits))
        self.trained = np.zeros(len(users), dtype=bool)
        self.batch = int(batch)

    def quantized_sum(
        self,
        D: NDArray[np.int8],
        invite: RoundInvite,
        cohort: Iterable[int],
        survivors: Iterable[int],
        rng: np.random.Generator,
        coins: NoiseStream,
        beta: NDArray[np.float64] | None = None,
        hamming_weight: int = 1,
    ) -> NDArray[np.int64]:
        """Train every cohort device for one round; return Σ over ``survivors`` of the quantized
        uploads as signed integers (the invite's upload length).  ``rng`` drives training, ``coins`` the
        stochastic rounding (of the non-zero part of each upload: same law as a device's dense rounding,
        other words).  Under the all-items objective ``D`` is the (m, f) item codes, ``beta`` the item
        biases the downloaded levels stand for and ``hamming_weight`` the downloaded B (`_full_sum`)."""
        from protocol.spec import Aggregation

        p = _lightfr_params(invite)
        if p.aggregation is not Aggregation.GRAD:
            raise ConfigError("the scaled LightFR simulation runs Agg_grad uploads only")
        if p.unobserved_weight > 0:
            if beta is None:
                raise ConfigError("the all-items objective needs the item biases the devices download (beta=)")
            return self._full_sum(D, beta, invite, cohort, survivors, rng, coins, hamming_weight)
        qcfg = invite.quantization()
        alive, rows_all = cohort_rows(self._index, cohort, survivors)
        total = np.zeros(self.n_items * self.bits, dtype=np.int64)
        self._start_codes(rows_all, rng)
        for lo in range(0, rows_all.size, self.batch):
            rows = rows_all[lo : lo + self.batch]
            owner, item, vals = self._gradients(rows, D, invite, rng)
            batched.add_rounded_rows(total, owner, item, vals, alive[rows], qcfg, coins)
        return total

    def _start_codes(self, rows: NDArray[np.int64], rng: np.random.Generator) -> None:
        fresh = rows[~self.trained[rows]]
        if fresh.size:  # a device's first round starts from a random code
            self.codes[fresh] = np.where(rng.random((fresh.size, self.bits)) < 0.5, -1, 1).astype(np.int8)

    def _rows(self, rows: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64]]:
        """(indptr, items, targets) of the devices ``rows``."""
        counts = self.indptr[rows + 1] - self.indptr[rows]
        take = np.concatenate([np.arange(self.indptr[r], self.indptr[r + 1]) for r in rows])
        return batched.csr_indptr(counts), self.items[take], self.targets[take]

    def _gradients(
        self, rows: NDArray[np.int64], D: NDArray[np.int8], invite: RoundInvite, rng: np.random.Generator
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64]]:
        """One batch of devices' local rounds (θ cap, then per epoch negatives, DCD and the eq. 12 rows);
        their codes are kept and their sparse uploads returned (`device_sdk.batched.device_item_sums`)."""
        from device_sdk.lightfr import dcd_update, sample_negatives

        p = _lightfr_params(invite)
        m, epochs = self.n_items, int(p.local_epochs)
        indptr, items, targets, _ = batched.cap_examples(*self._rows(rows), int(invite.example_cap), rng)
        B = self.codes[rows]
        parts: list[tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64]]] = []
        for _ in range(epochs):
            eo, ei, er = indptr, items, targets
            if p.negatives:
                neg_ptr, neg = sample_negatives(indptr, items, m, int(p.negatives), rng)
                eo, ei, er = batched.merge_negatives(indptr, items, targets, neg_ptr, neg)
            B, _ = dcd_update(eo, ei, er, B, D, float(p.lam), max_sweeps=int(p.max_sweeps))
            parts.append(batched.entry_gradients(eo, ei, er, B, D))
        self.codes[rows] = B
        self.trained[rows] = True
        g_items, g_owner, g_rows = (np.concatenate(x) for x in zip(*parts, strict=True))
        return batched.device_item_sums(g_owner, g_items, g_rows, m, epochs)

    def _full_sum(
        self,
        D: NDArray[np.int8],
        beta: NDArray[np.float64],
        invite: RoundInvite,
        cohort: Iterable[int],
        survivors: Iterable[int],
        rng: np.random.Generator,
        coins: NoiseStream,
        hamming_weight: int = 1,
    ) -> NDArray[np.int64]:
        """`quantized_sum` under the all-items objective (``invite.params.unobserved_weight > 0``).

        Per device, as `device_sdk.models.LightFRModel` does: the θ cap, ``local_epochs`` of
        `device_sdk.lightfr.dcd_full` against the codes and biases, then the parts of
        `device_sdk.lightfr.full_upload` one device at a time — a row (w_q s/f − w_l)·b − (w_q/f)·d_i and
        a bias term c·t − w_q s/f per kept item, a count of 1 per kept item, b bᵀ/f and b/f — clipped as
        `protocol.families.lightfr.clip_parts` clips them (the counts to √s·C and the rest to
        √(1 − s)·C for a counts share s > 0; the whole to C otherwise; each part's norm is known in closed
        form: ‖b bᵀ‖/f = 1, ‖b‖/f = 1/√f) and stochastically rounded.  Batched: the Python loops run over
        batches and bits, never over devices.

        With ``invite.params.query_planes`` P >= 1 (asymmetric scoring, protocol 1.6) each device instead solves
        its vector exactly against the codes (`device_sdk.lightfr.ridge_users`, ridge ``invite.params.user_reg``),
        snaps it to P bit-planes and an integer weight for B = ``hamming_weight`` (`quantize_planes`,
        `snap_scale`), keeps it in ``vectors`` and uploads the same parts with the vector u in place of b:
        rows (w_q s/f − w_l)·u − (w_q/f)·u∘u∘d_i, and u uᵀ/f, u/f, whose norms are ‖u‖²/f and ‖u‖/f.
        """
        m, f = self.n_items, self.bits
        p = _lightfr_params(invite)
        w0, alpha = float(p.unobserved_weight), float(p.confidence)
        Df = D.astype(np.float64)
        gram = (Df.T @ Df, Df.T @ beta)  # G_D and Dᵀβ, once per model version (as a device caches them)
        alive, rows_all = cohort_rows(self._index, cohort, survivors)
        self._start_codes(rows_all, rng)
        parts = {"gradient": np.zeros(m * f), "bias": np.zeros(m), "counts": np.zeros(m)}
        parts |= {"gram": np.zeros((f, f)), "code_sum": np.zeros(f)}
        for lo in range(0, rows_all.size, self.batch):
            rows = rows_all[lo : lo + self.batch]
            indptr, items, targets, owner = batched.cap_examples(*self._rows(rows), int(invite.example_cap), rng)
            indptr, items, targets, owner = batched.unique_examples(items, targets, owner, rows.size, m)
            Bf, s_e = self._train_full(rows, indptr, items, targets, D, beta, gram, invite, hamming_weight)
            self.trained[rows] = True
            real = bool(p.query_planes)
            grad, bias = batched.full_entry_terms(items, owner, targets, Bf, Df, s_e, beta, w0, alpha, real=real)
            factors = batched.full_clip_factors(owner, grad, bias, Bf, float(invite.clip_norm), float(p.counts_share))
            scale = float(2**invite.scale_bits)
            batched.add_rounded_full_parts(parts, items, owner, grad, bias, Bf, factors, alive[rows], scale, coins)
        # The rounded parts in the layout's order (already per 1/f: not `UploadLayout.join`, which scales).
        total = np.rint(np.concatenate([p.ravel() for p in parts.values()])).astype(np.int64)
        assert total.size == UploadLayout(m, f, full=True).length
        return total

    def _train_full(
        self,
        rows: NDArray[np.int64],
        indptr: NDArray[np.int64],
        items: NDArray[np.int64],
        targets: NDArray[np.float64],
        D: NDArray[np.int8],
        beta: NDArray[np.float64],
        gram: tuple[NDArray[np.float64], NDArray[np.float64]],
        invite: RoundInvite,
        hamming_weight: int,
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """One batch of devices' training under the all-items objective (`dcd_full` epochs, or under query
        planes the snapped ridge vector); their codes (and vectors) are kept.  Returns (their b or u
        (batch, f) float, s = bᵀd_i per kept entry)."""
        from device_sdk.lightfr import dcd_full, inner_products, quantize_planes, ridge_users, snap_scale

        p = _lightfr_params(invite)
        w0, alpha = float(p.unobserved_weight), float(p.confidence)
        planes = int(p.query_planes)
        if planes:
            U = ridge_users(indptr, items, targets, D, beta, w0, alpha, float(p.user_reg), gram=gram)
            odd, step = quantize_planes(U, planes)
            _, snapped = snap_scale(step, hamming_weight)
            Bf = snapped[:, None] * odd.astype(np.float64)
            self.vectors[rows] = Bf
            self.codes[rows] = np.where(odd > 0, 1, -1).astype(np.int8)
            owner = np.repeat(np.arange(rows.size), np.diff(indptr))
            return Bf, np.einsum("ef,ef->e", D[items].astype(np.float64), Bf[owner])
        B = self.codes[rows]
        for _ in range(int(p.local_epochs)):
            B, _ = dcd_full(indptr, items, targets, B, D, beta, w0, alpha, max_sweeps=int(p.max_sweeps), gram=gram)
        self.codes[rows] = B
        return B.astype(np.float64), inner_products(indptr, items, B, D).astype(np.float64)


def _lightfr_params(invite: RoundInvite) -> LightFRParams:
    """The LightFR training parameters an invite of the scaled LightFR simulation carries."""
    if not isinstance(invite.params, LightFRParams):
        raise ConfigError(f"the scaled LightFR simulation needs a LightFR plan, got {invite.params!r}")
    return invite.params
