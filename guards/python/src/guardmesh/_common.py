"""What the guard kit and the coordinator client share: strict argument
parsing (R20), credentials for reaching the mesh (R24), enum helpers."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Optional, Sequence, Union

import grpc
import grpc.aio

__all__ = ["ArgumentsError", "MeshCredentials", "parse_arguments"]


class ArgumentsError(ValueError):
    """Arguments that are not an I-JSON object (RFC 7493), which parsers
    would read differently: what the guard judged would not be what runs."""


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ArgumentsError(f"duplicate member name {key[:64]!r}")
        obj[key] = value
    return obj


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ArgumentsError(f"number {text[:32]}... does not fit a double")
    return value


def _double_int(text: str) -> int:
    if math.isinf(float(text)):
        raise ArgumentsError(f"number {text[:32]}... does not fit a double")
    return int(text)


def _no_constant(name: str) -> Any:
    raise ArgumentsError(f"{name} is not JSON")


def _check_strings(value: Any) -> None:
    """Raises on a string (or member name) with a lone surrogate."""
    stack = [value]
    while stack:
        item = stack.pop()
        strings: list[str]
        if isinstance(item, str):
            strings = [item]
        elif isinstance(item, dict):
            strings = list(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            strings = []
            stack.extend(item)
        else:
            continue
        for text in strings:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ArgumentsError("a string holds a lone surrogate (\\ud800...)") from None


def parse_arguments(text: str) -> dict[str, Any]:
    """Parses a call's arguments: a JSON object, as text ("" is ``{}``).

    Strict, as the mesh's gate is (docs/behaviour.md R20): raises :class:`ArgumentsError`
    for anything that is not an I-JSON object (invalid JSON, not an object,
    duplicate member names, numbers a double cannot hold, NaN/Infinity, lone
    surrogates, nesting too deep to parse), which parsers read differently.
    """
    if not text.strip():
        return {}
    try:
        value = json.loads(text, object_pairs_hook=_unique_members,
                           parse_float=_finite_float, parse_int=_double_int,
                           parse_constant=_no_constant)
    except ArgumentsError:
        raise
    except RecursionError:
        raise ArgumentsError("nested too deep") from None
    except ValueError as err:  # json.JSONDecodeError, int digit limits
        raise ArgumentsError(f"not JSON: {str(err)[:120]}") from None
    if not isinstance(value, dict):
        raise ArgumentsError(f"a JSON {type(value).__name__}, not an object")
    _check_strings(value)
    return value


def read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as err:
        raise ValueError(f"cannot read the {what} {path}: {err.strerror}") from None


def channel_target(address: str) -> str:
    for scheme in ("http://", "https://", "grpc://"):
        if address.startswith(scheme):
            return address[len(scheme):].rstrip("/")
    return address


def as_list(value: Union[str, Sequence[str], None]) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return list(value)


def enum_value(names: Mapping[str, int], prefix: str, value: Union[str, int]) -> int:
    """An enum value from an int, a short name ("fail_open") or a full name."""
    if isinstance(value, int):
        return value
    key = str(value).strip().upper().replace("-", "_")
    if not key.startswith(prefix):
        key = prefix + key
    if key not in names:
        choices = ", ".join(n[len(prefix):].lower() for n in names)
        raise ValueError(f"unknown value {value!r}: expected one of {choices}")
    return names[key]


Metadata = tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class MeshCredentials:
    """How a client reaches the mesh: TLS (the CA of the mesh's certificate,
    and a client certificate for mTLS) and a bearer token. Every call made
    with them carries them (R24).
    """

    #: PEM of the CA that signed the mesh's certificate; set it for TLS.
    ca_file: Optional[str] = None
    #: The client's PEM certificate and key, for a mesh requiring mTLS.
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    #: Bearer token (``token_file`` or ``GUARDMESH_TOKEN`` keep it out of
    #: process listings; see :meth:`create`).
    token: Optional[str] = dataclasses.field(default=None, repr=False)
    #: The name to verify the mesh's certificate against, when it differs
    #: from the address's host.
    tls_domain: Optional[str] = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs both cert_file and key_file")
        if self.cert_file and not self.ca_file:
            raise ValueError("a client certificate needs TLS: set ca_file too")
        if self.token is not None and (not self.token.strip() or "\n" in self.token.strip()):
            raise ValueError("the token must be one non-empty line")
        if self.tls_domain and not self.ca_file:
            raise ValueError("tls_domain needs TLS: set ca_file too")

    @classmethod
    def create(
        cls,
        *,
        ca_file: Optional[str] = None,
        cert_file: Optional[str] = None,
        key_file: Optional[str] = None,
        token: Optional[str] = None,
        token_file: Optional[str] = None,
        tls_domain: Optional[str] = None,
        token_from_env: bool = True,
    ) -> "MeshCredentials":
        """Credentials with the token from ``token``, else the first line of
        ``token_file``, else (with ``token_from_env``) ``GUARDMESH_TOKEN``."""
        if token is not None and token_file is not None:
            raise ValueError("give token or token_file, not both")
        if token_file is not None:
            lines = read_file(token_file, "token file").decode().splitlines()
            token = lines[0].strip() if lines else ""
            if not token:
                raise ValueError(f"the token file {token_file} is empty")
        elif token is None and token_from_env and os.environ.get("GUARDMESH_TOKEN", "").strip():
            token = os.environ["GUARDMESH_TOKEN"].strip()
        return cls(ca_file=ca_file, cert_file=cert_file, key_file=key_file, token=token,
                   tls_domain=tls_domain)

    @property
    def tls(self) -> bool:
        return self.ca_file is not None

    def _ssl(self) -> grpc.ChannelCredentials:
        assert self.ca_file is not None
        return grpc.ssl_channel_credentials(
            root_certificates=read_file(self.ca_file, "CA file"),
            private_key=read_file(self.key_file, "key file") if self.key_file else None,
            certificate_chain=read_file(self.cert_file, "certificate file")
            if self.cert_file else None)

    def _options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.tls_domain)] if self.tls_domain else []

    def _check(self, mesh_addr: str) -> str:
        if mesh_addr.startswith("https://") and not self.tls:
            raise ValueError(f"{mesh_addr} is https://: set the mesh's CA file")
        return channel_target(mesh_addr)

    def channel(self, mesh_addr: str) -> grpc.Channel:
        """A blocking channel to the mesh at ``mesh_addr``."""
        target = self._check(mesh_addr)
        if not self.tls:
            return grpc.insecure_channel(target)
        return grpc.secure_channel(target, self._ssl(), options=self._options())

    def aio_channel(self, mesh_addr: str) -> grpc.aio.Channel:
        """An asyncio channel to the mesh at ``mesh_addr``."""
        target = self._check(mesh_addr)
        if not self.tls:
            return grpc.aio.insecure_channel(target)
        return grpc.aio.secure_channel(target, self._ssl(), options=self._options())

    def metadata(self) -> Metadata:
        """The metadata of every call: the token, if any."""
        if self.token is None:
            return ()
        return (("authorization", f"Bearer {self.token.strip()}"),)
