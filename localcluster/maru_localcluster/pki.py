"""The local cluster's certificate authority and the API server's serving certificate.

Pods reach the API server the in-cluster way: ``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``,
trusting the CA in ``/var/run/secrets/kubernetes.io/serviceaccount/ca.crt`` (vllm-router's kube-rs
client and the Python client both do). The certificate names the ``kubernetes`` Service's ClusterIP
and the API server's own address, like kube-apiserver's.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class Pki:
    ca_file: Path
    cert_file: Path
    key_file: Path

    @property
    def ca_pem(self) -> str:
        return self.ca_file.read_text()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_pki(directory: Path, ips: list[str], dns_names: list[str], days: int = 7) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(tz=datetime.UTC) - datetime.timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("maru-localcluster-ca"))
        .issuer_name(_name("maru-localcluster-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("kube-apiserver"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pki = Pki(directory / "ca.crt", directory / "apiserver.crt", directory / "apiserver.key")
    pki.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pki.key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    pki.key_file.chmod(0o600)
    return pki
