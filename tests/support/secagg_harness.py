# Invariants: deterministic given (inputs, schedule, parameters, seed): every np.random.Generator (graph
# placement, quantization coins) is spawned from one SeedSequence and the DP noise and thinning coins come
# from `insecure_test_noise_stream(seed, round, device)`, so the same seed and schedule give a bit-identical
# sum (and the DP noise of such a run is predictable: a test harness, not a privacy guarantee).  Key
# material still comes from the OS CSPRNG (it never affects the sum: masks cancel).  Messages travel
# through the real codec unless ``wire=False``.  Inputs are produced and handed to a device only when it
# builds its masked input, so at most one plaintext vector is alive.
"""In-process SecAgg+ round for tests and benchmarks: n device sessions and one server session, no I/O."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from protocol.codec import decode, encode
from protocol.errors import FedRecError
from protocol.graph import GraphParams, find_parameters
from protocol.identity import SigningKey, issue_certificate
from protocol.messages import Abort, ConsistencySignature, Message, UnmaskResponse
from protocol.noise import SkellamDraw, colluding_devices, minimum_survivors, to_ring
from protocol.phases import consistency_deadline
from protocol.quantization import QuantizationConfig, quantize
from protocol.samplers import NoiseStream, insecure_test_noise_stream
from protocol.session import (
    ACTIVE_PHASES,
    DeviceSecAggSession,
    Phase,
    RoundParameters,
    ServerSecAggSession,
)

__all__ = ["HarnessResult", "SilentDevice", "run_secagg_round"]


class SilentDevice(DeviceSecAggSession):
    """A colluding device: it runs the protocol faithfully but adds no DP noise (so it keeps and reveals
    none), leaving the honest survivors' noise to protect the sum."""

    def _draw_noise(self) -> SkellamDraw:
        zeros = np.zeros(self.invite.vector_length, dtype=np.int64)
        return SkellamDraw(zeros, zeros.copy())


InputSource = Sequence[NDArray[np.generic]] | Callable[[int], NDArray[np.generic]]


@dataclass(slots=True)
class HarnessResult:
    """What one simulated round produced.

    Attributes
    ----------
    total : ndarray of uint32 or None
        The server's unmasked sum, None when the round aborted.
    expected : ndarray of uint32
        Σ_{u ∈ U3} (q(x_u) + kept noise_u) mod 2**32, computed in the clear for comparison.
    kept_noise : ndarray of int64
        Σ_{u ∈ U3} kept noise_u (signed).
    survivors : frozenset of int
        U3 (empty when the round aborted before MASKED_INPUT closed).
    dropouts : mapping of Phase to frozenset of int
        Per-phase dropouts as the server saw them.
    error : FedRecError or None
        Why the round aborted.
    params : GraphParams
        The k and t used.
    dp_t_min : int
        t_min used for the DP noise (0 without DP).
    shares_received : Counter of (str, int)
        ("b" | "s", owner id) → number of shares of that owner's secret the server received.
    upload_bytes : Counter of str
        Encoded bytes uploaded by devices, per message type.
    download_bytes : Counter of str
        Encoded bytes the server sent devices, per message type.
    device_seconds : dict of int to float
        Per-device time inside its session (crypto, masking, noise), when a clock was given.
    server_unmask_seconds : float
        Server time spent in the UNMASK phase (share parsing, reconstruction, mask removal).
    """

    total: NDArray[np.uint32] | None
    expected: NDArray[np.uint32]
    kept_noise: NDArray[np.int64]
    survivors: frozenset[int]
    dropouts: Mapping[Phase, frozenset[int]]
    error: FedRecError | None
    params: GraphParams
    dp_t_min: int
    shares_received: Counter[tuple[str, int]] = field(default_factory=Counter)
    upload_bytes: Counter[str] = field(default_factory=Counter)
    download_bytes: Counter[str] = field(default_factory=Counter)
    device_seconds: dict[int, float] = field(default_factory=dict)
    server_unmask_seconds: float = 0.0


