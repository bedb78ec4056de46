"""Log lines an operator can read and a log shipper can parse: one line per event, each naming the
role replica (``router-4``) and the request it concerns, as text or as JSON (``--log-format``).

Every process of a deployment runs ``setup_worker`` when Ray starts it (the job's
``worker_process_setup_hook``); the settings travel in the environment (``EPD_LOG_FORMAT``,
``EPD_LOG_LEVEL``). A request's id is a context variable (``REQUEST_ID``) that the fronts set, so
everything logged while serving it carries it. Library fallback warnings (transformers' "falling
back to its reference PyTorch implementation", one per kernel) become one line per process.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("epd_request_id", default="")
FORMATS = ("text", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMAT_ENV, LEVEL_ENV, ROLE_ENV = "EPD_LOG_FORMAT", "EPD_LOG_LEVEL", "EPD_ROLE"
REQUEST_ID_KEY = "x-epd-request-id"
"""gRPC metadata that carries a request's one public id (``REQUEST_ID``) on every call between
roles, so prefill's, decode's and the encoder's lines about it name the id the router's do, on
every attempt (the internal per-attempt ids differ; a resumed request keeps this one)."""
FIELDS = "epd_fields"
"""``extra={FIELDS: {...}}`` on a record: structured fields (the access line's), top-level keys in
JSON, ``key=value`` after the message in text."""
SETUP_HOOK = "epd.logs.setup_worker"
_KERNEL_FALLBACK = "falling back to its reference PyTorch implementation"


class _Context(logging.Filter):
    """Adds ``role`` (the replica's name, or the process's part) and ``request_id`` to every record."""

    def __init__(self, role: str = "") -> None:
        super().__init__()
        self._role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.role()
        record.request_id = REQUEST_ID.get()
        return True

    def role(self) -> str:
        if not self._role:
            self._role = os.environ.get(ROLE_ENV, "") or _ray_actor_name()
        return self._role or "driver"


def role_name() -> str:
    """This process's part as its log lines name it: ``EPD_ROLE``, else the Ray actor it hosts
    (``prefill-2``), else ``driver``."""
    return _Context().role()


def _ray_actor_name() -> str:
    """The Ray actor this process hosts (``router-4``), once Ray has made it; '' before."""
    if "ray" not in sys.modules:
        return ""
    try:
        import ray

        context = ray.get_runtime_context()
        return context.get_actor_name() or ""
    except Exception:  # noqa: BLE001 - not in a Ray worker, or not yet an actor
        return ""


def safe_id(text: str) -> str:
    """A client's request id as logs and metadata may carry it: printable ASCII (anything else
    escaped, so no id can forge a log line or break a call's metadata), at most 200 characters."""
    text = text[:200]
    return text if text.isascii() and text.isprintable() else text.encode("unicode_escape").decode("ascii")[:400]


def with_request_id(metadata: tuple = ()) -> tuple:
    """``metadata`` plus the current request's id (when one is set): what a call between roles sends."""
    request_id = REQUEST_ID.get()
    return (*metadata, (REQUEST_ID_KEY, request_id)) if request_id else tuple(metadata)


def request_id_of(metadata) -> str:
    """The request id a caller sent (``with_request_id``), printable and at most 200 characters; '' if none."""
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY:
            value = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            return value[:200] if value.isprintable() else ""
    return ""


def _fields_text(record: logging.LogRecord) -> str:
    fields = getattr(record, FIELDS, None) or {}
    return "".join(f" {key}={value}" for key, value in fields.items())


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        request = f" [{record.request_id}]" if getattr(record, "request_id", "") else ""
        text = (f"{when} {record.levelname} {getattr(record, 'role', '-')}{request} {record.name}: "
                f"{record.getMessage()}{_fields_text(record)}")
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                 "level": record.levelname, "role": getattr(record, "role", ""),
                 "request_id": getattr(record, "request_id", ""), "logger": record.name,
                 "message": record.getMessage()}
        for key, value in (getattr(record, FIELDS, None) or {}).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def json_line(message: str, level: str = "INFO", role: str = "epd", logger: str = "epd", **fields) -> str:
    """One line in ``JsonFormatter``'s shape, for what a command prints itself (``epd ready at ...``)
    and for output that did not come through logging (``control.local.json_worker_output``)."""
    now = time.time()
    entry = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z",
             "level": level, "role": role, "request_id": "", "logger": logger, "message": message, **fields}
    return json.dumps(entry, ensure_ascii=False)


def say(message: str, stream=None, level: str = "INFO", fmt: str | None = None) -> None:
    """Print one of the command's own lines (``epd ready at HOST:PORT``) on ``stream`` (stdout):
    as it is in text, as a ``json_line`` when the log format is json, so every line parses."""
    fmt = fmt or os.environ.get(FORMAT_ENV, "text")
    print(json_line(message, level) if fmt == "json" else message, file=stream or sys.stdout, flush=True)


class _OncePerProcess(logging.Filter):
    """transformers warns once per kernel that it uses its reference implementation; say it once
    per process, in our format, and drop the rest."""

    said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if _KERNEL_FALLBACK not in record.getMessage():
            return True
        if not _OncePerProcess.said:
            _OncePerProcess.said = True
            logging.getLogger("epd.kernels").warning(
                "transformers runs its reference PyTorch kernels (causal-conv1d and flash-linear-attention are not "
                "installed): correct, slower")
        return False


def configure(level: str = "INFO", fmt: str = "text", role: str = "", stream=None) -> None:
    """Route this process's logging through one handler in ``fmt``; idempotent."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_epd", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._epd = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_Context(role))
    root.addHandler(handler)
    root.setLevel(level if level in LEVELS else "INFO")
    if fmt == "json":
        logging.captureWarnings(True)  # a library's warnings.warn is a JSON line too, not raw stderr
    kernels = logging.getLogger("transformers.integrations.hub_kernels")
    if not any(isinstance(f, _OncePerProcess) for f in kernels.filters):
        kernels.addFilter(_OncePerProcess())
    for noisy in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # its start/stop chatter, not events
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook`` for every process of a deployment."""
    configure(os.environ.get(LEVEL_ENV, "INFO"), os.environ.get(FORMAT_ENV, "text"))


def runtime_env(fmt: str, level: str) -> dict:
    """The Ray job's runtime environment that carries the log settings to every process it starts."""
    return {"worker_process_setup_hook": SETUP_HOOK, "env_vars": {FORMAT_ENV: fmt, LEVEL_ENV: level}}
