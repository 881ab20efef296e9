"""Offline ceiling of asymmetric scoring on amazon-book (validation only): how far binary item codes can go
when the user side is real-valued, or a few ±1 bit-planes, before building anything federated.

    PYTHONPATH=. python benchmarks/asymmetric_ceiling.py        # ~4 min on one core

Validation: `quality_amazon_lightfr.carve_validation` (seeded 20 % of each train user's items), evaluated
on a seeded 20,000-user subsample (full ranking, Recall@20 / NDCG@20, random ties, evaluation seed 0).
Centralised, not federated: implicit ALS f = 64 (regularization 0.1, α = 100, 15 iterations) on the rest, then
(a) sign(ALS users) · sign(ALS items) (symmetric Hamming); (b) real user vectors re-solved by iALS against
D = sign(ALS items); (c) those vectors as 1–4 ±1 planes (per-user scale); (d) alternating: item codes by
exact bit-wise descent against the real users, users re-solved (ALT iterations, ridge DREG).
Measured 2026-11-23 (docs/results/2026-11-quality.md): ALS 0.2018; (a) 0.1072; (b) 0.147; (c) 1/2/3/4 planes
0.120 / 0.140 / 0.146 / 0.146; (d) best after 2 alternations:
real 0.1751, 1/2/3 planes 0.149 / 0.169 / 0.173 (after 4: 0.1732, 0.153 / 0.168 / 0.171).
"""

import json
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np
import scipy.sparse as sp

sys.path.insert(0, ".")
from benchmarks.quality_amazon_lightfr import carve_validation
from fedsim.data.datasets import load_amazon_book
from fedsim.evaluation.als import _half_step, implicit_als
from fedsim.evaluation.ranking import evaluate_all_items, popularity_scorer

t0 = time.time()
data = load_amazon_book()
fit, val = carve_validation(data.train, seed=0)
rng = np.random.default_rng(1)
nu = fit.n_users
has = np.flatnonzero(np.bincount(val.users, minlength=nu))
EVU = np.sort(rng.choice(has, size=min(20000, has.size), replace=False))


def ev(scorer, name):
    r = evaluate_all_items(scorer, fit, val, seed=0, users=EVU)
    print(
        json.dumps(
            {"name": name, "recall@20": round(r.recall, 4), "ndcg@20": round(r.ndcg, 4), "t": round(time.time() - t0)}
        ),
        flush=True,
    )
    return r.recall


ev(popularity_scorer(fit), "popularity")
ALPHA = float(os.environ.get("ALPHA", 100))
REG = 0.1
X, Y = implicit_als(fit, factors=64, reg=REG, alpha=ALPHA, iterations=int(os.environ.get("IT", 15)), seed=0)
ev((X, Y), f"ALS f=64 alpha={ALPHA}")
D = np.where(Y >= 0, 1.0, -1.0)
ev((np.where(X >= 0, 1.0, -1.0), D), "(a) sign(X) . sign(Y)")
keys = np.unique(fit.users * fit.n_items + fit.items)
R = sp.csr_matrix((np.ones(keys.size), (keys // fit.n_items, keys % fit.n_items)), shape=(fit.n_users, fit.n_items))
Rt = R.T.tocsr()


def quant(U, P, clipq=None):
    L = 2**P - 1
    out = np.empty_like(U)
    # per-user scale: rms-based factor grid, pick the one with least error per user
    rms = np.sqrt((U**2).mean(axis=1, keepdims=True)) + 1e-12
    err_best = np.full(U.shape[0], np.inf)
    for c in [1.0] if P == 1 else [0.5, 0.75, 1.0, 1.5, 2.0, 3.0]:
        s = rms * c / max(L / 2, 1) if P > 1 else rms
        q = np.clip(2 * np.floor(U / s / 2) + 1, -L, L)
        # best per-user scale given q (least squares)
        a = (U * q).sum(1, keepdims=True) / (q * q).sum(1, keepdims=True)
        e = ((U - a * q) ** 2).sum(1)
        better = e < err_best
        out[better] = q[better]
        err_best[better] = e[better]
    return out


for reg in [0.1, 3.0, 30.0]:
    for _scale in [1.0]:
        U = _half_step(R, D, ALPHA, reg)
        ev((U, D), f"(b) real U re-solved vs sign(Y), reg={reg}")
        for P in [1, 2, 3, 4]:
            ev((quant(U, P), D), f"(c) U {P} planes vs sign(Y), reg={reg}")


# (d) alternate: binary items by DCD against real users, users re-solved
def item_dcd(U, D, alpha, sweeps=3, chunk=1500):
    G = U.T @ U
    D = D.copy()
    m, f = D.shape
    for s0 in range(0, m, chunk):
        idx = np.arange(s0, min(m, s0 + chunk))
        A = np.broadcast_to(G, (idx.size, f, f)).copy()
        deg = np.diff(Rt.indptr)[idx]
        L = int(deg.max()) if idx.size else 0
        pos = Rt.indptr[idx][:, None] + np.arange(L)[None, :]
        live = np.arange(L)[None, :] < deg[:, None]
        P_ = U[Rt.indices[np.where(live, pos, 0)]] * live[..., None]
        A += alpha * np.matmul(P_.transpose(0, 2, 1), P_)
        b = (1 + alpha) * P_.sum(1)
        d = D[idx]
        Ad = np.einsum("nij,nj->ni", A, d)
        diag = np.einsum("nii->ni", A)
        for _ in range(sweeps):
            fl = 0
            for k in range(f):
                z = Ad[:, k] - diag[:, k] * d[:, k] - b[:, k]
                new = np.where(z < 0, 1.0, np.where(z > 0, -1.0, d[:, k]))
                delta = new - d[:, k]
                nz = np.flatnonzero(delta)
                if nz.size:
                    fl += nz.size
                    d[nz, k] = new[nz]
                    Ad[nz] += delta[nz, None] * A[nz, :, k]
            if fl == 0:
                break
        D[idx] = d
    return D


reg = float(os.environ.get("DREG", 3.0))
Dc = D.copy()
for it in range(int(os.environ.get("ALT", 4))):
    U = _half_step(R, Dc, ALPHA, reg)
    Dn = item_dcd(U, Dc, ALPHA)
    print("flips", int((Dn != Dc).sum()), flush=True)
    Dc = Dn
    U = _half_step(R, Dc, ALPHA, reg)
    ev((U, Dc), f"(d) alt it{it + 1}: real U vs trained binary D, reg={reg}")
    for P in [1, 2, 3]:
        ev((quant(U, P), Dc), f"(d) alt it{it + 1}: U {P} planes")
