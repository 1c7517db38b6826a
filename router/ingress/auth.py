"""Bearer tokens: data-plane authentication, the admin token, and `kvroute token issue`.

Two kinds of data-plane token, both sent as `Authorization: Bearer <token>`:

- static: listed in a file or an environment variable, each optionally with a tenant,
  and a flow control class (`priority=CLASS`, `trusted=true` to let it raise its class
  with the priority header) that counts when the tenant's config sets none;
- signed: `kvr1.<claims>.<mac>`, where claims is base64url(JSON {"tnt", "iat", "exp"})
  and mac is base64url(HMAC-SHA256(key, "kvr1." + claims)). It is valid while
  iat - 60 s <= now < exp, and only if exp - iat <= 12 hours: a longer-lived token is
  refused even when the key signed it, so a leaked token is useful for half a day at
  most. The tenant it carries becomes the request's tenant (routing isolation, per-
  tenant caps and metrics); a client cannot choose it.

Checks are constant-time (`hmac.compare_digest`): the presented token's SHA-256 digest
is compared with every static token's digest, never stopping early, and a signature,
as text, with the expected one's encoding. A token has exactly one valid spelling:
strict base64url, no padding, no stray bits or characters, nothing after the MAC.
Tokens are never logged, and error messages never repeat them.
Secrets are read once per (re)load; `Authenticator.adopt` swaps them in one step.
Cost per request: one SHA-256 and one comparison per static token, or one HMAC.

The request's tenant (`Authenticator.tenant`) with auth on is the token's; only for a
token that names none, the `tenant_header`'s, and only if `auth.tenant_header_trusted`
says a gateway in front sets that header. So a client cannot choose another tenant's
concurrency cap, nor share its prefix namespace to time its cache. With auth off every
client is trusted alike: the header is the client's word, as it always was.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import re
import sys
import time

import msgspec

from router.config import (
    PRIORITIES,
    TENANT_PATTERN,
    AdminConfig,
    AuthConfig,
    ConfigError,
    TokenClass,
    load,
)
from router.errors import BadRequest, Unauthorized
from router.jobs.store import TOKEN_OWNER
from router.secrets import read_secret

MAX_LIFETIME = 12 * 3600
MIN_KEY_BYTES = 32
_PREFIX = "kvr1"
_CLOCK_SKEW = 60
_TENANT = re.compile(TENANT_PATTERN)
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")
#: what a token's jobs namespace digests beside it (no other digest of it matches)
_OWNER_SALT = b"kvroute jobs owner\0"


class _Claims(msgspec.Struct, forbid_unknown_fields=True):
    tnt: str
    iat: int
    exp: int


_DECODE_CLAIMS = msgspec.json.Decoder(_Claims)
_ENCODE = msgspec.json.Encoder()


def _bytes(text: str) -> bytes:
    """`text` as the bytes that came: a header's bytes that are not UTF-8 arrive as
    surrogates (aiohttp's decoding), which plain `encode` refuses with a crash."""
    return text.encode("utf-8", "surrogateescape")


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    """The bytes `text` spells in strict unpadded base64url; ValueError for any other
    spelling (padding, other characters, stray low bits): Python's decoder alone would
    take several spellings of one value, and skip what follows a padding."""
    if not _BASE64URL.fullmatch(text):
        raise ValueError("not base64url")
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64(raw) != text:
        raise ValueError("not the canonical encoding")
    return raw


def _mac(key: bytes, claims: str) -> bytes:
    return hmac.new(key, _bytes(f"{_PREFIX}.{claims}"), hashlib.sha256).digest()


def issue(key: bytes, tenant: str, ttl: int, now: float | None = None) -> str:
    """A signed token for `tenant`, valid `ttl` seconds (at most 12 hours)."""
    if not 0 < ttl <= MAX_LIFETIME:
        raise ValueError(f"ttl must be 1..{MAX_LIFETIME} seconds, got {ttl}")
    if not _TENANT.fullmatch(tenant):
        raise ValueError("tenant must be 1-64 characters of A-Z a-z 0-9 . _ : -")
    _check_key(key)
    iat = int(time.time() if now is None else now)
    claims = _b64(_ENCODE.encode(_Claims(tenant, iat, iat + ttl)))
    return f"{_PREFIX}.{claims}.{_b64(_mac(key, claims))}"


def verify(key: bytes, token: str, now: float | None = None) -> str:
    """The tenant of a valid signed token; raises Unauthorized otherwise."""
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != _PREFIX:
        raise Unauthorized("Invalid bearer token.")
    # the MAC's one encoding, compared as bytes: no decoding of what the client sent
    if not hmac.compare_digest(_bytes(parts[2]), _b64(_mac(key, parts[1])).encode()):
        raise Unauthorized("Invalid bearer token.")
    try:
        claims = _DECODE_CLAIMS.decode(_unb64(parts[1]))
    except (ValueError, msgspec.DecodeError):  # signed by our key, so ours, but malformed
        raise Unauthorized("Invalid bearer token.") from None
    now = time.time() if now is None else now
    if claims.exp - claims.iat > MAX_LIFETIME or claims.iat > now + _CLOCK_SKEW:
        raise Unauthorized("Invalid bearer token: lifetime over 12 hours.")
    if now >= claims.exp:
        raise Unauthorized("The bearer token has expired.")
    if not _TENANT.fullmatch(claims.tnt):
        raise Unauthorized("Invalid bearer token.")
    return claims.tnt


def _check_key(key: bytes) -> None:
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the signing key must have at least {MIN_KEY_BYTES} bytes")


def _digest(token: str) -> bytes:
    return hashlib.sha256(_bytes(token)).digest()


#: a static token's entry: its digest, tenant and class
_Static = tuple[bytes, str | None, TokenClass | None]
_LINE = "auth: a static token line is `TOKEN [TENANT] [priority=CLASS] [trusted=true|false]`"


def _static_tokens(cfg: AuthConfig) -> list[_Static]:
    lines: list[str] = []
    if cfg.tokens_file is not None:
        lines += read_secret(cfg.tokens_file, None, "auth.tokens_file").splitlines()
    if cfg.tokens_env is not None:
        lines += read_secret(None, cfg.tokens_env, "auth.tokens_env").split(",")
    tokens = []
    for line in lines:
        fields = line.split("#", 1)[0].split()
        if fields:
            tokens.append(_static_line(fields))
    return tokens


def _static_line(fields: list[str]) -> _Static:
    """One static token line's entry; ConfigError (never naming the token) if malformed.
    A tenant id has no `=`, so the optional fields cannot be taken for one."""
    token, rest = fields[0], fields[1:]
    tenant = rest.pop(0) if rest and "=" not in rest[0] else None
    if tenant is not None and not _TENANT.fullmatch(tenant):
        raise ConfigError(_LINE)
    options = dict(field.partition("=")[::2] for field in rest)
    if len(options) != len(rest) or not options.keys() <= {"priority", "trusted"}:
        raise ConfigError(_LINE)
    priority, trusted = options.get("priority"), options.get("trusted", "false")
    if (priority is not None and priority not in PRIORITIES) or trusted not in ("true", "false"):
        raise ConfigError(f"{_LINE}, CLASS one of {', '.join(PRIORITIES)}")
    if priority is None and trusted == "true":
        raise ConfigError("auth: a static token with trusted=true needs a priority=")
    token_class = TokenClass(priority, trusted == "true") if priority is not None else None
    return _digest(token), tenant, token_class


def _signing_key(cfg: AuthConfig) -> bytes | None:
    if cfg.signing_key_file is None and cfg.signing_key_env is None:
        return None
    key = read_secret(cfg.signing_key_file, cfg.signing_key_env, "auth signing key").encode()
    try:
        _check_key(key)
    except ValueError as exc:
        raise ConfigError(f"auth: {exc}") from None
    return key


class Authenticator:
    """The data plane's token check; `adopt` swaps in a reloaded one's secrets."""

    __slots__ = ("_key", "_static", "_trust_header", "enabled", "tenants")

    def __init__(self, cfg: AuthConfig) -> None:
        """Read the secrets `cfg` names; ConfigError if one is missing or malformed."""
        self.enabled = cfg.enabled
        self._static = _static_tokens(cfg) if cfg.enabled else []
        self._key = _signing_key(cfg) if cfg.enabled else None
        self._trust_header = cfg.tenant_header_trusted
        #: the tenants static tokens name: known ones, which metrics show by name
        self.tenants = frozenset(tenant for _, tenant, _ in self._static if tenant is not None)

    def adopt(self, other: Authenticator) -> None:
        self.enabled, self._static, self._key = other.enabled, other._static, other._key
        self._trust_header, self.tenants = other._trust_header, other.tenants

    def tenant(self, authorization: str | None, claimed: str | None) -> str | None:
        """The request's tenant, given its Authorization header and the tenant it claims
        (its `tenant_header`): see the module's docstring. Raises Unauthorized when auth
        is on and the token is missing, malformed or invalid, BadRequest when the claim
        counts and is not a tenant id."""
        return self.identify(authorization, claimed)[0]

    def identify(
        self, authorization: str | None, claimed: str | None
    ) -> tuple[str | None, TokenClass | None]:
        """The request's tenant (as `tenant`) and its static token's class, if any."""
        if not self.enabled:
            return _claim(claimed), None
        tenant, token_class = self._identity(authorization)
        if tenant is None and self._trust_header:
            return _claim(claimed), token_class
        return tenant, token_class

    def owner(self, authorization: str | None, claimed: str | None) -> str | None:
        """Whose jobs, files and batches a request sees: its tenant, else (auth on, a
        token that names none) the token's own namespace: a digest of it that no tenant
        id can spell, so tokens without a tenant never share one. With auth off: the
        tenant, or None for every client alike."""
        tenant = self.tenant(authorization, claimed)
        if tenant is not None or not self.enabled:
            return tenant
        digest = hashlib.sha256(_OWNER_SALT + _bytes(bearer(authorization))).hexdigest()
        return f"{TOKEN_OWNER}{digest[:32]}"

    def knows(self, token: str) -> bool:
        """Is `token` one of the static data-plane tokens? (The admin token must not be.)"""
        return self._match(token)[0]

    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant of the request's bearer token (None if it carries none).

        Raises Unauthorized when the header is missing, malformed or the token invalid.
        """
        return self._identity(authorization)[0]

    def _identity(self, authorization: str | None) -> tuple[str | None, TokenClass | None]:
        """`authenticate`'s tenant, and the static token's class."""
        token = bearer(authorization)
        if token.startswith(_PREFIX + ".") and self._key is not None:
            return verify(self._key, token), None
        matched, tenant, token_class = self._match(token)
        if not matched:
            raise Unauthorized("Invalid bearer token.")
        return tenant, token_class

    def _match(self, token: str) -> tuple[bool, str | None, TokenClass | None]:
        """Whether `token` is a static token, its tenant and its class."""
        digest, matched, found, found_class = _digest(token), False, None, None
        for known, tenant, token_class in self._static:
            if hmac.compare_digest(digest, known):  # no early exit: same time for all
                matched, found, found_class = True, tenant, token_class
        return matched, found, found_class


class AdminToken:
    """The admin API's bearer token: it opens the admin API and, with auth on,
    /debug/routing, and no data-plane token opens them. Read once at start (the admin
    section waits for a restart), in every worker, since each serves /debug/routing."""

    __slots__ = ("_digest", "token")

    def __init__(self, cfg: AdminConfig) -> None:
        """Read the token `cfg` names; ConfigError if it cannot be read."""
        self.token = read_secret(cfg.token_file, cfg.token_env, "admin token")
        self._digest = _digest(self.token)

    def check(self, authorization: str | None) -> None:
        """Raises Unauthorized unless the `Authorization` header carries this token."""
        if not hmac.compare_digest(_digest(bearer(authorization)), self._digest):
            raise Unauthorized("Invalid admin token.")


def _claim(claimed: str | None) -> str | None:
    """A claimed tenant, which must be a tenant id as a token's is: it names admission
    slots, salts fingerprints and labels metrics, so any bytes a client sends (non-UTF-8,
    unbounded) are refused."""
    if claimed is None or _TENANT.fullmatch(claimed):
        return claimed
    raise BadRequest("The tenant must be 1-64 characters of A-Z a-z 0-9 . _ : -.")


def bearer(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` header; Unauthorized if none."""
    if not authorization:
        raise Unauthorized("Missing bearer token: send `Authorization: Bearer <token>`.")
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("Malformed Authorization header: expected `Bearer <token>`.")
    return token


def main(argv: list[str]) -> int:
    """`kvroute token issue`: print a signed data-plane token."""
    parser = argparse.ArgumentParser(prog="kvroute token", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("issue", help="print a signed token for a tenant")
    p.add_argument("--tenant", required=True, metavar="ID", help="tenant id carried by the token")
    p.add_argument(
        "--ttl",
        type=int,
        default=3600,
        metavar="SECONDS",
        help=f"lifetime in seconds, at most {MAX_LIFETIME}",
    )
    key = p.add_mutually_exclusive_group(required=True)
    key.add_argument("-c", "--config", metavar="FILE", help="take the key the config names")
    key.add_argument("--key-file", metavar="FILE", help="file holding the signing key")
    key.add_argument(
        "--key-env", metavar="VAR", help="environment variable holding the signing key"
    )
    args = parser.parse_args(argv)
    try:
        if args.config:
            auth = load(args.config).auth
            if auth.signing_key_file is None and auth.signing_key_env is None:
                raise ConfigError(f"{args.config}: auth has no signing_key_file or _env")
            secret = read_secret(auth.signing_key_file, auth.signing_key_env, "signing key")
        else:
            secret = read_secret(args.key_file, args.key_env, "signing key")
        print(issue(secret.encode(), args.tenant, args.ttl))
    except (ConfigError, ValueError) as exc:
        print(f"kvroute token: {exc}", file=sys.stderr)
        return 2
    return 0
