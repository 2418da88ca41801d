"""The daemon's TOML config file: read, validated whole, frozen.

A bad file stops `barreld` at start with one line naming the file, the key and the problem; a config is
either entirely valid or not returned at all, so nothing downstream re-checks it. Relative paths in the
file are relative to the file's directory; `~` is expanded.
"""

import dataclasses
import grp
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, NoReturn

from barreld.address import ListenAddress, parse_listen
from barreld.cache import TierConfig
from barreld.cache.remote.settings import (
    DEFAULT_PREFIX,
    DEFAULT_TIMEOUT_MS,
    URL_ENV,
    RedisSettings,
    prefix_problem,
    url_problem,
)
from barreld.engine.policy import Policy, PolicyError
from barreld.names import (
    FINGERPRINT_MODES,
    KV_CACHE_TYPES,
    MEMORY_TIERS,
    PLAIN_KV_TYPES,
    REDIS_TIER,
    TIER_NAMES,
    Fingerprint,
    FingerprintMode,
    alias_problem,
    model_name_problem,
    stops_problem,
)
from barreld.pressure.scheduler import check_watermarks
from barreld.pressure.sources import check_source_spec
from barreld.sizes import parse_size
from barreld.tenants import TenantKey, Tenants, load_keys, shared_groups

BUNDLED_MODEL = "smollm2"
"""The one model name that may omit `path`: the contract's bundled default."""

_TOML_POSITION = re.compile(r"^(?P<what>.*?) \(at (?P<where>line \d+, column \d+)\)$")


class ConfigError(Exception):
    """What is wrong with a config file, as one line: `<file>: <key>: <what is wrong>`."""

    def __init__(self, file: str, key: str | None, reason: str) -> None:
        self.file, self.key, self.reason = file, key, " ".join(reason.split())
        where = f"{file}: {key}" if key else file
        super().__init__(f"{where}: {self.reason}")


@dataclass(frozen=True)
class SchedulerConfig:
    """The memory-pressure scheduler's settings; off by default."""

    enabled: bool = False
    pressure_source: str = "system"
    interval_ms: int = 5000
    high_watermark: float = 0.85
    low_watermark: float = 0.75
    evict_tiers: tuple[str, ...] = MEMORY_TIERS


@dataclass(frozen=True)
class HttpConfig:
    """The OpenAI-compatible HTTP API: off unless `listen` is set; keys read (and checked) at load."""

    listen: ListenAddress | None = None
    api_keys_file: Path | None = None
    tenants: Tenants = field(default_factory=Tenants, repr=False)  # the keys' tenants and who shares


@dataclass(frozen=True)
class ModelConfig:
    """A model loaded at start, as `barrelctl load` would: None means that option's default."""

    name: str
    path: Path | None = None
    tier: str | None = None
    n_ctx: int | None = None
    n_batch: int | None = None
    n_seq_max: int | None = None
    fingerprint: Fingerprint | None = None  # its mode, and the operator's digest with fast_unsafe
    policy: Policy = field(default_factory=Policy)  # the daemon's [policy] with this model's table applied
    n_threads: int | None = None
    n_gpu_layers: int | None = None
    flash_attn: bool | None = None
    type_k: str | None = None
    type_v: str | None = None
    swa_full: bool | None = None
    aliases: tuple[str, ...] = ()  # glob patterns of the names clients may send for this model
    chat_template: str | None = None  # the text of the Jinja file the entry names, in place of the GGUF's
    stop: tuple[str, ...] | None = None  # where the model's turn ends in a chat, beyond its end-of-turn token

    def load_settings(self) -> dict[str, Any]:
        """What this entry sets, by LoadOptions' names: the others keep the registry's defaults, written once
        there."""
        names = ("path", "tier", "n_ctx", "n_batch", "n_seq_max", "fingerprint", "n_threads", "n_gpu_layers",
                 "flash_attn", "type_k", "type_v", "swa_full", "chat_template", "stop")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


@dataclass(frozen=True)
class Config:
    """The whole validated configuration; `path` is the file it came from, None for built-in defaults."""

    path: Path | None
    data_dir: Path
    socket: Path | None  # None: the contract's default socket path
    writers: int | None  # None: the writer pool's own default
    max_queue: int | None  # None: the worker's own default; requests waiting per model beyond n_seq_max
    socket_group: str | None  # a group whose members may connect too (socket 0660), else owner only
    tiers: Mapping[str, TierConfig]
    policy: Policy
    scheduler: SchedulerConfig
    models: tuple[ModelConfig, ...]
    http: HttpConfig = field(default_factory=HttpConfig)
    redis: RedisSettings | None = None
    block_tokens: int | None = None  # [cache] block_tokens; None: not set (the default applies where it fits)


