"""Config sections every service spells alike: `[security]` and `[redis]` (docs/config-sections.md).

One environment serves a whole deployment, so SPARROW_SECURITY__TOKEN and SPARROW_REDIS__URL mean
the same thing to every process that reads them. The gRPC services add TLS to the security section.
"""

from __future__ import annotations

from pydantic import Field, SecretStr

from services.common.grpc_server import GrpcSecurity
from sparrow.config import ConfigSection

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class SecurityConfig(ConfigSection):
    """Who may call the service: a shared bearer token."""

    token: SecretStr | None = Field(
        None,
        description="Bearer token callers must present (gRPC metadata; the Authorization header of HTTP POSTs). "
        "Unset: calls need none, except the controller's admin POSTs, which are then off. "
        "Set SPARROW_SECURITY__TOKEN rather than the file.",
    )

    def token_text(self) -> str:
        """The token in clear, empty when unset."""
        return self.token.get_secret_value() if self.token is not None else ""


class GrpcSecurityConfig(SecurityConfig):
    """The shared token and optional TLS of a gRPC service, served or called (services/common/grpc_server.py)."""

    tls_cert: str = Field("", description="PEM certificate of this process's gRPC server; empty: plaintext.")
    tls_key: str = Field("", description="PEM private key of that certificate.")
    tls_ca: str = Field(
        "", description="PEM CA bundle that signed the peers' certificates (calls made, and client certificates)."
    )

    def grpc(self) -> GrpcSecurity:
        """All four settings (the trainer's server: a CA set also checks the certificates clients present)."""
        return GrpcSecurity(token=self.token_text(), tls_cert=self.tls_cert, tls_key=self.tls_key, tls_ca=self.tls_ca)

    def server(self) -> GrpcSecurity:
        """Settings of a server that checks no client certificate: TLS when a certificate is set."""
        return GrpcSecurity(token=self.token_text(), tls_cert=self.tls_cert, tls_key=self.tls_key)

    def client(self) -> GrpcSecurity:
        """Settings of calls to a peer: TLS when a CA (or our own certificate) is set."""
        return GrpcSecurity(token=self.token_text(), tls_cert=self.tls_cert, tls_ca=self.tls_ca)


class RedisConfig(ConfigSection):
    """The Redis of the deployment: the prompt stream, the generators' work queue and the schedule keys."""

    url: str = Field(DEFAULT_REDIS_URL, description="Redis URL, the same for every service of a deployment.")
