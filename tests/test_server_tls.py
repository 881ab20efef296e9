"""TLS end to end: ``fedrec-server`` with ``server.tls_cert`` / ``server.tls_key`` (a self-signed
certificate made here with ``cryptography``) listens on https; real devices
(`device_sdk.client.DeviceClient` over `device_sdk.http.HttpTransport`, its aiohttp session trusting
that certificate) register, check in and finish a round over TLS; plain http to the TLS port and
https without trusting the certificate both fail."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from device_sdk.client import ClientConfig, DeviceClient, RoundStatus
from device_sdk.http import HttpTransport
from device_sdk.transport import TransportError
from fedsim.fleets.local import fetch_status
from protocol.messages import CheckIn, RegisterRequest, RegisterResponse, Wait
from protocol.policy import PrivacyPolicy
from tests.server_helpers import BITS, N_ITEMS, users


def make_self_signed(folder: Path) -> tuple[Path, Path]:
    """A P-256 key and a one-day self-signed certificate for 127.0.0.1 / localhost (PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedrec test server")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "server.crt", folder / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    return cert_path, key_path


def _write_config(path: Path, cert: Path, key: Path) -> None:
    path.write_text(
        f"""
[server]
host = "127.0.0.1"
port = 0
data_dir = "{path.parent / "data"}"
tls_cert = "{cert.name}"
tls_key = "{key.name}"

[model]
n_items = {N_ITEMS}
bits = {BITS}

[rounds]
cohort_size = 3
min_cohort = 3
max_rounds = 1
seed = 2
clip_norm = 64.0
scale_bits = 12
advertise_timeout = 5.0
share_keys_timeout = 5.0
masked_input_timeout = 5.0
unmask_timeout = 5.0
round_interval = 0.05
"""
    )


@pytest.mark.asyncio
async def test_devices_train_over_tls_and_plain_http_is_refused(tmp_path: Path) -> None:
    cert, key = make_self_signed(tmp_path)
    config = tmp_path / "server.toml"
    _write_config(config, cert, key)  # relative paths: resolved against the TOML's folder
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - the child keeps its own descriptor
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agg_server", "--config", str(config)], stdout=subprocess.PIPE, stderr=log, text=True
        )
    finally:
        log.close()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on https://127.0.0.1:" in line, (tmp_path / "server.log").read_text()
        url = line.strip().rsplit(" ", 1)[-1]
        port = url.rsplit(":", 1)[-1]

        trust = ssl.create_default_context(cafile=str(cert))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trust)) as session:
            clients = [
                DeviceClient(
                    HttpTransport(url, session=session, retries=2, backoff_base=0.05),
                    ClientConfig(
                        store_dir=tmp_path / f"device-{i}", long_poll_timeout=30.0, privacy=PrivacyPolicy.no_floor()
                    ),
                    items=items,
                    ratings=ratings,
                    n_items=N_ITEMS,
                    bits=BITS,
                )
                for i, (items, ratings) in enumerate(users(3).values())
            ]
            ids = [await c.register() for c in clients]
            assert sorted(ids) == [1, 2, 3]

            async def until_committed(client: DeviceClient) -> RoundStatus:
                for _ in range(200):
                    outcome = await client.run_round()
                    if outcome.status is not RoundStatus.WAITED:
                        return outcome.status
                    await asyncio.sleep(min(outcome.retry_after or 0.2, 0.2))
                raise AssertionError("never invited")

            outcomes = await asyncio.wait_for(asyncio.gather(*(until_committed(c) for c in clients)), 60)
            assert outcomes == [RoundStatus.COMMITTED] * 3
            status = await fetch_status(session, url)
            assert status["model"]["version"] == 2 and status["rounds"]["committed"] == 1
            for c in clients:
                await c.close()
            # The bare protocol over TLS: register, check in, get the encoded Wait (no round is left).
            transport = HttpTransport(url, session=session)
            reg = await transport.request("POST", "/v1/devices", RegisterRequest(platform="tls-test"))
            assert reg.status == 201 and isinstance(reg.message, RegisterResponse)
            token = reg.message.token
            wait = await transport.request("POST", "/v1/checkin", CheckIn(device_id=reg.message.device_id), token=token)
            assert wait.status == 200 and isinstance(wait.message, Wait) and wait.retry_after is not None

        # Plain http to the TLS port: no answer (the TLS handshake fails), the transport gives up.
        plain = HttpTransport(f"http://127.0.0.1:{port}", retries=0)
        try:
            with pytest.raises(TransportError):
                await plain.request("GET", "/v1/health", timeout=10.0)
        finally:
            await plain.close()
        # https without trusting the self-signed certificate: refused by verification.
        untrusted = HttpTransport(url, retries=0)
        try:
            with pytest.raises(TransportError, match="(?i)certificate"):
                await untrusted.request("GET", "/v1/health", timeout=10.0)
        finally:
            await untrusted.close()
        # A transport that makes its own session, told to trust the certificate with ssl=.
        own = HttpTransport(url, retries=0, ssl=trust)
        try:
            reg = await own.request("POST", "/v1/devices", RegisterRequest(platform="tls-own-session"), timeout=10.0)
            assert reg.status == 201 and isinstance(reg.message, RegisterResponse)
        finally:
            await own.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
