"""Tokens: signed ones (issue/verify), static ones, the header, and `kvroute token issue`."""

from __future__ import annotations

import base64
import hashlib
import hmac
import string

import orjson
import pytest

from router.config import AuthConfig, ConfigError
from router.errors import BadRequest, Unauthorized
from router.ingress.auth import MAX_LIFETIME, Authenticator, bearer, issue, verify

KEY = b"k" * 32
NOW = 1_800_000_000


def _forge(claims: dict, key: bytes = KEY) -> str:
    """A token signed with `key` over arbitrary claims (what an attacker with the key,
    or a buggy issuer, could make)."""
    body = base64.urlsafe_b64encode(orjson.dumps(claims)).rstrip(b"=").decode()
    mac = hmac.new(key, f"kvr1.{body}".encode(), hashlib.sha256).digest()
    return f"kvr1.{body}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"


def _tamper_claims(token: str) -> str:
    prefix, body, mac = token.split(".")
    claims = orjson.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims["tnt"] = "mallory"
    forged = base64.urlsafe_b64encode(orjson.dumps(claims)).rstrip(b"=").decode()
    return f"{prefix}.{forged}.{mac}"


VALID = issue(KEY, "acme", 3600, now=NOW)
ALPHABET = string.ascii_letters + string.digits + "-_"


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _same_mac_other_spelling(token: str) -> str:
    """`token` with its MAC's last character changed in the bits base64 leaves unused:
    a lenient decoder reads the same MAC."""
    mac = token.rsplit(".", 1)[1]
    for c in ALPHABET:
        if c != mac[-1] and _unb64(mac[:-1] + c) == _unb64(mac):
            return token[:-1] + c
    raise AssertionError("a 32-byte MAC has unused bits in its last character")


@pytest.mark.parametrize(
    ("token", "now", "message"),
    [
        pytest.param(VALID, NOW + 3600, "expired", id="expired"),
        pytest.param(VALID, NOW + 99_999, "expired", id="long-expired"),
        pytest.param(_tamper_claims(VALID), NOW, "Invalid", id="tampered-claims"),
        pytest.param(VALID[:-2] + ("AA" if VALID[-2:] != "AA" else "BB"), NOW, "Invalid", id="sig"),
        pytest.param(issue(b"x" * 32, "acme", 60, now=NOW), NOW, "Invalid", id="other-key"),
        pytest.param(
            _forge({"tnt": "acme", "iat": NOW, "exp": NOW + MAX_LIFETIME + 1}),
            NOW,
            "12 hours",
            id="lifetime-over-12h",
        ),
        pytest.param(
            _forge({"tnt": "acme", "iat": NOW + 3600, "exp": NOW + 7200}),
            NOW,
            "12 hours",
            id="issued-in-the-future",
        ),
        pytest.param(_forge({"tnt": "a b", "iat": NOW, "exp": NOW + 60}), NOW, "Invalid", id="t"),
        pytest.param(_forge({"tnt": "acme", "iat": NOW}), NOW, "Invalid", id="missing-exp"),
        pytest.param("kvr1.abc", NOW, "Invalid", id="two-parts"),
        pytest.param("kvr2." + VALID[5:], NOW, "Invalid", id="wrong-version"),
        pytest.param("kvr1.!!!.???", NOW, "Invalid", id="not-base64"),
        pytest.param(VALID + "=", NOW, "Invalid", id="padded-mac"),
        pytest.param(VALID + "==", NOW, "Invalid", id="padded-twice"),
        pytest.param(VALID + "=junk", NOW, "Invalid", id="junk-after-padding"),
        pytest.param(VALID + "!", NOW, "Invalid", id="junk-after-mac"),
        pytest.param(_same_mac_other_spelling(VALID), NOW, "Invalid", id="stray-bits"),
        pytest.param(VALID + "\udcff", NOW, "Invalid", id="not-utf8-after-mac"),
        pytest.param("kvr1.\udcff." + VALID.split(".")[2], NOW, "Invalid", id="not-utf8-claims"),
    ],
)
def test_bad_signed_tokens_are_refused(token: str, now: int, message: str) -> None:
    with pytest.raises(Unauthorized, match=message) as info:
        verify(KEY, token, now=now)
    assert info.value.status == 401
    assert token not in info.value.message  # tokens are never echoed


