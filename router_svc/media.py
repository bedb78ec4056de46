"""Images and clips named by URL in an HTTP request: ``data:`` URLs, ``http(s)://`` URLs the router fetches
(only with ``allow_media_urls``), and ``file://`` paths under ``allowed_local_media_path``.

Fetching a URL for a client is a server-side request forgery risk (vLLM's CVE-2025-6242, and its
bypass CVE-2026-24779). The rules here:
- the host is resolved once per hop, and the connection goes to the address that was checked
  (HTTPS still verifies the certificate against the host name), so DNS rebinding between the
  check and the connection is moot;
- every address a host resolves to must be a public (globally routable) unicast address; a host
  that resolves to any private, loopback, link-local, shared, multicast or reserved address is
  refused (IPv4-mapped IPv6 checked as IPv4), unless the operator listed that host in
  ``allowed_media_domains``; when that list is set, hosts not on it are refused outright;
- redirects are followed by hand, at most ``media_max_redirects``, each hop checked like the
  first (scheme, host, addresses);
- one deadline for the whole fetch, redirects included, and a byte cap checked on the
  Content-Length and while reading.
Local files: the real path (symlinks and ``..`` resolved) of what was actually opened must lie
under the allowed directory; a path with a ``..`` component is refused before anything is opened.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import ssl
import stat
import urllib.parse

import h11

from epd import dataurl
from epd.config import HttpConfig


class MediaError(ValueError):
    """The image or video URL cannot be used (bad input: 400). The message says why, naming the kind."""


USER_AGENT = "epd-media-fetch/1"
DATA_OFF_LOOP_CHARS = 256 * 1024
"""A data: URL at least this long is decoded on the loop's executor (base64 of megabytes takes ms)."""


