"""Image URLs of the HTTP front (``router_svc.media``) against a real HTTP server on loopback and
real files: what is fetched, what is refused, and that a refused URL is never connected to
(the server sees no request). Only loopback addresses are ever contacted; the other private and
link-local addresses below are refused before any connection is tried."""

from __future__ import annotations

import asyncio
import os

import pytest

from bench.synthetic import make_image
from epd.config import ConfigError, HttpConfig
from epd.dataurl import encode_data_url
from router_svc.media import MediaError, MediaLoader, refused_address
from tests.media_server import MediaServer

IMAGE = make_image(64, 48, seed=3)


@pytest.fixture(scope="module")
def server():
    server = MediaServer({"/a.png": IMAGE})
    yield server
    server.close()


def load(config: HttpConfig, url: str, kind: str = "image") -> bytes:
    return asyncio.run(MediaLoader(config).load(url, f"{kind} 0", kind))


def refused(config: HttpConfig, url: str, match: str, kind: str = "image") -> None:
    with pytest.raises(MediaError, match=match):
        load(config, url, kind)


OPEN = HttpConfig(allow_media_urls=True)  # any public host, nothing private
LISTED = HttpConfig(allow_media_urls=True, allowed_media_domains=("127.0.0.1",), media_max_mb=0.5,
                    media_fetch_timeout_s=30.0, media_max_redirects=2)


@pytest.mark.parametrize("address,kind", [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"),
    ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("169.254.169.254", "link-local"),
    ("fe80::1", "link-local"), ("::ffff:127.0.0.1", "loopback"), ("::ffff:169.254.169.254", "link-local"),
    ("0.0.0.0", "unspecified"), ("100.64.0.1", "non-public"), ("224.0.0.1", "multicast"), ("fc00::1", "private"),
    ("8.8.8.8", ""), ("2606:4700::1111", ""),
])
def test_address_classes(address, kind):
    assert refused_address(address) == kind


def test_data_url():
    assert load(HttpConfig(), encode_data_url(IMAGE)) == IMAGE
    refused(HttpConfig(), "data:image/png;base64,@@@", "not valid base64")
    refused(HttpConfig(), "data:text/html;base64,PGI+", "is not an image")
    refused(HttpConfig(), "data:image/png,rawbytes", "must be base64")


def test_urls_are_off_unless_allowed(server):
    refused(HttpConfig(), server.url("/a.png"), "--allow-media-urls")
    assert server.requests == []


def test_a_clip_url_is_refused_in_a_clip_s_words(server, tmp_path):
    """The messages about a video_url say video, not image."""
    before = len(server.requests)
    refused(HttpConfig(), server.url("/a.mp4"), "^video 0: video URLs are not fetched .* send the video as", "video")
    refused(OPEN, server.url("/a.mp4"), "video URLs may only name public hosts", "video")
    refused(LISTED, server.url("/huge?bytes=2000000"), "the video at .* more than|is 2000000 bytes", "video")
    (tmp_path / "clips").mkdir()
    refused(HttpConfig(allowed_local_media_path=str(tmp_path)), f"file://{tmp_path}/clips",
            "is a directory, not a video file", "video")
    assert server.requests[before:] == ["/huge?bytes=2000000"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::ffff:127.0.0.1]", "2130706433", "0x7f.1", "127.1",
                                  "127.0.0.2"])
def test_loopback_is_refused_and_never_connected_to(server, host):
    """Every spelling of a loopback address is refused on the address it resolves to, before any connection."""
    before = len(server.requests)
    with pytest.raises(MediaError, match="resolves to loopback address"):
        load(OPEN, server.url("/a.png", host))
    assert len(server.requests) == before


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/a.png",
                                 "http://192.168.0.1/a.png", "http://[fe80::1]/a.png", "http://100.100.100.200/"])
def test_private_and_link_local_are_refused_without_a_connection(url):
    refused(OPEN, url, "resolves to")


def test_allow_listed_host_is_fetched(server):
    server.requests.clear()
    assert load(LISTED, server.url("/a.png")) == IMAGE
    assert server.requests == ["/a.png"]


