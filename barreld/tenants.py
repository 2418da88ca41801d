"""Who a request belongs to: the tenants of an HTTP keys file, the Unix users of the socket, and which tenants an
operator lets share one namespace. Pure: the config reader checks a keys file here at start, and the front ends
turn an identity into the `Namespace` every cache key of the request is derived in.

A keys file holds one key a line: `NAME: KEY` puts KEY in tenant NAME (several keys may share a name), a bare
`KEY` is a tenant of its own, named `key:` and the first 8 hex digits of the key's SHA-256 (stable across
reorderings of the file; never the key). A socket peer other than the daemon's own user is tenant `uid:N`. The
daemon's user and a keyless HTTP listener are the default tenant, as every request was before tenants.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from barreld.cache.key import Namespace
from barreld.names import DEFAULT_TENANT, DEFAULT_TENANT_LABEL, tenant_label

PLAIN_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
SHARED_PREFIX = "shared:"


def uid_tenant(uid: int, owner: int) -> str:
    """The tenant of a socket peer: the daemon's own user is the default tenant, anyone else theirs."""
    return DEFAULT_TENANT if uid == owner else f"uid:{uid}"


@dataclass(frozen=True)
class TenantKey:
    tenant: str
    key: bytes = field(repr=False)


def bare_key_tenant(key: bytes) -> str:
    return "key:" + hashlib.sha256(key).hexdigest()[:8]


def load_keys(path: Path) -> tuple[TenantKey, ...]:
    """The keys in `path` and their tenants (blank lines and `#` comments skipped). The file must be readable by
    its owner only, since anyone who reads a key may use the API. ValueError names the file, the line and the
    problem, and never a key."""
    try:
        st = path.stat()
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ValueError(f"{path} is mode {mode:04o}: others could read the keys; run chmod 600 {path}")
    keys: list[TenantKey] = []
    first_line: dict[bytes, tuple[int, str]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        entry = _entry(line, f"{path}:{number}")
        seen = first_line.setdefault(entry.key, (number, entry.tenant))
        if seen[1] != entry.tenant:
            raise ValueError(f"{path}:{number}: this key is on line {seen[0]} too, in tenant "
                             f"{tenant_label(seen[1])!r}; a key belongs to one tenant")
        if seen[0] == number:
            keys.append(entry)
    if not keys:
        raise ValueError(f"{path} holds no keys; write one key a line, as KEY or NAME: KEY")
    return tuple(keys)


def _entry(line: str, where: str) -> TenantKey:
    name, colon, key = line.partition(":")
    if not colon:
        name, key = "", line
    name, key = name.strip(), key.strip()
    if colon and not PLAIN_WORD.fullmatch(name):
        raise ValueError(f"{where}: the tenant name before ':' is not a plain word (letters, digits, '-' and '_', "
                         "starting with a letter or digit, at most 64)")
    if not key:
        raise ValueError(f"{where}: no key after the tenant name; write NAME: KEY")
    if len(key.split()) != 1:
        raise ValueError(f"{where}: a key must not contain spaces; write one key a line, as KEY or NAME: KEY")
    if name == DEFAULT_TENANT_LABEL:
        raise ValueError(f"{where}: the tenant name {DEFAULT_TENANT_LABEL!r} is reserved for the daemon's own user; "
                         "choose another")
    encoded = key.encode()
    return TenantKey(name or bare_key_tenant(encoded), encoded)


@dataclass(frozen=True)
class Tenants:
    """The HTTP listener's keys and tenants, and the groups of tenants that share one namespace on purpose."""

    keys: tuple[TenantKey, ...] = field(default=(), repr=False)
    groups: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        known = {k.tenant for k in self.keys}
        seen: set[str] = set()
        for group in self.groups:
            for name in group:
                if name not in known:
                    raise ValueError(f"{name!r} names no tenant of the keys file")
                if name in seen:
                    raise ValueError(f"tenant {name!r} is in two groups; a tenant shares with one group")
                seen.add(name)

    @property
    def guarded(self) -> bool:
        return bool(self.keys)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k.tenant for k in self.keys))

    def identify(self, offered: bytes) -> str | None:
        """The tenant whose key this is, None for no key of the file. Every key is compared, in constant time
        each, so neither the answer's timing nor its path tells anything of the keys."""
        found = None
        for entry in self.keys:
            if hmac.compare_digest(offered, entry.key):
                found = entry.tenant
        return found

    def namespace(self, tenant: str, salt: str = "") -> Namespace:
        """The namespace of a tenant's request with this salt: the tenant's own, or its group's."""
        for group in self.groups:
            if tenant in group:
                return Namespace.of(tenant, salt, SHARED_PREFIX + ",".join(sorted(group)))
        return Namespace.of(tenant, salt)


def shared_groups(value: Sequence[str] | Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    """`[http] shared`: a list of tenant names (one group) or a list of such lists (several)."""
    if all(isinstance(v, str) for v in value):
        groups: Iterable = [value] if value else []
    elif all(isinstance(v, list) and all(isinstance(n, str) for n in v) for v in value):
        groups = value
    else:
        raise ValueError("expected a list of tenant names, or a list of such lists")
    out = tuple(tuple(g) for g in groups)
    if any(len(g) < 2 for g in out):
        raise ValueError("a group of tenants that share names two tenants at least")
    return out