def default_config_path() -> Path | None:
    """The first config file that exists: $XDG_CONFIG_HOME/barrel/barreld.toml, then /etc/barrel/."""
    for candidate in (
        _xdg_home("XDG_CONFIG_HOME", ".config") / "barrel/barreld.toml",
        Path("/etc/barrel/barreld.toml"),
    ):
        if candidate.exists():
            return candidate
    return None


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/barrel, the contract's data dir outside systemd (which passes --data-dir)."""
    return _xdg_home("XDG_DATA_HOME", ".local/share") / "barrel"


def load_config(path: Path | None, data_dir: Path | None = None) -> Config:
    """Read and validate `path` (None: built-in defaults only); raise ConfigError on any problem.

    The data dir is `data_dir` when given (the command line wins), else the file's `[daemon] data_dir`,
    else `default_data_dir()`. Tier roots must be writable directories or creatable as such.
    """
    file = str(path) if path is not None else "(built-in defaults)"
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(file, None, f"cannot read: {e.strerror or e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(file, None, f"not UTF-8 text: {e}") from e
        except tomllib.TOMLDecodeError as e:
            match = _TOML_POSITION.match(str(e))
            if match:
                raise ConfigError(file, match["where"], f"TOML syntax error: {match['what']}") from e
            raise ConfigError(file, None, f"TOML syntax error: {e}") from e
    base = path.parent if path is not None else Path.cwd()
    return _ConfigReader(file, base).config(path, data, data_dir)


class _ConfigReader:
    """Reads one parsed file; every check raises ConfigError naming the dotted key."""

    def __init__(self, file: str, base: Path) -> None:
        self.file = file
        self.base = base

    def fail(self, key: str, reason: str) -> NoReturn:
        raise ConfigError(self.file, key, reason)

    def config(self, path: Path | None, data: dict[str, Any], data_dir: Path | None) -> Config:
        self.known(data, "", ("daemon", "tiers", "policy", "scheduler", "models", "http", "cache"))
        daemon = self.table(data, "daemon", ("socket", "data_dir", "writers", "max_queue", "socket_group"))
        if data_dir is not None:
            data_dir, data_dir_key = data_dir.expanduser().absolute(), "data_dir"
        elif "data_dir" in daemon:
            data_dir, data_dir_key = self.path(daemon["data_dir"], "daemon.data_dir"), "daemon.data_dir"
        else:
            data_dir, data_dir_key = default_data_dir(), "data_dir"
        self.writable_dir(data_dir, data_dir_key)
        socket = self.path(daemon["socket"], "daemon.socket") if "socket" in daemon else None
        writers = self.integer(daemon["writers"], "daemon.writers", 1) if "writers" in daemon else None
        max_queue = self.integer(daemon["max_queue"], "daemon.max_queue", 0) if "max_queue" in daemon else None
        socket_group = None
        if "socket_group" in daemon:
            socket_group = self.string(daemon["socket_group"], "daemon.socket_group")
            try:
                grp.getgrnam(socket_group)
            except KeyError:
                self.fail("daemon.socket_group", f"no such group {socket_group!r}")
        tiers = self.tiers(data, data_dir)
        redis = self.redis(self.table(data, "tiers", None))
        policy = self.policy(Policy(), self.table(data, "policy", None), "policy")
        scheduler = self.scheduler(self.table(data, "scheduler", _field_names(SchedulerConfig)))
        models = self.models(data.get("models", []), policy)
        http = self.http(self.table(data, "http", ("listen", "api_keys_file", "shared")))
        block_tokens = self.block_tokens(self.table(data, "cache", ("block_tokens",)), policy)
        return Config(
            path, data_dir, socket, writers, max_queue, socket_group, tiers, policy, scheduler, models, http, redis,
            block_tokens,
        )

    def block_tokens(self, table: dict[str, Any], policy: Policy) -> int | None:
        """Tokens per stored block (0: whole-state checkpoints); cold saves land on multiples of
        boundary_align_tokens, so it must divide it."""
        if "block_tokens" not in table:
            return None
        size = self.integer(table["block_tokens"], "cache.block_tokens", 0)
        if size and policy.boundary_align_tokens % size:
            self.fail("cache.block_tokens", f"{size} does not divide policy.boundary_align_tokens "
                      f"({policy.boundary_align_tokens}); use a divisor of it, or 0 for whole-state checkpoints")
        return size

    def http(self, table: dict[str, Any]) -> HttpConfig:
        listen = keys_file = None
        keys: tuple[TenantKey, ...] = ()
        if "listen" in table:
            try:
                listen = parse_listen(self.string(table["listen"], "http.listen"), self.base)
            except ValueError as e:
                self.fail("http.listen", str(e))
        if "api_keys_file" in table:
            keys_file = self.path(table["api_keys_file"], "http.api_keys_file")
            try:
                keys = load_keys(keys_file)
            except ValueError as e:
                self.fail("http.api_keys_file", str(e))
        if "shared" in table:
            if not keys:
                self.fail("http.shared", "names tenants, but there is no api_keys_file to name them")
            try:
                if not isinstance(table["shared"], list):
                    raise ValueError(f"expected a list of tenant names, got {table['shared']!r}")
                return HttpConfig(listen, keys_file, Tenants(keys, shared_groups(table["shared"])))
            except ValueError as e:
                self.fail("http.shared", str(e))
        return HttpConfig(listen, keys_file, Tenants(keys))

    def tiers(self, data: dict[str, Any], data_dir: Path) -> Mapping[str, TierConfig]:
        tables = self.table(data, "tiers", (*TIER_NAMES, REDIS_TIER))
        defaults: dict[str, tuple[str, Path | None]] = {
            "ram": ("2G", None),
            "ram_file": ("4G", Path(f"/dev/shm/barrel-{os.getuid()}")),
            "disk": ("50G", data_dir / "kvc"),
        }
        tiers = {}
        for name, (quota, root) in defaults.items():
            table = self.table(
                tables, name, ("quota",) if root is None else ("quota", "root"), f"tiers.{name}"
            )
            key = f"tiers.{name}"
            quota_bytes = self.size(table.get("quota", quota), f"{key}.quota")
            if "root" in table:
                root = self.path(table["root"], f"{key}.root")
            if root is not None:
                self.writable_dir(root, f"{key}.root")
            tiers[name] = TierConfig(quota_bytes, root)  # the store's own type: the daemon hands these over as read
        if tiers["ram_file"].root == tiers["disk"].root:
            self.fail("tiers.disk.root", "must not be the same directory as tiers.ram_file.root")
        return MappingProxyType(tiers)

    def redis(self, tables: dict[str, Any]) -> RedisSettings | None:
        """The shared tier, when its table or $BARREL_REDIS_URL names a server; the variable wins over `url`
        so that a password can stay out of the file. Errors never repeat the URL's credentials."""
        key = f"tiers.{REDIS_TIER}"
        table = self.table(tables, REDIS_TIER, _field_names(RedisSettings), key)
        env_url = os.environ.get(URL_ENV) or None
        if REDIS_TIER not in tables and env_url is None:
            return None
        if env_url is None and "url" not in table:
            self.fail(f"{key}.url", f"missing: the Redis server's URL (or set ${URL_ENV})")
        url = env_url if env_url is not None else self.string(table["url"], f"{key}.url")
        problem = url_problem(url)
        if problem:
            self.fail(f"{key}.url", problem if env_url is None else f"from ${URL_ENV}: {problem}")
        prefix = self.string(table.get("prefix", DEFAULT_PREFIX), f"{key}.prefix")
        problem = prefix_problem(prefix)
        if problem:
            self.fail(f"{key}.prefix", f"bad prefix {prefix!r}: {problem}")
        return RedisSettings(
            url=url,
            quota=self.size(table["quota"], f"{key}.quota") if "quota" in table else None,
            prefix=prefix,
            timeout_ms=self.integer(table.get("timeout_ms", DEFAULT_TIMEOUT_MS), f"{key}.timeout_ms", 1),
            write=self.boolean(table.get("write", True), f"{key}.write"),
        )

    def scheduler(self, table: dict[str, Any]) -> SchedulerConfig:
        d = SchedulerConfig()
        enabled = self.boolean(table.get("enabled", d.enabled), "scheduler.enabled")
        source = self.string(table.get("pressure_source", d.pressure_source), "scheduler.pressure_source")
        try:
            check_source_spec(source)
        except ValueError as e:
            self.fail("scheduler.pressure_source", str(e))
        interval_ms = self.integer(table.get("interval_ms", d.interval_ms), "scheduler.interval_ms", 1)
        high = self.fraction(table.get("high_watermark", d.high_watermark), "scheduler.high_watermark")
        low = self.fraction(table.get("low_watermark", d.low_watermark), "scheduler.low_watermark")
        try:
            check_watermarks(high, low)
        except ValueError as e:  # each is within [0, 1] by now: what is left is their order
            self.fail("scheduler.low_watermark", str(e))
        tiers = table.get("evict_tiers", list(d.evict_tiers))
        if not isinstance(tiers, list) or not tiers or not all(isinstance(t, str) for t in tiers):
            self.fail("scheduler.evict_tiers", f"expected a non-empty list of tier names, got {tiers!r}")
        for tier in tiers:
            self.tier_name(tier, "scheduler.evict_tiers")
        if len(set(tiers)) != len(tiers):
            self.fail("scheduler.evict_tiers", f"names a tier twice: {tiers!r}")
        return SchedulerConfig(enabled, source, interval_ms, high, low, tuple(tiers))

    def models(self, entries: object, policy: Policy) -> tuple[ModelConfig, ...]:
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            self.fail("models", "expected an array of tables: [[models]]")
        allowed = (*_field_names(ModelConfig), "fingerprint_digest")  # read with fingerprint into its value
        models: list[ModelConfig] = []
        for index, entry in enumerate(entries):
            key = f"models[{index}]"
            self.known(entry, key, allowed)
            if "name" not in entry:
                self.fail(f"{key}.name", "missing: every model needs a name")
            name = self.string(entry["name"], f"{key}.name")
            problem = model_name_problem(name)
            if problem:
                self.fail(f"{key}.name", f"bad model name {name!r}: {problem}")
            if any(m.name == name for m in models):
                self.fail(f"{key}.name", f"model {name!r} is listed twice")
            models.append(self.model(entry, key, name, policy))
        return tuple(models)

    def model(self, entry: dict[str, Any], key: str, name: str, policy: Policy) -> ModelConfig:
        path = None
        if "path" in entry:
            path = self.path(entry["path"], f"{key}.path")
            if not path.is_file():
                self.fail(f"{key}.path", f"no such model file: {path}")
        elif name != BUNDLED_MODEL:
            self.fail(f"{key}.path", f"missing: only the bundled model {BUNDLED_MODEL!r} may omit its path")
        tier = (
            self.tier_name(self.string(entry["tier"], f"{key}.tier"), f"{key}.tier")
            if "tier" in entry
            else None
        )
        sizes = {
            option: self.integer(entry[option], f"{key}.{option}", 1) if option in entry else None
            for option in ("n_ctx", "n_batch", "n_seq_max")
        }
        overrides = self.table(entry, "policy", None, f"{key}.policy")
        aliases = self.aliases(entry.get("aliases", []), f"{key}.aliases")
        return ModelConfig(
            name=name,
            path=path,
            tier=tier,
            fingerprint=self.fingerprint(entry, key),
            policy=self.policy(policy, overrides, f"{key}.policy"),
            aliases=aliases,
            **sizes,
            **self.knobs(entry, key),
        )

    def fingerprint(self, entry: dict[str, Any], key: str) -> Fingerprint | None:
        mode = digest = None
        if "fingerprint" in entry:
            mode = self.string(entry["fingerprint"], f"{key}.fingerprint")
            if mode not in FINGERPRINT_MODES:
                self.fail(f"{key}.fingerprint", f"unknown mode {mode!r}: expected {', '.join(FINGERPRINT_MODES)}")
        if "fingerprint_digest" in entry:
            digest = self.string(entry["fingerprint_digest"], f"{key}.fingerprint_digest")
            if mode != FingerprintMode.FAST_UNSAFE or not digest:
                self.fail(f"{key}.fingerprint_digest", "a non-empty digest goes with fingerprint = 'fast_unsafe' only")
        elif mode == FingerprintMode.FAST_UNSAFE:
            self.fail(f"{key}.fingerprint_digest", "missing: fingerprint = 'fast_unsafe' needs the operator's digest")
        try:
            return None if mode is None else Fingerprint(FingerprintMode(mode), digest)
        except ValueError as exc:
            self.fail(f"{key}.fingerprint_digest", str(exc))

    def aliases(self, value: object, key: str) -> tuple[str, ...]:
        if not isinstance(value, list):
            self.fail(key, f"expected an array of glob patterns, got {value!r}")
        for pattern in value:
            problem = alias_problem(self.string(pattern, key))
            if problem:
                self.fail(key, f"bad alias {pattern[:40]!r}: {problem}")
        return tuple(value)

    def knobs(self, entry: dict[str, Any], key: str) -> dict[str, Any]:
        """A model's threading, offload and KV cache settings: the ones it gives, checked."""
        out: dict[str, Any] = {}
        if "n_threads" in entry:
            out["n_threads"] = self.integer(entry["n_threads"], f"{key}.n_threads", 1)
        if "n_gpu_layers" in entry:
            out["n_gpu_layers"] = self.integer(entry["n_gpu_layers"], f"{key}.n_gpu_layers", -1)
        for name in ("flash_attn", "swa_full"):
            if name in entry:
                out[name] = self.boolean(entry[name], f"{key}.{name}")
        for name in ("type_k", "type_v"):
            if name in entry:
                value = self.string(entry[name], f"{key}.{name}")
                if value not in KV_CACHE_TYPES:
                    self.fail(f"{key}.{name}", f"unknown cache type {value!r}: expected {', '.join(KV_CACHE_TYPES)}")
                out[name] = value
        if out.get("type_v", "f16") not in PLAIN_KV_TYPES and out.get("flash_attn") is False:
            self.fail(f"{key}.type_v", f"a quantised V cache ({out['type_v']}) needs flash_attn = true")
        if "chat_template" in entry:
            path = self.path(entry["chat_template"], f"{key}.chat_template")
            try:
                out["chat_template"] = path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                self.fail(f"{key}.chat_template", f"cannot read the template {path}: {exc}")
        if "stop" in entry:
            out["stop"] = self.stops(entry["stop"], f"{key}.stop")
        return out

    def stops(self, value: object, key: str) -> tuple[str, ...]:
        if not isinstance(value, list):
            self.fail(key, f"expected an array of strings, got {value!r}")
        stops = tuple(self.string(s, key) for s in value)
        problem = stops_problem(stops)
        if problem:
            self.fail(key, problem)
        return stops

    # value checks

    def known(self, table: dict[str, Any], key: str, allowed: tuple[str, ...]) -> None:
        for name in table:
            if name not in allowed:
                where = f"{key}.{name}" if key else name
                self.fail(where, f"unknown key (expected one of: {', '.join(allowed)})")

    def table(
        self, parent: dict[str, Any], name: str, allowed: tuple[str, ...] | None, key: str | None = None
    ) -> dict[str, Any]:
        """parent[name] as a table (empty when absent); `allowed` None lets someone else check the keys."""
        key = key or name
        value = parent.get(name, {})
        if not isinstance(value, dict):
            self.fail(key, f"expected a table, got {value!r}")
        if allowed is not None:
            self.known(value, key, allowed)
        return value

    def policy(self, base: Policy, overrides: dict[str, Any], key: str) -> Policy:
        try:
            return base.with_overrides(overrides)
        except PolicyError as e:
            self.fail(f"{key}.{e.key}", e.reason)

    def integer(self, value: object, key: str, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(key, f"expected a whole number >= {minimum}, got {value!r}")
        return value

    def size(self, value: Any, key: str) -> int:
        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(key, str(e))

    def fraction(self, value: object, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            self.fail(key, f"expected a number from 0 to 1, got {value!r}")
        return float(value)

    def boolean(self, value: object, key: str) -> bool:
        if not isinstance(value, bool):
            self.fail(key, f"expected true or false, got {value!r}")
        return value

    def string(self, value: object, key: str) -> str:
        if not isinstance(value, str):
            self.fail(key, f"expected a string, got {value!r}")
        return value

    def tier_name(self, value: str, key: str) -> str:
        if value not in TIER_NAMES:
            self.fail(key, f"unknown tier {value!r}: expected one of {', '.join(TIER_NAMES)}")
        return value

    def path(self, value: object, key: str) -> Path:
        text = self.string(value, key)
        if not text:
            self.fail(key, "expected a path, got an empty string")
        return (self.base / Path(text).expanduser()).absolute()

    def writable_dir(self, directory: Path, key: str) -> None:
        """Fail unless `directory` is a writable directory, or does not exist yet and could be made."""
        probe = directory
        while not probe.exists():
            if probe.is_symlink():
                self.fail(key, f"{probe} is a dangling symbolic link")
            probe = probe.parent
        if not probe.is_dir():
            what = (
                "is not a directory"
                if probe == directory
                else f"cannot be created: {probe} is not a directory"
            )
            self.fail(key, f"{directory} {what}")
        if not os.access(probe, os.R_OK | os.W_OK | os.X_OK):
            access = "readable, writable and searchable"
            what = f"is not {access}" if probe == directory else f"cannot be created: {probe} is not {access}"
            self.fail(key, f"{directory} {what}")


def _xdg_home(variable: str, fallback: str) -> Path:
    """An XDG base directory: the variable when it is an absolute path (as the spec says), else ~/fallback."""
    value = os.environ.get(variable, "")
    return Path(value) if os.path.isabs(value) else Path.home() / fallback


def _field_names(cls: type) -> tuple[str, ...]:
    """A settings dataclass's fields: exactly the keys its TOML table may hold."""
    return tuple(f.name for f in dataclasses.fields(cls))
