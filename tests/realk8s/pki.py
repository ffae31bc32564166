"""Self-made certificates for the test control plane: one CA, the API server's serving
certificate (127.0.0.1), an admin client certificate (group system:masters), the
service-account signing key, and the kubelet pair: the process kubelet's serving certificate
(127.0.0.1, verified by the API server) and the API server's client certificate for it.
EC P-256 keys: fast to make, accepted everywhere."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_FOR = dt.timedelta(days=2)  # a test session; never a long-lived credential


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path  # service-account token signing key (private)
    sa_pub: Path  # and its public half, for the API server's token authenticator
    kubelet_cert: Path  # the process kubelet's log endpoint (serving, 127.0.0.1)
    kubelet_key: Path
    kubelet_client_cert: Path  # the API server's identity towards kubelets
    kubelet_client_key: Path
    webhook_dir: Path  # tls.crt and tls.key: a webhook server on 127.0.0.1 (Kueue's manager)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return path


def _name(common: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _sign(subject: x509.Name, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
          issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool,
          usage: list[x509.ObjectIdentifier], sans: list[x509.GeneralName]) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)  # clock skew between processes
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(now + VALID_FOR)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_name = _key(), _name("cephalo-test-ca")
    ca = _sign(ca_name, ca_key, ca_name, ca_key, ca=True, usage=[], sans=[])
    server_key = _key()
    server = _sign(_name("kube-apiserver"), server_key, ca_name, ca_key, ca=False,
                   usage=[ExtendedKeyUsageOID.SERVER_AUTH],
                   sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                         x509.DNSName("localhost"), x509.DNSName("kubernetes.default.svc")])
    admin_key = _key()
    admin = _sign(_name("cephalo-test-admin", "system:masters"), admin_key, ca_name, ca_key,
                  ca=False, usage=[ExtendedKeyUsageOID.CLIENT_AUTH], sans=[])
    kubelet_key = _key()
    kubelet = _sign(_name("system:node:process-kubelet", "system:nodes"), kubelet_key, ca_name,
                    ca_key, ca=False, usage=[ExtendedKeyUsageOID.SERVER_AUTH],
                    sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client_key = _key()
    client = _sign(_name("kube-apiserver-kubelet-client", "kubeadm:cluster-admins"), client_key,
                   ca_name, ca_key, ca=False, usage=[ExtendedKeyUsageOID.CLIENT_AUTH], sans=[])
    webhook_key = _key()
    webhook = _sign(_name("webhook-server"), webhook_key, ca_name, ca_key, ca=False,
                    usage=[ExtendedKeyUsageOID.SERVER_AUTH],
                    sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    webhook_dir = folder / "webhook"
    webhook_dir.mkdir(exist_ok=True)
    _write_cert(webhook, webhook_dir / "tls.crt")
    _write_key(webhook_key, webhook_dir / "tls.key")
    sa_key = _key()
    sa_pub = folder / "sa.pub"
    sa_pub.write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return Pki(ca_cert=_write_cert(ca, folder / "ca.crt"),
               ca_key=_write_key(ca_key, folder / "ca.key"),
               server_cert=_write_cert(server, folder / "server.crt"),
               server_key=_write_key(server_key, folder / "server.key"),
               admin_cert=_write_cert(admin, folder / "admin.crt"),
               admin_key=_write_key(admin_key, folder / "admin.key"),
               sa_key=_write_key(sa_key, folder / "sa.key"), sa_pub=sa_pub,
               kubelet_cert=_write_cert(kubelet, folder / "kubelet.crt"),
               kubelet_key=_write_key(kubelet_key, folder / "kubelet.key"),
               kubelet_client_cert=_write_cert(client, folder / "kubelet-client.crt"),
               kubelet_client_key=_write_key(client_key, folder / "kubelet-client.key"),
               webhook_dir=webhook_dir)
