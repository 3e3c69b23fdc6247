"""A throwaway CA, server and client certificates for the TLS tests."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import subprocess
from pathlib import Path

import pytest

# -- certificates -------------------------------------------------------------------------
# A throwaway CA, server and client certificates: with the cryptography package when it
# is installed, else with the openssl command.


def _pki_with_cryptography(tmp: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write(stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        (tmp / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (tmp / f"{stem}-key.pem").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ))

    def builder(subject: str, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        )

    cas = {}
    for ca_name in ("test-ca", "other-ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            builder(ca_name, name(ca_name), key)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ), critical=True)
            .sign(key, hashes.SHA256())
        )
        write(ca_name, cert, key)
        cas[ca_name] = (cert, key)
    ca_cert, ca_key = cas["test-ca"]
    for leaf, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH), ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        leaf_builder = builder(leaf, ca_cert.subject, key).add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if leaf == "server":
            leaf_builder = leaf_builder.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            ]), critical=False)
        write(leaf, leaf_builder.sign(ca_key, hashes.SHA256()), key)


def _pki_with_openssl(tmp: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("neither the cryptography package nor the openssl command is available")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=tmp, check=True, capture_output=True, timeout=60)

    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for ca_name in ("test-ca", "other-ca"):
        run("req", "-x509", *curve, "-keyout", f"{ca_name}-key.pem", "-out", f"{ca_name}.pem", "-days", "1",
            "-subj", f"/CN={ca_name}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature")
    extensions = {
        "server": "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        "client": "extendedKeyUsage=clientAuth\n",
    }
    for serial, (leaf, ext) in enumerate(extensions.items(), start=1000):
        (tmp / f"{leaf}.ext").write_text(ext, encoding="utf-8")
        run("req", *curve, "-keyout", f"{leaf}-key.pem", "-out", f"{leaf}.csr", "-subj", f"/CN={leaf}")
        run("x509", "-req", "-in", f"{leaf}.csr", "-CA", "test-ca.pem", "-CAkey", "test-ca-key.pem",
            "-set_serial", str(serial), "-days", "1", "-out", f"{leaf}.pem", "-extfile", f"{leaf}.ext")


def make_pki(tmp: Path) -> dict[str, Path]:
    """The files, by role: ca, other_ca, server_cert, server_key, client_cert, client_key."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        _pki_with_openssl(tmp)
    else:
        _pki_with_cryptography(tmp)
    return {
        "ca": tmp / "test-ca.pem", "other_ca": tmp / "other-ca.pem",
        "server_cert": tmp / "server.pem", "server_key": tmp / "server-key.pem",
        "client_cert": tmp / "client.pem", "client_key": tmp / "client-key.pem",
    }
