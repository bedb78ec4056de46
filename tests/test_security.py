"""Access control and TLS against a real stack: the public key on the router, the deployment's
internal token and mutual TLS between roles, TLS on the public port; secrets never in the log.
Certificates are made by the test (a throwaway CA)."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bench.synthetic import make_image
from epd import client, rpc
from epd.v1 import epd_pb2, epd_pb2_grpc
from tests.conftest import epd_status, ray_address, serving

API_KEY = "public-key-for-the-test-42"
TOKEN = "internal-token-for-the-test-0123456789"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key, issuer_name, issuer_key, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = (builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                         critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    return builder.sign(issuer_key, hashes.SHA256())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pki(directory) -> dict[str, str]:
    """Two CAs (public, internal), a server certificate from each; files by name."""
    files = {}
    for kind in ("public", "internal"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _certificate(f"epd test {kind} CA", ca_key, _name(f"epd test {kind} CA"), ca_key, ca=True)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(f"epd {kind}", key, ca.subject, ca_key, ca=False)
        for name, data in ((f"{kind}-ca.pem", ca.public_bytes(serialization.Encoding.PEM)),
                           (f"{kind}-cert.pem", cert.public_bytes(serialization.Encoding.PEM)),
                           (f"{kind}-key.pem", _pem_key(key))):
            path = directory / name
            path.write_bytes(data)
            files[name] = str(path)
    return files


@pytest.fixture(scope="module")
def secured(tiny_model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    files = _pki(directory)
    token_file = directory / "token"
    token_file.write_text(TOKEN)
    key_file = directory / "api-key"
    key_file.write_text(API_KEY)
    with serving(
            tiny_model_dir, "--api-key-file", str(key_file), "--internal-token-file", str(token_file),
            "--tls-cert", files["public-cert.pem"], "--tls-key", files["public-key.pem"],
            "--internal-tls-ca", files["internal-ca.pem"], "--internal-tls-cert", files["internal-cert.pem"],
            "--internal-tls-key", files["internal-key.pem"], "--log-level", "INFO", "--http-port", "0",
            log_path=str(directory / "serve.log")) as server:
        yield server, files


def _ask(address, files, **kwargs) -> client.GenerateResult:
    return client.generate(address, client.user_request("Hello", [make_image(96, 96, seed=3)], max_tokens=4),
                           timeout_s=60, tls_ca=open(files["public-ca.pem"], "rb").read(), **kwargs)


def test_the_router_wants_tls_and_the_key(secured, oracle):
    server, files = secured
    result = _ask(server.address, files, api_key=API_KEY)
    assert result.token_ids == oracle.generate("Hello", [make_image(96, 96, seed=3)], max_new_tokens=4)[0]
    for wrong in (None, "not-the-key-at-all"):
        with pytest.raises(grpc.RpcError) as raised:
            _ask(server.address, files, api_key=wrong)
        assert raised.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as raised:  # plaintext to a TLS port: no answer at all
        client.generate(server.address, client.user_request("Hello", max_tokens=2), timeout_s=10, api_key=API_KEY)
    assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
    # Health checks stay open (with TLS): a load balancer needs no key.
    ca = open(files["public-ca.pem"], "rb").read()
    assert rpc.health_status(server.address, transport=rpc.Transport(ca=ca)) == 1


def test_cli_takes_the_key_and_the_ca(secured):
    server, files = secured
    base = [sys.executable, "-m", "control.cli", "generate", "--addr", server.address, "--prompt", "hi",
            "--max-tokens", "2", "--tls-ca", files["public-ca.pem"]]
    ok = subprocess.run([*base, "--api-key", API_KEY], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and refused.stderr.strip().startswith("UNAUTHENTICATED:")


def test_internal_services_want_the_certificate_and_the_token(secured):
    server, files = secured
    roles = epd_status(ray_address(server))["roles"]
    ca, cert, key = (open(files[f"internal-{n}.pem"], "rb").read() for n in ("ca", "cert", "key"))
    calls = {
        "encode": (epd_pb2_grpc.EncoderStub, "Encode", epd_pb2.EncodeRequest()),
        "prefill": (epd_pb2_grpc.PrefillStub, "Prefill", epd_pb2.PrefillRequest()),
        "decode": (epd_pb2_grpc.DecodeStub, "Stream", epd_pb2.StreamRequest(request_id="someone-elses")),
    }
    for role, (make_stub, method, request) in calls.items():
        address = roles[role][0]["address"]

        def call(transport: rpc.Transport, token: str = ""):
            with transport.channel(address) as chan:
                answer = getattr(make_stub(chan), method)(request, timeout=10,
                                                          metadata=((rpc.INTERNAL_TOKEN_KEY, token),) if token else ())
                return list(answer) if method == "Stream" else answer

        with pytest.raises(grpc.RpcError) as raised:  # no client certificate: the handshake fails
            call(rpc.Transport(ca=ca))
        assert raised.value.code() is grpc.StatusCode.UNAVAILABLE, role
        for token in ("", "a-wrong-token-of-some-length"):
            with pytest.raises(grpc.RpcError) as raised:  # a certificate but not the deployment's token
                call(rpc.Transport(ca=ca, cert=cert, key=key), token)
            assert raised.value.code() is grpc.StatusCode.UNAUTHENTICATED, role
        try:  # both: past the guard, to the service itself (which may still refuse the request)
            call(rpc.Transport(ca=ca, cert=cert, key=key), TOKEN)
        except grpc.RpcError as error:
            assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (role, error)


def test_secrets_never_reach_the_log(secured):
    server, files = secured
    _ask(server.address, files, api_key=API_KEY)
    server.log.flush()
    text = open(server.log.name).read()  # the stderr of epd serve and of every role
    assert API_KEY not in text and TOKEN not in text
    assert "router" in text  # the log is not empty: the check above means something


def test_no_config_repr_or_report_shows_a_secret(tiny_model_dir):
    """The Redis password, the API key and the internal token are in no repr of a config and in no
    report of one (``epd.config.redacted``, what ``epd bench --json`` writes)."""
    import json

    from epd.config import DeployConfig, SecurityConfig, ServeConfig, StoreConfig, redacted

    password = "redis-password-for-the-test-77"
    store = StoreConfig(redis_url=f"redis://:{password}@10.0.0.5:6380/0")
    config = DeployConfig(ServeConfig(tiny_model_dir, store=store,
                                      security=SecurityConfig(api_key=API_KEY, internal_token=TOKEN)))
    for text in (repr(store), repr(config), str(config), json.dumps(redacted(config))):
        assert password not in text and API_KEY not in text and TOKEN not in text, text
        assert "10.0.0.5:6380" in text  # the rest is still shown
    report = redacted(config)
    assert report["serve"]["store"]["redis_url"] == "redis://:***@10.0.0.5:6380/0"
    assert report["serve"]["security"]["api_key"] == report["serve"]["security"]["internal_token"] == "***"
    assert redacted(DeployConfig(ServeConfig(tiny_model_dir)))["serve"]["security"]["api_key"] == ""


def _reflect(channel, metadata=None) -> list[str]:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata, timeout=30)
    return [service.name for reply in replies for service in reply.list_services_response.service]


def test_the_http_front_and_reflection_want_tls_and_the_key(secured):
    import json
    import ssl
    import urllib.error
    import urllib.request

    server, files = secured
    http = next(line.split("https://", 1)[1].strip().removesuffix("/v1") for line in server.lines
                if line.startswith("epd http at https://"))
    context = ssl.create_default_context(cafile=files["public-ca.pem"])

    def get(path: str, key: str | None = None, scheme: str = "https"):
        request = urllib.request.Request(f"{scheme}://{http}{path}",
                                         headers={"authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(request, timeout=30, context=context if scheme == "https" else None) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    assert get("/health") == (200, {"status": "ok"})  # open, as gRPC health is
    status, body = get("/v1/models")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert get("/v1/models", "not-the-key-000")[0] == 401
    status, body = get("/v1/models", API_KEY)
    assert status == 200 and len(body["data"]) == 1
    with pytest.raises(OSError):  # URLError or a dropped connection: the port speaks TLS only
        get("/health", scheme="http")
    credentials = grpc.ssl_channel_credentials(open(files["public-ca.pem"], "rb").read())
    with grpc.secure_channel(server.address, credentials) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            _reflect(channel)
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "epd.v1.Router" in _reflect(channel, (("authorization", f"Bearer {API_KEY}"),))