def test_a_signed_token_has_exactly_one_valid_spelling() -> None:
    """Every one-character change, insertion or appendix of a valid token is refused."""
    spellings = {
        VALID[:i] + c + VALID[j:]
        for i in range(len(VALID) + 1)
        for j in (i, i + 1)
        for c in ALPHABET + "=.~ "
    }
    spellings.discard(VALID)
    for token in spellings:
        with pytest.raises(Unauthorized):
            verify(KEY, token, now=NOW)


def test_a_valid_signed_token_carries_its_tenant() -> None:
    assert verify(KEY, VALID, now=NOW) == "acme"
    assert verify(KEY, VALID, now=NOW + 3599) == "acme"
    long = issue(KEY, "acme", MAX_LIFETIME, now=NOW)
    assert verify(KEY, long, now=NOW + MAX_LIFETIME - 1) == "acme"


@pytest.mark.parametrize(
    ("key", "tenant", "ttl"),
    [
        pytest.param(KEY, "acme", MAX_LIFETIME + 1, id="ttl-over-12h"),
        pytest.param(KEY, "acme", 0, id="ttl-zero"),
        pytest.param(KEY, "not ok", 60, id="bad-tenant"),
        pytest.param(b"short", "acme", 60, id="short-key"),
    ],
)
def test_issue_refuses(key: bytes, tenant: str, ttl: int) -> None:
    with pytest.raises(ValueError):
        issue(key, tenant, ttl)


@pytest.mark.parametrize(
    ("header", "token"),
    [
        pytest.param("Bearer abc", "abc", id="bearer"),
        pytest.param("bearer  abc ", "abc", id="case-and-spaces"),
        pytest.param(None, None, id="missing"),
        pytest.param("", None, id="empty"),
        pytest.param("Basic abc", None, id="basic"),
        pytest.param("Bearer", None, id="no-token"),
        pytest.param("Bearer ", None, id="blank-token"),
    ],
)
def test_bearer_header(header: str | None, token: str | None) -> None:
    if token is None:
        with pytest.raises(Unauthorized):
            bearer(header)
    else:
        assert bearer(header) == token


def test_static_tokens_from_file_and_env(tmp_path, monkeypatch) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# team tokens\nalpha-token acme\nbeta-token   # no tenant\n\n")
    monkeypatch.setenv("KV_TOKENS", "gamma-token globex, delta-token")
    auth = Authenticator(AuthConfig(enabled=True, tokens_file=str(tokens), tokens_env="KV_TOKENS"))
    assert auth.authenticate("Bearer alpha-token") == "acme"
    assert auth.authenticate("Bearer beta-token") is None
    assert auth.authenticate("Bearer gamma-token") == "globex"
    assert auth.authenticate("Bearer delta-token") is None
    for wrong in ("Bearer alpha-token2", "Bearer alpha", "Bearer acme", "Bearer " + "x" * 5000):
        with pytest.raises(Unauthorized, match="Invalid bearer token"):
            auth.authenticate(wrong)