def run_secagg_round(
    inputs: InputSource,
    *,
    n: int | None = None,
    dropouts: Mapping[Phase, Iterable[int]] | None = None,
    k: int | None = None,
    t: int | None = None,
    dropout_rate: float = 0.33,
    adversary_rate: float = 0.05,
    quantization: QuantizationConfig | None = None,
    dp_mu: float = 0.0,
    seed: int = 0,
    round_id: int = 1,
    device_ids: Sequence[int] | None = None,
    wire: bool = True,
    clock: Callable[[], float] | None = None,
    signed: bool = False,
    consistency_dropouts: Iterable[int] = (),
    silent: Iterable[int] = (),
    dp_colluders: int | None = None,
) -> HarnessResult:
    """Run one SecAgg+ round in process.

    Parameters
    ----------
    inputs : sequence of arrays, or callable index -> array
        Per-device updates: uint32 ring vectors, or float vectors when ``quantization`` is given.
    n : int, optional
        Cohort size; required when ``inputs`` is a callable.
    dropouts : mapping of Phase to ids
        ``{phase: ids}``: devices that drop before sending their message of that phase.
    k, t : int, optional
        Graph neighbourhood size and threshold; both None → `find_parameters(n, dropout_rate,
        adversary_rate)`.
    dropout_rate, adversary_rate : float
        ω and γ for the finder, and ω for the DP t_min.
    quantization : QuantizationConfig, optional
        Quantize float inputs with stochastic rounding (coins from the device's generator).
    dp_mu : float
        Aggregate Skellam variance μ (0 = no DP).
    seed : int
        Root seed of every generator.
    round_id : int
        Round id.
    device_ids : sequence of int, optional
        Ids of the devices (default ``0..n-1``).
    wire : bool
        Encode and decode every message through the codec.
    clock : callable, optional
        Monotonic clock (e.g. ``time.perf_counter``) to time devices and the server's unmasking.
    signed : bool
        Protocol 1.3: every device is enrolled with an Ed25519 identity certified by a fresh enrollment
        authority, key advertisements are signed and UNMASK starts with the consistency check (the
        server's time for it counts as unmasking time).
    consistency_dropouts : ids
        With ``signed``: devices that drop before signing the survivor set.
    silent : ids
        Colluding devices that follow the protocol but add no DP noise (`SilentDevice`).
    dp_colluders : int, optional
        f of the noise calibration (the invite's ``dp_colluders``); default ⌊γ n⌋ with DP, 0 without.

    Returns
    -------
    HarnessResult
    """
    if callable(inputs):
        if n is None:
            raise ValueError("n is required when inputs is a callable")
        get_input = inputs
    else:
        n = len(inputs) if n is None else n
        if n != len(inputs):
            raise ValueError("n does not match len(inputs)")
        seq = inputs

        def get_input(i: int) -> NDArray[np.generic]:
            return np.asarray(seq[i])

    ids = list(range(n)) if device_ids is None else [int(i) for i in device_ids]
    if len(ids) != n:
        raise ValueError("device_ids must have n entries")
    graph = find_parameters(n, dropout_rate, adversary_rate) if k is None and t is None else None
    if graph is None:
        if k is None or t is None:
            raise ValueError("give both k and t, or neither")
        graph = GraphParams(k=k, t=t)
    dp_t_min = minimum_survivors(n, dropout_rate) if dp_mu > 0 else 0
    if dp_colluders is None:
        dp_colluders = colluding_devices(n, adversary_rate) if dp_mu > 0 else 0
    quiet = set(silent)
    authority = SigningKey.generate() if signed else None
    enrolled: dict[int, tuple[SigningKey, bytes]] = {}
    if authority is not None:
        for u in ids:
            key = SigningKey.generate()
            enrolled[u] = (key, issue_certificate(authority, key.public_key))
    schedule = {p: set(dropouts.get(p, ())) if dropouts else set() for p in ACTIVE_PHASES}
    length = int(get_input(0).shape[0])
    clip, scale = (quantization.clip_norm, quantization.scale_bits) if quantization else (1.0, 16)
    params = RoundParameters(
        round_id=round_id,
        vector_length=length,
        k=graph.k,
        t=graph.t,
        clip_norm=float(clip),
        scale_bits=scale,
        dp_mu=float(dp_mu),
        dp_t_min=dp_t_min,
        dp_colluders=dp_colluders,
        deadlines=(1.0, 2.0, 3.0, 4.0),
        authority_key=authority.public_key if authority is not None else b"",
    )
    root = np.random.SeedSequence(seed)
    graph_seq = root.spawn(1)[0]
    identities = {u: key.public_key for u, (key, _) in enrolled.items()} if enrolled else None
    server = ServerSecAggSession(params, ids, rng=np.random.default_rng(graph_seq), identities=identities)
    tick = clock or (lambda: 0.0)

    upload: Counter[str] = Counter()
    download: Counter[str] = Counter()
    shares: Counter[tuple[str, int]] = Counter()
    device_seconds = dict.fromkeys(ids, 0.0)
    unmask_seconds = 0.0

    def carry(message: Message) -> Message:
        if not wire:
            return message
        raw = encode(message)
        download[type(message).__name__] += len(raw)
        return decode(raw)

    def upload_to_server(u: int, message: Message) -> None:
        nonlocal unmask_seconds
        if wire:
            raw = encode(message)
            upload[type(message).__name__] += len(raw)
            message = decode(raw)
        if isinstance(message, UnmaskResponse):
            for owner in message.b_share_ids:
                shares[("b", owner)] += 1
            for owner in message.s_share_ids:
                shares[("s", owner)] += 1
        start = tick()
        server.receive(u, message)
        if server.phase in (Phase.UNMASK, Phase.DONE) and isinstance(message, UnmaskResponse | ConsistencySignature):
            unmask_seconds += tick() - start

    devices: dict[int, DeviceSecAggSession] = {}
    streams: dict[int, NoiseStream] = {}  # each device's noise stream: rounding coins, then DP noise
    gone: set[int] = set()
    plain = np.zeros(length, dtype=np.uint32)
    steps = [(index, phase, False) for index, phase in enumerate(ACTIVE_PHASES)]
    if signed:
        steps.insert(3, (3, Phase.UNMASK, True))  # the consistency check opens UNMASK
    sign_drops = set(consistency_dropouts)
    for index, phase, signing in steps:
        if server.phase is not phase:
            break
        for i, u in enumerate(ids):
            if u in gone:
                continue
            incoming = server.outbox(u)
            if isinstance(incoming, Abort):
                gone.add(u)
                continue
            if incoming is None:  # pragma: no cover - only after DONE
                continue
            start = tick()
            if phase is Phase.ADVERTISE_KEYS:
                noise = insecure_test_noise_stream(seed, round_id, u)  # reproducible runs; not a DP guarantee
                streams[u] = noise
                identity, certificate = enrolled.get(u, (None, b""))
                devices[u] = (SilentDevice if u in quiet else DeviceSecAggSession)(
                    carry(incoming),  # type: ignore[arg-type]
                    rng=noise,
                    identity=identity,
                    certificate=certificate,
                    authority_key=None if authority is None else authority.public_key,
                )
            else:
                devices[u].receive(carry(incoming))
            device_seconds[u] += tick() - start
            if u in (sign_drops if signing else schedule[phase]):
                gone.add(u)
                continue
            if phase is Phase.MASKED_INPUT:
                q = _quantized(get_input(i), quantization, streams[u])
                np.add(plain, q, out=plain)
                devices[u].provide_input(q)
            start = tick()
            reply = devices[u].send()
            device_seconds[u] += tick() - start
            upload_to_server(u, reply)
            if server.phase is not phase:
                break
        if server.phase is phase:
            start = tick()
            server.advance(consistency_deadline(params.deadlines) if signing else params.deadlines[index])
            if phase is Phase.UNMASK:
                unmask_seconds += tick() - start

    survivors: frozenset[int] = frozenset()
    error: FedRecError | None = None
    total: NDArray[np.uint32] | None = None
    if server.phase is Phase.DONE:
        result = server.result()
        total, survivors = result.total, result.survivors
    else:
        error = server.abort_error
    kept = np.zeros(length, dtype=np.int64)
    for u in survivors:
        kept += devices[u].kept_noise()
    # `plain` holds every input that was masked; the survivors are exactly the devices that sent one.
    expected = (plain + to_ring(kept)).astype(np.uint32) if survivors else np.zeros(length, dtype=np.uint32)
    return HarnessResult(
        total=total,
        expected=expected,
        kept_noise=kept,
        survivors=survivors,
        dropouts=server.dropouts,
        error=error,
        params=graph,
        dp_t_min=dp_t_min,
        shares_received=shares,
        upload_bytes=upload,
        download_bytes=download,
        device_seconds=device_seconds,
        server_unmask_seconds=unmask_seconds,
    )


def _quantized(x: NDArray[np.generic], cfg: QuantizationConfig | None, coins: NoiseStream) -> NDArray[np.uint32]:
    if x.dtype == np.uint32:
        return np.ascontiguousarray(x, dtype=np.uint32)
    if cfg is None:
        raise ValueError("float inputs need a QuantizationConfig")
    q, _ = quantize(np.asarray(x, dtype=np.float64), cfg, coins)
    return q