class MediaLoader:
    def __init__(self, config: HttpConfig) -> None:
        self.config = config
        self.max_bytes = int(config.media_max_mb * 1024 * 1024)
        self.allowed_hosts = {_host_key(host) for host in config.allowed_media_domains}
        self.local_root = os.path.realpath(config.allowed_local_media_path) if config.allowed_local_media_path else ""
        self._ssl = ssl.create_default_context()

    async def load(self, url: str, where: str, kind: str = "image") -> bytes:
        """The image (or, ``kind`` "video", clip) bytes ``url`` names; raises MediaError (prefixed with ``where``)."""
        if not isinstance(url, str) or not url:
            raise MediaError(f"{where}: {kind}_url.url must be a non-empty string")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        try:
            if scheme == "data":
                if len(url) < DATA_OFF_LOOP_CHARS:
                    return decode_data_url(url, kind)
                return await asyncio.get_running_loop().run_in_executor(None, decode_data_url, url, kind)  # off the loop
            if scheme in ("http", "https"):
                if not self.config.allow_media_urls:
                    raise MediaError(f"{kind} URLs are not fetched by this server (it was started without "
                                     f"--allow-media-urls); send the {kind} as a data: URL")
                async with asyncio.timeout(self.config.media_fetch_timeout_s):
                    return await self._fetch(url, kind)
            if scheme == "file":
                return await asyncio.get_running_loop().run_in_executor(None, self._read_local, url, kind)
        except TimeoutError:
            raise MediaError(f"{where}: fetching {_shown(url)} took longer than "
                             f"{self.config.media_fetch_timeout_s:g} s") from None
        except MediaError as error:
            raise MediaError(f"{where}: {error}") from None
        except (OSError, ssl.SSLError, h11.ProtocolError, UnicodeError) as error:
            # Whatever else reading the media ran into is still about the URL the client sent (a
            # directory, a file that vanished, an I/O error, a peer that hung up): a 400 saying why.
            reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
            raise MediaError(f"{where}: cannot read the {kind} at {_shown(url)}: {reason}") from None
        raise MediaError(f"{where}: {kind}_url.url must be a data:, http(s):// or file:// URL")

    # ------------------------------------------------------------ http(s)

    async def _fetch(self, url: str, kind: str = "image") -> bytes:
        for _ in range(self.config.media_max_redirects + 1):
            parts = self.check_url(url, kind)
            address = await self.check_host(parts.hostname, parts.port or _default_port(parts.scheme), kind)
            status, headers, body = await self._get(parts, address, kind)
            if status in (301, 302, 303, 307, 308):
                location = headers.get("location")
                if not location:
                    raise MediaError(f"{_shown(url)} answered HTTP {status} without a Location")
                url = urllib.parse.urljoin(url, location)
                continue
            if status != 200:
                raise MediaError(f"fetching {_shown(url)}: HTTP {status}")
            return body
        raise MediaError(f"fetching {_article(kind)} {kind} URL: more than {self.config.media_max_redirects} "
                         "redirect(s)")

    def check_url(self, url: str, kind: str = "image") -> urllib.parse.SplitResult:
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError as error:
            raise MediaError(f"{_shown(url)} is not a valid URL: {error}") from None
        if parts.scheme not in ("http", "https"):
            raise MediaError(f"{_shown(url)}: only http and https URLs are fetched")
        if not parts.hostname:
            raise MediaError(f"{_shown(url)} has no host")
        if parts.username is not None or parts.password is not None:
            raise MediaError(f"{kind} URLs with credentials in them are not fetched")
        if self.allowed_hosts and _host_key(parts.hostname) not in self.allowed_hosts:
            raise MediaError(f"host {parts.hostname} is not in this server's --allowed-media-domains")
        return parts

    async def check_host(self, host: str, port: int, kind: str = "image") -> str:
        """The address to connect to for ``host``: every address it resolves to must be allowed."""
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as error:
            raise MediaError(f"cannot resolve host {host}: {getattr(error, 'strerror', None) or error}") from None
        addresses = list(dict.fromkeys(info[4][0] for info in infos))
        if not addresses:
            raise MediaError(f"host {host} has no address")
        if _host_key(host) not in self.allowed_hosts:
            for address in addresses:
                reason = refused_address(address)
                if reason:
                    raise MediaError(f"host {host} resolves to {reason} address {address}; {kind} URLs may only "
                                     "name public hosts unless the host is in --allowed-media-domains")
        return addresses[0]

    async def _get(self, parts: urllib.parse.SplitResult, address: str,
                   kind: str = "image") -> tuple[int, dict[str, str], bytes]:
        port = parts.port or _default_port(parts.scheme)
        tls = {"ssl": self._ssl, "server_hostname": parts.hostname} if parts.scheme == "https" else {}
        try:
            reader, writer = await asyncio.open_connection(address, port, **tls)
        except (OSError, ssl.SSLError) as error:
            raise MediaError(f"cannot connect to {parts.hostname}:{port}: {getattr(error, 'strerror', None) or error}"
                             ) from None
        try:
            connection = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host = parts.netloc.rsplit("@", 1)[-1]
            request = h11.Request(method="GET", target=target, headers=[
                ("Host", host), ("User-Agent", USER_AGENT), ("Accept", f"{kind}/*"), ("Accept-Encoding", "identity"),
                ("Connection", "close")])
            writer.write(connection.send(request) + connection.send(h11.EndOfMessage()))
            await writer.drain()
            status, headers, body = 0, {}, bytearray()
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    connection.receive_data(data)
                    continue
                if isinstance(event, h11.Response):
                    status = event.status_code
                    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
                    length = headers.get("content-length", "")
                    if status == 200 and length.isdigit() and int(length) > self.max_bytes:
                        raise MediaError(f"the {kind} at {_shown(parts.geturl())} is {int(length)} bytes, more than "
                                         f"the {self.max_bytes} this server accepts")
                    if status != 200:
                        return status, headers, b""
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > self.max_bytes:
                        raise MediaError(f"the {kind} at {_shown(parts.geturl())} is more than the {self.max_bytes} "
                                         "bytes this server accepts")
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    return status, headers, bytes(body)
        except h11.RemoteProtocolError as error:
            raise MediaError(f"{parts.hostname} sent a broken HTTP response: {error}") from None
        except (OSError, ssl.SSLError) as error:
            raise MediaError(f"reading from {parts.hostname}: {getattr(error, 'strerror', None) or error}") from None
        finally:
            writer.close()

    # ------------------------------------------------------------ local files

    def _read_local(self, url: str, kind: str = "image") -> bytes:
        if not self.local_root:
            raise MediaError("local files are not read by this server (it was started without "
                             "--allowed-local-media-path)")
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError(f"file URLs name a path on this server, not host {parts.netloc!r}")
        path = urllib.parse.unquote(parts.path)
        if not path.startswith("/") or "\x00" in path:
            raise MediaError("file URLs need an absolute path")
        if ".." in path.split("/"):
            raise MediaError("file paths with .. are refused")
        if not _inside(os.path.realpath(path), self.local_root):
            raise MediaError(f"{path} is outside the directory this server reads media from")
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError as error:
            raise MediaError(f"cannot read {path}: {error.strerror}") from None
        try:
            # What was opened, not what the name pointed to a moment ago (a symlink swapped in between).
            opened = os.path.realpath(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else path
            if not _inside(opened, self.local_root):
                raise MediaError(f"{path} is outside the directory this server reads media from")
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                raise MediaError(f"{path} is a directory, not {_article(kind)} {kind} file")
            if not stat.S_ISREG(info.st_mode):
                raise MediaError(f"{path} is not a regular file")
            if info.st_size > self.max_bytes:
                raise MediaError(f"{path} is {info.st_size} bytes, more than the {self.max_bytes} this server accepts")
            with os.fdopen(fd, "rb") as f:
                fd = -1  # the file object owns it now
                return f.read(self.max_bytes + 1)
        except OSError as error:  # an I/O error while reading is the client's file's, not a 500
            raise MediaError(f"cannot read {path}: {error.strerror or error}") from None
        finally:
            if fd >= 0:
                os.close(fd)


def decode_data_url(url: str, kind: str = "image") -> bytes:
    try:
        return dataurl.decode_data_url(url, kind)
    except ValueError as error:
        raise MediaError(str(error)) from None


def refused_address(address: str) -> str:
    """Why ``address`` may not be fetched by default ('' when it may): the kind of address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for kind in ("loopback", "link_local", "multicast", "unspecified", "private", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    if not ip.is_global:
        return "non-public"
    return ""


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _host_key(host: str) -> str:
    host = host.strip("[]").lower().rstrip(".")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


def _shown(url: str) -> str:
    """A URL as it may appear in a message: no query string (it may carry a token), at most 200 chars."""
    shown = url.split("?", 1)[0]
    return shown if len(shown) <= 200 else shown[:200] + "..."


def _article(kind: str) -> str:
    return "an" if kind[:1] in "aeiou" else "a"
