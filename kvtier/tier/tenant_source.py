"""Where a request's tenant comes from, and what that makes of quotas.

A quota separates tenants only where a client cannot choose its tenant: an API key's, a
header the operator's router sets, or a cache_salt the router sets (`kv_tenant_from`
"cache_salt"). A tenant a client may mint per request is never over its quota, so the
neighbour just over its own loses blocks first: the quota turned against its victim. So
without one of those, every request is one tenant and quotas bound all clients together;
the startup log says which rule is in force.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from kvtier.errors import ConfigError


class TenantSource(str, enum.Enum):
    """`kv_tenant_from`: what names a request's tenant where no API key or router header
    does."""

    NONE = "none"  # every such request is one tenant: quotas bound all clients together
    CACHE_SALT = "cache_salt"  # its cache_salt, which the operator's router sets

    @classmethod
    def parse(cls, text: str) -> TenantSource:
        try:
            return cls(text)
        except ValueError:
            raise ConfigError(
                f"kv_tenant_from={text!r} is not one of {', '.join(s.value for s in cls)}: "
                "'cache_salt' only where your router sets each request's cache_salt and "
                "clients cannot") from None


def request_tenant(source: TenantSource, cache_salt: str | None, named: str = "") -> str:
    """A request's tenant: `named`, the one its API key or the router's header names, else
    as `source` says ("" for the one tenant)."""
    if named:
        return named
    return (cache_salt or "") if source is TenantSource.CACHE_SALT else ""


def tenant_rule(source: TenantSource, named: Iterable[str], quota_set: bool,
                authenticated_by: str | None = None) -> tuple[str, bool]:
    """The startup log's line on who the tenants are, and whether it is a warning (quotas
    set that cannot separate clients). `named`: the tenants `kv_tenant_quotas` names;
    `authenticated_by`: what names tenants instead of `source` ("API keys", "the X-Tenant
    header"), if anything. Named quotas that no tenant can ever match: a ConfigError."""
    named = sorted(named)
    if authenticated_by is not None:
        return f"kvtier tenants: named by {authenticated_by}; quotas apply per tenant", False
    if source is TenantSource.CACHE_SALT:
        return ("kvtier tenants: each request's cache_salt (kv_tenant_from=cache_salt); quotas "
                "separate tenants only if your router sets cache_salt and clients cannot",
                False)
    if named:
        raise ConfigError(
            f"kv_tenant_quotas names {', '.join(map(repr, named))}, but nothing names a "
            "request's tenant, so no request would ever be one of them: authenticate (API "
            "keys, or a tenant header your router sets), or set kv_tenant_from=cache_salt if "
            "your router sets each request's cache_salt and clients cannot")
    if quota_set:
        return ("kvtier tenants: none are told apart (no API keys, no tenant header, "
                "kv_tenant_from=none): every request is one tenant, so kv_tenant_quota bounds "
                "all clients together and separates none", True)
    return ("kvtier tenants: none are told apart (no API keys, no tenant header, "
            "kv_tenant_from=none); quotas would bound all clients together", False)
