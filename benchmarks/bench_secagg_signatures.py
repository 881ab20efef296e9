"""CPU cost of protocol 1.3 (signed identities and the consistency check) on top of a SecAgg+ round.

Measures, with ``time.process_time`` (robust on a shared machine), what the server adds (low-order probe
of both advertised points, certificate and signature of every advertisement, every survivor-set
signature) and what one device adds (signing twice, verifying its k neighbours' certificates and
advertisements, verifying every forwarded survivor-set signature with its certificate).

Example::

    python benchmarks/bench_secagg_signatures.py --n 1000 --drop 0.3
"""

from __future__ import annotations

import argparse
import sys
import time

from protocol import crypto
from protocol.graph import find_parameters
from protocol.identity import (
    SigningKey,
    issue_certificate,
    key_advertisement_payload,
    survivor_set_payload,
    verify_certificate,
    verify_signature,
)
from protocol.messages import RoundInvite
from protocol.phases import required_signatures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--drop", type=float, default=0.3, help="dropout before the masked input")
    parser.add_argument("--adversary", type=float, default=0.05)
    parser.add_argument("--omega", type=float, default=0.33)
    args = parser.parse_args(argv)
    n = args.n
    survivors = n - int(round(args.drop * n))
    graph = find_parameters(n, args.omega, args.adversary)
    authority = SigningKey.generate()
    keys = [SigningKey.generate() for _ in range(n)]
    certs = [issue_certificate(authority, key.public_key) for key in keys]
    pairs = [(crypto.generate_key_pair().public_key, crypto.generate_key_pair().public_key) for _ in range(n)]
    payloads = [key_advertisement_payload(1, i, c, s) for i, (c, s) in enumerate(pairs)]
    adverts = [keys[i].sign(payloads[i]) for i in range(n)]
    session = b"\x07" * 32
    u3 = list(range(survivors))
    set_signatures = [keys[i].sign(survivor_set_payload(1, session, u3)) for i in u3]
    probe = crypto.generate_key_pair()

    start = time.process_time()
    for i in range(n):
        for point in pairs[i]:
            crypto.x25519(probe.private_key, point)
        identity = verify_certificate(certs[i], authority.public_key)
        verify_signature(identity, adverts[i], payloads[i])
    payload = survivor_set_payload(1, session, u3)
    for i in u3:
        verify_signature(keys[i].public_key, set_signatures[i], payload)
    server = time.process_time() - start

    start = time.process_time()
    keys[0].sign(payloads[0])
    for i in range(min(graph.k, n)):
        identity = verify_certificate(certs[i], authority.public_key)
        verify_signature(identity, adverts[i], payloads[i])
    payload = survivor_set_payload(1, session, u3)
    keys[0].sign(payload)
    for i in u3:
        identity = verify_certificate(certs[i], authority.public_key)
        verify_signature(identity, set_signatures[i], payload)
    device = time.process_time() - start

    invite = RoundInvite(
        round_id=1,
        device_id=0,
        vector_length=1,
        graph_k=graph.k,
        graph_t=graph.t,
        clip_norm=1.0,
        scale_bits=16,
        advertise_deadline=1.0,
        share_keys_deadline=2.0,
        masked_input_deadline=3.0,
        unmask_deadline=4.0,
        cohort_size=n,
    )
    need = required_signatures(invite, args.adversary)
    print(f"n={n} survivors={survivors} k={graph.k} t={graph.t}; a device needs {need} signatures on one set")
    print(f"server extra CPU {server:.3f} s; device extra CPU {device:.3f} s (process_time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
