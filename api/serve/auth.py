"""API keys: who may use the OpenAI endpoints, and which tenant each request belongs to.

`kvproof serve --api-key KEY` (repeatable) or `--api-key-file FILE` (one key per line; a
file keeps keys out of `ps` and shell history) turns keys on. Every OpenAI endpoint
(`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/v1/models/{id}`) then wants
`Authorization: Bearer KEY`: a request without one, or with a key the server was not given,
is answered 401 with OpenAI's error body (type `invalid_request_error`, code
`invalid_api_key`, as OpenAI answers a wrong key) before its body is read, and nothing of it
reaches the engine. Without keys every request is let through, as before.

The operator's endpoints stay open: `/health` (a load balancer's probe has no key),
`/metrics` (a scraper's), the dashboard and `/v1/kvproof/state`. None holds a tenant's
prompt or output, and the server binds 127.0.0.1 unless told otherwise; vLLM's `--api-key`
draws the same line (its key guards the OpenAI routes).

Each key is a tenant, named by a digest of the key (`tenant-` and 12 hex digits of its
SHA-256), never by the key: a tenant's name may reach logs and metric labels (the prefix
cache's figures per tenant, api/serve/metrics.py). The tenant is what the prefix cache
(issue 28) salts its pages with, so that two keys never share a page unless the operator
says so; until the engine caches prefixes nothing is shared at all.

Keys are looked up by their SHA-256 digest, so a lookup takes the same time whichever key
is tried and how much of it matches.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from api.clikit import UsageError
from api.serve.errors import ApiError

# The routes a key guards: OpenAI's. Everything else is the operator's.
GUARDED_PREFIXES = ("/v1/completions", "/v1/chat/completions", "/v1/models")
KEY_LENGTH_MAX = 512
KEYS_MAX = 10_000
TENANT_SCOPE = "kvproof.tenant"  # the scope key a guarded request's tenant is kept under


@dataclass(frozen=True)
class ApiKeys:
    """The keys a server takes, by digest, each with its tenant's name."""

    tenants: dict[bytes, str]

    def __post_init__(self):
        assert 0 < len(self.tenants) <= KEYS_MAX, len(self.tenants)

    @classmethod
    def of(cls, keys: list[str]) -> ApiKeys:
        return cls({_digest(key): tenant_of(key) for key in keys})

    def tenant(self, key: str) -> str | None:
        return self.tenants.get(_digest(key))


def tenant_of(key: str) -> str:
    return "tenant-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def check_key(key: str, where: str) -> str:
    """A key as given on the command line or in a file: a usage error names what is wrong
    (never the key itself: an error line may be logged)."""
    if not key:
        raise UsageError(f"{where}: an API key cannot be empty")
    if len(key) > KEY_LENGTH_MAX:
        raise UsageError(f"{where}: an API key is at most {KEY_LENGTH_MAX} characters, "
                         f"this one has {len(key)}")
    if any(c.isspace() or not c.isprintable() for c in key):
        raise UsageError(f"{where}: an API key cannot hold spaces or control characters")
    return key


def load_keys(keys: list[str] | None, files: list[str] | None) -> ApiKeys | None:
    """The keys of `--api-key` and of each `--api-key-file` (one per line; blank lines and
    lines starting with # are skipped), or None when neither was given."""
    if not keys and not files:
        return None
    found = [check_key(key, "--api-key") for key in keys or ()]
    for name in files or ():
        in_file = _keys_in(Path(name))
        if not in_file:
            raise UsageError(f"--api-key-file {name}: no key in the file (one key per line)")
        found += in_file
    if len(set(found)) > KEYS_MAX:
        raise UsageError(f"at most {KEYS_MAX} API keys, got {len(set(found))}")
    return ApiKeys.of(found)


def _keys_in(path: Path) -> list[str]:
    where = f"--api-key-file {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{where}: is a folder, not a file of keys") from None
    except UnicodeDecodeError:
        raise UsageError(f"{where}: not a text file (UTF-8)") from None
    except OSError as error:
        raise UsageError(f"{where}: cannot be read ({error.strerror})") from None
    lines = [line.strip() for line in text.splitlines()]
    return [check_key(line, f"{where}, line {number}")
            for number, line in enumerate(lines, 1) if line and not line.startswith("#")]


class RequireApiKey:
    """ASGI middleware: a guarded route without a known bearer key gets 401 before its body
    is read; a known key's tenant is kept in the scope (`TENANT_SCOPE`). `on_refused` is
    told the scope of each refused request (for the metrics)."""

    def __init__(self, app, keys: ApiKeys, on_refused=None):
        self.app, self.keys, self.on_refused = app, keys, on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(GUARDED_PREFIXES):
            return await self.app(scope, receive, send)
        key = bearer_key(scope)
        tenant = self.keys.tenant(key) if key else None
        if tenant is None:
            return await self._refuse(scope, send, "no API key given (send it as "
                                      "'Authorization: Bearer KEY')" if key is None else
                                      "the API key given is not one this server takes")
        scope[TENANT_SCOPE] = tenant
        return await self.app(scope, receive, send)

    async def _refuse(self, scope, send, message: str) -> None:
        if self.on_refused is not None:
            self.on_refused(scope)
        error = ApiError(401, message, code="invalid_api_key")
        body = json.dumps(error.body()).encode()
        # The body is never read: the connection cannot carry another request.
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="kvproof"'), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def bearer_key(scope) -> str | None:
    """The key of an `Authorization: Bearer KEY` header; "" for a header of another scheme
    or an empty key; None without the header."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").strip().partition(" ")
            return key.strip() if scheme.lower() == "bearer" else ""
    return None