def test_only_listed_hosts_when_a_list_is_set(server):
    before = len(server.requests)
    refused(LISTED, server.url("/a.png", "localhost"), "not in this server's --allowed-media-domains")
    refused(LISTED, "http://example.com/a.png", "not in this server's --allowed-media-domains")
    assert len(server.requests) == before


def test_every_redirect_hop_is_checked(server):
    """An allowed host that redirects to a refused one: the second hop is never connected to."""
    other = MediaServer({"/a.png": IMAGE})
    try:
        refused(LISTED, server.url("/redirect?to=" + other.url("/a.png", "localhost")), "allowed-media-domains")
        refused(OPEN.__class__(allow_media_urls=True, allowed_media_domains=("localhost",)),
                other.url("/redirect?to=" + server.url("/a.png", "127.0.0.1"), "localhost"), "allowed-media-domains")
        assert other.requests == ["/redirect?to=" + server.url("/a.png", "127.0.0.1")]
        assert load(LISTED, server.url("/redirect?to=/a.png")) == IMAGE  # a relative hop to an allowed host
    finally:
        other.close()


def test_redirect_limit(server):
    url = server.url("/a.png")
    for _ in range(3):
        url = server.url("/redirect?to=" + url.replace("?", "%3F").replace("&", "%26"))
    refused(LISTED, url, "more than 2 redirect")


def test_byte_cap_by_length_and_while_reading(server):
    refused(LISTED, server.url("/huge?bytes=2000000"), "more than the 524288 bytes|is 2000000 bytes")
    refused(LISTED, server.url("/huge?bytes=2000000&chunked=1"), "more than the 524288 bytes")


def test_timeout(server):
    impatient = HttpConfig(allow_media_urls=True, allowed_media_domains=("127.0.0.1",), media_fetch_timeout_s=1.0)
    refused(impatient, server.url("/slow?s=5"), "took longer than 1 s")


def test_local_files_only_under_the_allowed_directory(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(IMAGE)
    (root / "sub").mkdir()
    (root / "sub" / "b.png").write_bytes(IMAGE)
    outside = tmp_path / "secret.png"
    outside.write_bytes(b"secret")
    os.symlink(outside, root / "link.png")
    os.symlink(tmp_path, root / "up")
    config = HttpConfig(allowed_local_media_path=str(root))

    assert load(config, f"file://{root}/a.png") == IMAGE
    assert load(config, f"file://{root}/sub/b.png") == IMAGE
    refused(HttpConfig(), f"file://{root}/a.png", "--allowed-local-media-path")
    refused(config, f"file://{outside}", "outside the directory")
    refused(config, f"file://{root}/sub/../../secret.png", r"\.\. are refused")
    refused(config, f"file://{root}/link.png", "outside the directory")  # a symlink out
    refused(config, f"file://{root}/up/secret.png", "outside the directory")  # a directory symlink out
    refused(config, f"file://{root}%2F..%2Fsecret.png", r"\.\. are refused|outside")
    refused(config, "file:///etc/passwd", "outside the directory")
    refused(config, f"file://otherhost{root}/a.png", "not host")
    refused(config, f"file://{root}/missing.png", "cannot read")
    # A directory under the root is the client's mistake (a 400 naming it), not an IsADirectoryError.
    refused(config, f"file://{root}/sub", "is a directory, not an image file")
    refused(config, f"file://{root}/", "is a directory")
    os.mkfifo(root / "pipe.png")  # opened without blocking, refused before it is read
    refused(config, f"file://{root}/pipe.png", "not a regular file")


def test_config_checks_hosts_and_directory(tmp_path):
    with pytest.raises(ConfigError, match="allowed_media_domains"):
        HttpConfig(allowed_media_domains=("127.0.0.1:8080",))
    with pytest.raises(ConfigError, match="not a directory"):
        HttpConfig(allowed_local_media_path=str(tmp_path / "nope"))
    assert HttpConfig(allowed_media_domains=("images.example.com", "::1", "10.0.0.7")).allowed_media_domains
