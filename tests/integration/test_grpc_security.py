"""The shared gRPC helpers on real loopback servers: service token on every call kind, open health, TLS.

Both server kinds: the thread-pool one (grpc_server.build_server) and the asyncio one the services run
(aio_server.AioServer)."""

import datetime
import ipaddress

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api.sparrow.v1 import (
    generator_pb2,
    generator_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    weights_pb2,
    weights_pb2_grpc,
)
from services.common.aio_server import AioServer
from services.common.grpc_server import (
    GrpcSecurity,
    add_health_and_reflection,
    bind,
    build_server,
    open_channel,
    stop_gracefully,
)
from tests.fixtures.standin_rollout_server import StandinRolloutServer

TOKEN = "a-long-service-token"


class _Status(generator_pb2_grpc.GeneratorControlServicer):
    def GetStatus(self, request, context):
        return generator_pb2.GetStatusResponse(generator_id="secured")


class _AsyncStatus(generator_pb2_grpc.GeneratorControlServicer):
    async def GetStatus(self, request, context):
        return generator_pb2.GetStatusResponse(generator_id="secured")


def _serve(security: GrpcSecurity, kind: str = "thread"):
    """(a function that stops the server, its port)."""
    if kind == "asyncio":
        aio = AioServer(security, max_calls=8)
        generator_pb2_grpc.add_GeneratorControlServicer_to_server(_AsyncStatus(), aio.server)
        aio.add_health_and_reflection(["sparrow.v1.GeneratorControl"])
        port = aio.bind("127.0.0.1:0")
        aio.start()
        return (lambda: aio.stop(0)), port
    server = build_server(security)
    generator_pb2_grpc.add_GeneratorControlServicer_to_server(_Status(), server)
    health = add_health_and_reflection(server, ["sparrow.v1.GeneratorControl"])
    port = bind(server, "127.0.0.1:0", security)
    server.start()
    return (lambda: stop_gracefully(server, health, 0)), port


def _code(fn) -> grpc.StatusCode | None:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return None


def _status(channel) -> grpc.StatusCode | None:
    stub = generator_pb2_grpc.GeneratorControlStub(channel)
    return _code(lambda: stub.GetStatus(generator_pb2.GetStatusRequest(), timeout=5))


def _health(channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


@pytest.fixture(params=["thread", "asyncio"])
def token_server(request):
    stop, port = _serve(GrpcSecurity(token=TOKEN), request.param)
    yield f"127.0.0.1:{port}"
    stop()


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        (TOKEN, None),
        ("", grpc.StatusCode.UNAUTHENTICATED),
        ("x" * len(TOKEN), grpc.StatusCode.UNAUTHENTICATED),  # same length: refused by content, not by size
        (TOKEN + "x", grpc.StatusCode.UNAUTHENTICATED),
    ],
)
def test_unary_calls_need_the_exact_token_and_health_never_does(token_server, token, expected):
    channel = open_channel(token_server, GrpcSecurity(token=token))
    try:
        assert _status(channel) == expected
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()


def test_streaming_calls_are_refused_without_the_token_too():
    with StandinRolloutServer(GrpcSecurity(token=TOKEN)) as trainer:
        for token, expected in (("wrong", grpc.StatusCode.UNAUTHENTICATED), (TOKEN, None)):
            channel = open_channel(trainer.address, GrpcSecurity(token=token))
            try:
                fetch = weights_pb2_grpc.WeightServiceStub(channel).FetchPolicy
                assert _code(lambda f=fetch: list(f(weights_pb2.FetchPolicyRequest(version=1), timeout=5))) in (
                    expected,
                    grpc.StatusCode.NOT_FOUND,  # authorised, but no such version: past the token check
                )
                hello = rollout_pb2.StreamTrajectoriesRequest(hello=rollout_pb2.GeneratorHello(generator_id="g"))
                stream = rollout_pb2_grpc.RolloutServiceStub(channel).StreamTrajectories
                code = _code(lambda s=stream, h=hello: next(iter(s(iter([h]), timeout=5))))
                assert code == expected
            finally:
                channel.close()
        assert len(trainer.hellos) == 1  # only the authorised stream got through


def _self_signed(tmp_path, name="sparrow-test", maker="cryptography"):
    """A self-signed EC certificate for localhost / 127.0.0.1: (cert path, key path).

    Made with the cryptography package when it is installed, else (or when asked) with the openssl command.
    """
    try:
        import cryptography  # noqa: F401
    except ImportError:
        maker = "openssl"
    if maker == "openssl":
        return _self_signed_openssl(tmp_path, name)
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
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
    cert_path, key_path = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


def _self_signed_openssl(tmp_path, name):
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.fail("neither the cryptography package nor the openssl command is available to make a certificate")
    cert_path, key_path = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        + ["-keyout", str(key_path), "-out", str(cert_path), "-days", "1", "-subj", f"/CN={name}"]
        + ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    return str(cert_path), str(key_path)


@pytest.mark.parametrize("kind", ["thread", "asyncio"])
@pytest.mark.parametrize("maker", ["cryptography", "openssl"])
def test_tls_with_a_self_signed_certificate_and_the_token(tmp_path, maker, kind):
    cert, key = _self_signed(tmp_path, maker=maker)
    other_ca, _ = _self_signed(tmp_path, "someone-else", maker=maker)
    stop, port = _serve(GrpcSecurity(token=TOKEN, tls_cert=cert, tls_key=key), kind)
    address = f"127.0.0.1:{port}"
    channels = {
        "tls+token": open_channel(address, GrpcSecurity(token=TOKEN, tls_ca=cert)),
        "tls, no token": open_channel(address, GrpcSecurity(tls_ca=cert)),
        "plaintext": open_channel(address, GrpcSecurity(token=TOKEN)),
        "wrong CA": open_channel(address, GrpcSecurity(token=TOKEN, tls_ca=other_ca)),
    }
    try:
        assert _status(channels["tls+token"]) is None
        assert _health(channels["tls, no token"]) == health_pb2.HealthCheckResponse.SERVING
        assert _status(channels["tls, no token"]) == grpc.StatusCode.UNAUTHENTICATED
        assert _status(channels["plaintext"]) == grpc.StatusCode.UNAVAILABLE
        assert _status(channels["wrong CA"]) == grpc.StatusCode.UNAVAILABLE
    finally:
        for channel in channels.values():
            channel.close()
        stop()


def test_a_server_with_tls_needs_both_certificate_and_key(tmp_path):
    cert, _ = _self_signed(tmp_path)
    server = build_server(GrpcSecurity())
    with pytest.raises(ValueError, match="both tls_cert and tls_key"):
        bind(server, "127.0.0.1:0", GrpcSecurity(tls_cert=cert))
