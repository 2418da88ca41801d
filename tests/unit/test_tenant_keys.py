"""Tenants: the keys file's names and problems, who a key belongs to, and the namespaces they map to."""

from __future__ import annotations

from pathlib import Path

import pytest

from barreld.cache.key import DEFAULT_NAMESPACE, Namespace
from barreld.config import ConfigError, load_config
from barreld.tenants import TenantKey, Tenants, bare_key_tenant, load_keys, shared_groups, uid_tenant


def keys_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys"
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_named_keys_share_their_tenant_and_a_bare_key_is_a_tenant_of_its_own(tmp_path: Path) -> None:
    keys = load_keys(keys_file(tmp_path, "# team\nalice: sk-a1\nalice:sk-a2\nbob: sk-b\nsk-old\n"))
    assert [(k.tenant, k.key) for k in keys] == [
        ("alice", b"sk-a1"), ("alice", b"sk-a2"), ("bob", b"sk-b"), (bare_key_tenant(b"sk-old"), b"sk-old")]
    assert bare_key_tenant(b"sk-old").startswith("key:") and "sk-old" not in bare_key_tenant(b"sk-old")
    tenants = Tenants(keys)
    assert tenants.names == ("alice", "bob", bare_key_tenant(b"sk-old"))
    assert [tenants.identify(k) for k in (b"sk-a2", b"sk-b", b"sk-old", b"sk-a", b"")] == [
        "alice", "bob", bare_key_tenant(b"sk-old"), None, None]


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("alice: sk-a\nal ice: sk-secret-1\n", 2, "is not a plain word"),
        ("alice: sk-a\n-x: sk-secret-1\n", 2, "is not a plain word"),
        ("alice: sk-a\nbob:\n", 2, "no key after the tenant name"),
        ("alice: sk secret-1\n", 1, "must not contain spaces"),
        ("alice: sk-secret-1\n\nbob: sk-secret-1\n", 3, "on line 1 too, in tenant 'alice'"),
        ("sk-secret-1\nbob: sk-secret-1\n", 2, "a key belongs to one tenant"),
        ("default: sk-secret-1\n", 1, "reserved"),
    ],
)
def test_a_bad_line_is_named_with_its_problem_and_never_shows_a_key(tmp_path: Path, text: str, line: int,
                                                                     words: str) -> None:
    path = keys_file(tmp_path, text)
    with pytest.raises(ValueError, match=words) as caught:
        load_keys(path)
    assert str(caught.value).startswith(f"{path}:{line}: ")
    assert "secret" not in str(caught.value)


def test_the_same_key_twice_in_one_tenant_is_one_key(tmp_path: Path) -> None:
    assert load_keys(keys_file(tmp_path, "alice: sk-a\nalice: sk-a\n")) == (TenantKey("alice", b"sk-a"),)


def test_a_bad_keys_file_stops_the_config_in_one_line_naming_file_line_and_problem(tmp_path: Path) -> None:
    keys_file(tmp_path, "alice: sk-a\nbob sk-b: x\n")
    cfg = tmp_path / "barreld.toml"
    cfg.write_text(f"[tiers.ram_file]\nroot = '{tmp_path / 'shm'}'\n[http]\napi_keys_file = 'keys'\n")
    with pytest.raises(ConfigError) as caught:
        load_config(cfg, tmp_path / "data")
    message = str(caught.value)
    assert "\n" not in message and str(cfg) in message and f"{tmp_path / 'keys'}:2:" in message
    assert "not a plain word" in message


def test_namespaces_part_tenants_salts_and_kinds_of_label() -> None:
    spaces = [Namespace.of(t, s) for t, s in (("alice", ""), ("bob", ""), ("alice", "u1"), ("alice", "u2"),
                                              ("", "u1"), ("uid:1001", ""))]
    assert len({n.digest for n in spaces}) == len(spaces) and all(len(n.digest) == 32 for n in spaces)
    assert Namespace.of("") == DEFAULT_NAMESPACE and DEFAULT_NAMESPACE.digest == b""
    assert Namespace.of("alice", "u1") == Namespace.of("alice", "u1")
    # a group's label is kept apart from a tenant's of the same spelling
    assert Namespace.of("x", group="x").digest != Namespace.of("x").digest


def test_tenants_of_a_group_share_a_namespace_and_keep_their_names() -> None:
    keys = (TenantKey("alice", b"a"), TenantKey("bob", b"b"), TenantKey("carol", b"c"))
    tenants = Tenants(keys, shared_groups(["alice", "bob"]))
    alice, bob, carol = (tenants.namespace(t) for t in ("alice", "bob", "carol"))
    assert alice.digest == bob.digest != carol.digest and (alice.tenant, bob.tenant) == ("alice", "bob")
    assert tenants.namespace("alice", "s").digest == tenants.namespace("bob", "s").digest != alice.digest
    assert carol == Namespace.of("carol")


@pytest.mark.parametrize(
    ("groups", "words"),
    [
        ([["alice", "zed"]], "names no tenant"),
        ([["alice", "bob"], ["bob", "carol"]], "in two groups"),
    ],
)
def test_a_bad_group_is_refused(groups: list, words: str) -> None:
    keys = (TenantKey("alice", b"a"), TenantKey("bob", b"b"), TenantKey("carol", b"c"))
    with pytest.raises(ValueError, match=words):
        Tenants(keys, shared_groups(groups))


@pytest.mark.parametrize(("value", "words"), [(["alice"], "two tenants at least"), (["a", ["b"]], "expected")])
def test_a_bad_shared_value_is_refused(value: list, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        shared_groups(value)


def test_the_shared_key_needs_a_keys_file(tmp_path: Path) -> None:
    cfg = tmp_path / "barreld.toml"
    cfg.write_text(f"[tiers.ram_file]\nroot = '{tmp_path / 'shm'}'\n[http]\nshared = ['alice', 'bob']\n")
    with pytest.raises(ConfigError, match="http.shared.*no api_keys_file"):
        load_config(cfg, tmp_path / "data")


def test_the_daemons_own_user_is_the_default_tenant() -> None:
    assert uid_tenant(1000, owner=1000) == "" and uid_tenant(1001, owner=1000) == "uid:1001"
