"""Node identity and cluster trust: key pairs, the cluster CA, node certificates, revocations.

Identity. Every daemon has its own key pair (ECDSA P-256; `node_key.pem` in its data dir, mode 600).
Its node id is derived from its public key: the first 16 bytes of SHA-256 over the key's DER
SubjectPublicKeyInfo, in hex (32 characters), as libp2p derives a peer id from a key. Whoever
claims a node id must show the public key that hashes to it and sign with its private key, so no
member can act as another, and ids need no registry.

Membership. A cluster CA certifies which keys are members. By default its key is derived from the
cluster secret (HKDF-SHA256 -> a P-256 scalar), so every holder of the secret can certify its own
key at start and every daemon verifies the others with the same CA: the secret decides membership,
as before, and nothing else has to be distributed. An operator may instead run a CA of their own
(`--tls-ca`, `--tls-cert`, `--tls-key`, as Consul and Nomad do): then daemons hold no secret, cannot
mint identities, and a revoked host cannot come back under a new key.

Why P-256 and not Ed25519: the same key and certificate serve mutual TLS, and gRPC's TLS stack
(BoringSSL in grpcio) refuses Ed25519 certificates (NO_COMMON_SIGNATURE_ALGORITHMS; tried with
grpcio 1.85, see also grpc/grpc#24252). One key for TLS and for call signatures means the TLS peer
and the signer of a call are checked to be the same node.

Certificates name no IP address or host name (subject CN = node id, SAN `peerd` and
`<node id>.peerd`); clients check the server's name against `peerd` and its identity from the
signed reply, so hosts behind NAT, relays and changing addresses need no new certificate.

Revocations name a node id, carry a time and a reason, and are signed by a CA key: the derived
one (`peerd keys revoke` with the secret) or the operator's (`--ca-key`). Daemons keep them in
their data dir and spread them with heartbeats (peerd.node.membership_service).
"""
from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from peerd.files import atomic_write

NODE_ID_BYTES = 16
NODE_ID_LEN = 2 * NODE_ID_BYTES
TLS_NAME = "peerd"                 # the name every node certificate carries; clients check it
P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
NOT_BEFORE = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
NOT_AFTER = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.timezone.utc)
MAX_REASON = 200

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
PublicKey = ec.EllipticCurvePublicKey | rsa.RSAPublicKey


class PkiError(ValueError):
    """A key, certificate or revocation is unusable; the message says why."""


def node_id_of(public_key: PublicKey) -> str:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).digest()[:NODE_ID_BYTES].hex()


def is_node_id(value: str) -> bool:
    return len(value) == NODE_ID_LEN and all(c in "0123456789abcdef" for c in value)