def test_signed_and_static_together(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KV_KEY", KEY.decode())
    monkeypatch.setenv("KV_TOKENS", "static-one")
    auth = Authenticator(AuthConfig(enabled=True, tokens_env="KV_TOKENS", signing_key_env="KV_KEY"))
    assert auth.authenticate("Bearer " + issue(KEY, "acme", 60)) == "acme"
    assert auth.authenticate("Bearer static-one") is None
    assert auth.knows("static-one") and not auth.knows("static-two")


@pytest.mark.parametrize(
    ("cfg", "env", "message"),
    [
        pytest.param({"tokens_env": "KV_UNSET"}, {}, "KV_UNSET is not set", id="env-unset"),
        pytest.param({"tokens_file": "/nonexistent/x"}, {}, "cannot read", id="file-missing"),
        pytest.param({"signing_key_env": "KV_KEY"}, {"KV_KEY": "short"}, "32 bytes", id="short"),
        pytest.param({"tokens_env": "KV_T"}, {"KV_T": "a b c"}, "static token line", id="bad-line"),
        pytest.param(
            {"tokens_env": "KV_T"}, {"KV_T": "a t priority=urgent"}, "CLASS one of", id="class"
        ),
        pytest.param(
            {"tokens_env": "KV_T"}, {"KV_T": "a trusted=true"}, "needs a priority", id="trust"
        ),
        pytest.param({"tokens_env": "KV_T"}, {"KV_T": "a t weight=2"}, "token line", id="key"),
    ],
)
def test_unusable_secrets_are_config_errors(cfg, env, message, monkeypatch) -> None:
    monkeypatch.delenv("KV_UNSET", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        Authenticator(AuthConfig(enabled=True, **cfg))


@pytest.mark.parametrize(
    ("trusted", "header", "claimed", "tenant"),
    [
        pytest.param(False, "Bearer alpha-token", "spoofed", "acme", id="token-tenant"),
        pytest.param(True, "Bearer alpha-token", "spoofed", "acme", id="token-tenant-wins"),
        pytest.param(False, "Bearer beta-token", "spoofed", None, id="untrusted-claim"),
        pytest.param(True, "Bearer beta-token", "gateway", "gateway", id="trusted-claim"),
        pytest.param(True, "Bearer beta-token", None, None, id="trusted-no-claim"),
    ],
)
def test_the_tenant_is_the_tokens_or_a_trusted_claim(
    tmp_path, trusted: bool, header: str, claimed: str | None, tenant: str | None
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alpha-token acme\nbeta-token\n")
    cfg = AuthConfig(enabled=True, tokens_file=str(tokens), tenant_header_trusted=trusted)
    assert Authenticator(cfg).tenant(header, claimed) == tenant


@pytest.mark.parametrize("claimed", ["a\udcff", "t" * 65, "", "two words"])
def test_a_claim_that_is_not_a_tenant_id_is_refused(tmp_path, claimed: str) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("beta-token\n")
    trusting = AuthConfig(enabled=True, tokens_file=str(tokens), tenant_header_trusted=True)
    for auth in (Authenticator(AuthConfig()), Authenticator(trusting)):
        with pytest.raises(BadRequest):
            auth.tenant("Bearer beta-token", claimed)


def test_with_auth_off_the_claim_is_the_tenant() -> None:
    auth = Authenticator(AuthConfig(enabled=False))
    assert auth.tenant(None, "anyone") == "anyone" and auth.tenant(None, None) is None


def test_disabled_auth_reads_nothing() -> None:
    auth = Authenticator(AuthConfig(enabled=False, tokens_env="KV_UNSET_TOO"))
    assert not auth.enabled


def test_token_issue_cli(tmp_path, monkeypatch, capsys) -> None:
    from router.__main__ import main

    monkeypatch.setenv("KV_KEY", KEY.decode())
    assert main(["token", "issue", "--tenant", "acme", "--ttl", "600", "--key-env", "KV_KEY"]) == 0
    token = capsys.readouterr().out.strip()
    assert verify(KEY, token) == "acme"
    config = tmp_path / "router.yaml"
    config.write_text(
        "backends: [{url: 'http://127.0.0.1:1'}]\nauth: {enabled: true, signing_key_env: KV_KEY}\n"
    )
    assert main(["token", "issue", "--tenant", "globex", "-c", str(config)]) == 0
    assert verify(KEY, capsys.readouterr().out.strip()) == "globex"
    assert main(["token", "issue", "--tenant", "acme", "--ttl", "90000", "--key-env", "KV_KEY"])
    assert "ttl" in capsys.readouterr().err