def sign(key: PrivateKey, data: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    return key.sign(data, padding.PKCS1v15(), hashes.SHA256())


def verify(public_key: PublicKey, signature: bytes, data: bytes) -> bool:
    try:
        if isinstance(public_key, ec.EllipticCurvePublicKey):
            public_key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(public_key, rsa.RSAPublicKey):
            public_key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
        else:
            return False
    except (InvalidSignature, ValueError):
        return False
    return True


def check_key_type(key: PrivateKey | PublicKey, what: str) -> None:
    if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)):
        if key.curve.name not in ("secp256r1", "secp384r1"):
            raise PkiError(f"{what}: curve {key.curve.name} is not supported (use P-256 or P-384)")
        return
    if isinstance(key, (rsa.RSAPrivateKey, rsa.RSAPublicKey)):
        if key.key_size < 2048:
            raise PkiError(f"{what}: RSA key of {key.key_size} bits; use at least 2048")
        return
    raise PkiError(f"{what}: {type(key).__name__} keys are not supported; peerd needs an EC P-256 key "
                    "(openssl ecparam -name prime256v1 -genkey -noout) or RSA; gRPC's TLS refuses Ed25519")


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def load_key(path: Path) -> PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as e:
        raise PkiError(f"cannot read key {path}: {e.strerror}") from None
    except (ValueError, TypeError) as e:
        raise PkiError(f"{path} is not an unencrypted PEM private key ({e})") from None
    check_key_type(key, str(path))
    return key


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path`, mode 600, atomically."""
    atomic_write(path, data, 0o600)


# --- the cluster CA -----------------------------------------------------------------------------

def derive_ca_key(secret: bytes) -> ec.EllipticCurvePrivateKey:
    """The CA key every holder of `secret` derives alike (HKDF-SHA256 to a P-256 scalar)."""
    okm = HKDF(algorithm=hashes.SHA256(), length=48, salt=b"peerd-cluster-ca",
               info=b"peerd v2: the cluster CA key").derive(secret)
    return ec.derive_private_key(int.from_bytes(okm, "big") % (P256_ORDER - 1) + 1, ec.SECP256R1())


def _ca_certificate(key: PrivateKey) -> x509.Certificate:
    fp = node_id_of(key.public_key())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"peerd cluster CA {fp[:16]}")])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    return (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(int(fp, 16) >> 1 or 1).not_valid_before(NOT_BEFORE).not_valid_after(NOT_AFTER)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256()))


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


class ClusterTrust:
    """The CAs this daemon trusts (one, or two while a secret is rotated) and, when it can issue,
    the key of the first."""

    def __init__(self, cas: list[x509.Certificate], issuer_key: PrivateKey | None = None) -> None:
        if not cas:
            raise PkiError("no CA certificate")
        self.cas = cas
        self.issuer_key = issuer_key
        self.pem = b"".join(_pem(c) for c in cas)

    @classmethod
    def from_secrets(cls, secrets_: list[bytes]) -> "ClusterTrust":
        """Each secret of a keyring gives one CA; the first issues (see docs/security.md, rotation)."""
        keys = [derive_ca_key(s) for s in secrets_]
        return cls([_ca_certificate(k) for k in keys], keys[0])

    @classmethod
    def from_files(cls, ca_file: str, ca_key_file: str = "") -> "ClusterTrust":
        path = Path(ca_file).expanduser()
        try:
            cas = x509.load_pem_x509_certificates(path.read_bytes())
        except OSError as e:
            raise PkiError(f"cannot read CA bundle {path}: {e.strerror}") from None
        except ValueError as e:
            raise PkiError(f"{path} holds no PEM certificate ({e})") from None
        key = load_key(Path(ca_key_file).expanduser()) if ca_key_file else None
        if key is not None and node_id_of(key.public_key()) != node_id_of(cas[0].public_key()):
            raise PkiError(f"{ca_key_file} is not the key of the first CA in {path}")
        return cls(cas, key)

    # --- certificates ---------------------------------------------------------------------------
    def issue(self, public_key: PublicKey) -> x509.Certificate:
        """A node certificate for `public_key`: CN = its node id, SAN `peerd` and `<id>.peerd`."""
        if self.issuer_key is None:
            raise PkiError("this trust holds no CA key: it cannot issue certificates")
        check_key_type(public_key, "node key")
        node = node_id_of(public_key)
        ca = self.cas[0]
        now = dt.datetime.now(dt.timezone.utc)
        return (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
                .issuer_name(ca.subject).public_key(public_key).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(NOT_AFTER)
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME), x509.DNSName(f"{node}.{TLS_NAME}")]),
                               critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self.issuer_key, hashes.SHA256()))

    def check(self, cert: x509.Certificate, now: dt.datetime | None = None) -> str:
        """The node id `cert` certifies; raises PkiError when no trusted CA issued it (directly),
        it is out of its validity, or it is a CA itself."""
        now = now or dt.datetime.now(dt.timezone.utc)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise PkiError(f"certificate outside its validity ({cert.not_valid_before_utc:%Y-%m-%d} .. "
                            f"{cert.not_valid_after_utc:%Y-%m-%d})")
        try:
            if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
                raise PkiError("a CA certificate is no node certificate")
        except x509.ExtensionNotFound:
            pass
        key = cert.public_key()
        check_key_type(key, "certificate key")
        for ca in self.cas:
            try:
                cert.verify_directly_issued_by(ca)
                return node_id_of(key)
            except (ValueError, TypeError, InvalidSignature):
                continue
        raise PkiError("certificate not issued by this cluster's CA (cluster secret mismatch, or another CA)")

    # --- revocations ----------------------------------------------------------------------------
    def revoke(self, node: str, reason: str = "", at: float | None = None) -> "Revocation":
        if self.issuer_key is None:
            raise PkiError("revoking needs the cluster secret or the CA key (--ca-key)")
        if not is_node_id(node):
            raise PkiError(f"{node[:80]!r} is not a node id (32 hex characters; `peerd status` shows them)")
        rev = Revocation(node, round(time.time() if at is None else at, 3), reason[:MAX_REASON], b"")
        return Revocation(rev.node, rev.at, rev.reason, sign(self.issuer_key, rev.signed_bytes()))

    def verify_revocation(self, rev: "Revocation") -> bool:
        if not is_node_id(rev.node) or len(rev.reason) > MAX_REASON or len(rev.signature) > 1024:
            return False
        return any(verify(ca.public_key(), rev.signature, rev.signed_bytes()) for ca in self.cas)


@dataclass(frozen=True)
class Revocation:
    node: str
    at: float            # unix seconds when it was issued
    reason: str
    signature: bytes

    def signed_bytes(self) -> bytes:
        return f"peerd-revocation-v2\n{self.node}\n{self.at:.3f}\n{self.reason}".encode()

    def to_json(self) -> dict:
        return {"node": self.node, "at": self.at, "reason": self.reason,
                "signature": base64.b64encode(self.signature).decode()}

    @classmethod
    def from_json(cls, d: dict) -> "Revocation":
        return cls(str(d["node"]), float(d["at"]), str(d.get("reason", "")), base64.b64decode(d["signature"]))


class Revocations:
    """The revoked node ids this daemon knows: verified, bounded, kept in a file, digested for
    gossip (two daemons with the same set have the same digest)."""

    def __init__(self, trust: ClusterTrust, path: Path | None = None, capacity: int = 4096) -> None:
        self.trust = trust
        self.path = path
        self.capacity = capacity
        self.by_node: dict[str, Revocation] = {}
        self.digest = b""
        if path is not None and path.exists():
            self._load(path)
        self._redigest()

    def _load(self, path: Path) -> None:
        try:
            rows = json.loads(path.read_text() or "[]")
        except (OSError, ValueError) as e:
            raise PkiError(f"{path} is unreadable ({e}); remove it only if you know no node was revoked") from None
        self.add((Revocation.from_json(r) for r in rows), save=False)

    def __contains__(self, node: str) -> bool:
        return node in self.by_node

    def __len__(self) -> int:
        return len(self.by_node)

    def add(self, revs: Iterable[Revocation], save: bool = True) -> list[Revocation]:
        """Verify and keep the new ones; returns them (already known or forged ones are skipped)."""
        new = []
        for rev in revs:
            if rev.node in self.by_node or len(self.by_node) >= self.capacity:
                continue
            if not self.trust.verify_revocation(rev):
                continue
            self.by_node[rev.node] = rev
            new.append(rev)
        if new:
            self._redigest()
            if save and self.path is not None:
                write_private(self.path, json.dumps([r.to_json() for r in self.all()], indent=1).encode())
        return new

    def all(self) -> list[Revocation]:
        return [self.by_node[n] for n in sorted(self.by_node)]

    def _redigest(self) -> None:
        h = hashlib.sha256()
        for node in sorted(self.by_node):
            h.update(node.encode())
        self.digest = h.digest()[:8] if self.by_node else b""


@dataclass
class Credentials:
    """This node's key and certificate, and what the wire needs of them."""
    key: PrivateKey
    cert: x509.Certificate
    node_id: str
    cert_b64: str
    key_pem: bytes
    cert_pem: bytes

    @classmethod
    def of(cls, key: PrivateKey, cert: x509.Certificate) -> "Credentials":
        node = node_id_of(key.public_key())
        if node_id_of(cert.public_key()) != node:
            raise PkiError("the certificate is not of this key (--tls-cert and --tls-key do not match)")
        return cls(key, cert, node, base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode(),
                   key_pem(key), _pem(cert))

    @classmethod
    def issued(cls, trust: ClusterTrust, key: PrivateKey | None = None) -> "Credentials":
        """A fresh (or the given) key, certified by `trust` (which must hold its CA key)."""
        key = key or new_key()
        return cls.of(key, trust.issue(key.public_key()))

    @classmethod
    def from_files(cls, cert_file: str, key_file: str, trust: "ClusterTrust") -> "Credentials":
        key = load_key(Path(key_file).expanduser())
        try:
            cert = x509.load_pem_x509_certificates(Path(cert_file).expanduser().read_bytes())[0]
        except OSError as e:
            raise PkiError(f"cannot read certificate {cert_file}: {e.strerror}") from None
        except ValueError as e:
            raise PkiError(f"{cert_file} holds no PEM certificate ({e})") from None
        creds = cls.of(key, cert)
        trust.check(cert)
        if TLS_NAME not in cert_names(cert):
            raise PkiError(f"{cert_file} names {sorted(cert_names(cert)) or 'nothing'}; peerd's TLS checks every "
                           f"certificate for the name {TLS_NAME!r}: issue it with CN={TLS_NAME} or a SAN DNS:{TLS_NAME} "
                           "(no address needed)")
        return creds

    def sign(self, data: bytes) -> bytes:
        return sign(self.key, data)


def cert_names(cert: x509.Certificate) -> set[str]:
    """The DNS names of a certificate's SAN, else its CNs (what TLS name checks look at)."""
    try:
        return set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                   .get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        return {a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)}


def cert_from_b64(value: str) -> x509.Certificate:
    try:
        return x509.load_der_x509_certificate(base64.b64decode(value, validate=True))
    except (ValueError, TypeError) as e:
        raise PkiError(f"malformed certificate ({str(e)[:80]})") from None


def cert_from_pem(value: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(value)
    except ValueError as e:
        raise PkiError(f"malformed certificate ({str(e)[:80]})") from None


def new_secret() -> str:
    return secrets.token_hex(32)
