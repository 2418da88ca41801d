"""The config file: defaults, the contract's example, and one clear line for every kind of mistake."""

import dataclasses
import math
import os
from pathlib import Path

import pytest

from barreld.config import (
    Config,
    ConfigError,
    SchedulerConfig,
    default_config_path,
    default_data_dir,
    load_config,
)
from barreld.engine.policy import Policy
from barreld.engine.registry import LoadOptions
from barreld.names import Fingerprint, FingerprintMode

GIB = 1024**3

CONTRACT_EXAMPLE = """
[tiers.ram]
quota = "2G"

[tiers.ram_file]
quota = "4G"
root = "{tmp}/shm"

[tiers.disk]
quota = "50G"
root = "{tmp}/kvc"

[policy]   # the specification's gates, same names and defaults; per-model overrides via `load --policy`
min_tokens = 512
cold_min_tokens = 512
cold_max_tokens = 30000
continued_interval = 2048
boundary_trim_tokens = 32
boundary_align_tokens = 2048
session_resume_wait_ms = 500
prefill_chunk_size = "auto"      # max(64, n_batch // 4); "infinity" disables
evict_save_timeout_ms = 30000

[scheduler]
enabled = false
pressure_source = "system"       # "noop" | "system" | "nvidia_smi" | "module:pkg.mod"
interval_ms = 5000
high_watermark = 0.85
low_watermark = 0.75
evict_tiers = ["ram", "ram_file"]

[[models]]                       # loaded when barreld starts
name = "smollm2"
tier = "disk"
n_ctx = 4096
"""


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "barreld.toml"
    path.write_text(text.replace("{tmp}", str(tmp_path)))
    return path


def load(tmp_path: Path, text: str) -> Config:
    return load_config(write_config(tmp_path, text), tmp_path / "data")


def test_no_file_gives_the_contracts_defaults(tmp_path: Path) -> None:
    config = load_config(None, tmp_path / "data")
    assert config.path is None
    assert config.data_dir == tmp_path / "data"
    assert {name: tier.quota for name, tier in config.tiers.items()} == {
        "ram": 2 * GIB,
        "ram_file": 4 * GIB,
        "disk": 50 * GIB,
    }
    assert config.tiers["ram"].root is None
    assert config.tiers["ram_file"].root == Path(f"/dev/shm/barrel-{os.getuid()}")
    assert config.tiers["disk"].root == tmp_path / "data" / "kvc"
    assert config.policy == Policy()
    assert config.scheduler == SchedulerConfig()
    assert config.scheduler.enabled is False
    assert config.models == ()
    assert (config.socket, config.writers) == (None, None)


def test_empty_file_is_the_defaults(tmp_path: Path) -> None:
    config = load(tmp_path, "")
    assert config.policy == Policy()
    assert config.tiers["disk"].quota == 50 * GIB


def test_the_contracts_example_loads(tmp_path: Path) -> None:
    config = load(tmp_path, CONTRACT_EXAMPLE)
    assert config.path == tmp_path / "barreld.toml"
    assert config.tiers["ram_file"].root == tmp_path / "shm"
    assert config.tiers["disk"].root == tmp_path / "kvc"
    assert config.policy == Policy()
    assert config.scheduler == SchedulerConfig(pressure_source="system")
    (model,) = config.models
    assert (model.name, model.tier, model.n_ctx, model.path, model.n_batch) == (
        "smollm2",
        "disk",
        4096,
        None,
        None,
    )
    assert model.policy == Policy()


def test_values_are_read(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    config = load(
        tmp_path,
        """
        [daemon]
        socket = "run/b.sock"
        writers = 3
        [tiers.ram]
        quota = 1048576
        [tiers.disk]
        quota = "1TiB"
        [policy]
        min_tokens = "infinity"
        prefill_chunk_size = inf
        [scheduler]
        enabled = true
        pressure_source = "nvidia_smi"
        interval_ms = 250
        high_watermark = 1
        low_watermark = 0
        evict_tiers = ["disk"]
        [[models]]
        name = "mine"
        path = "m.gguf"
        tier = "ram"
        n_ctx = 8192
        n_batch = 256
        n_seq_max = 4
        fingerprint = "fast_unsafe"
        fingerprint_digest = "abc123"
        policy = { min_tokens = 64, boundary_align_tokens = "256" }
        n_threads = 3
        n_gpu_layers = 0
        flash_attn = true
        type_k = "q8_0"
        type_v = "q4_0"
        swa_full = false
        """,
    )
    assert config.socket == tmp_path / "run/b.sock"
    assert config.writers == 3
    assert config.tiers["ram"].quota == 1048576
    assert config.tiers["disk"].quota == 1024**4
    assert config.policy.min_tokens == math.inf
    assert config.policy.chunk_size(512) is None
    assert config.scheduler == SchedulerConfig(True, "nvidia_smi", 250, 1.0, 0.0, ("disk",))
    (model,) = config.models
    assert model.path == gguf
    assert (model.tier, model.n_ctx, model.n_batch, model.n_seq_max) == ("ram", 8192, 256, 4)
    assert model.fingerprint == Fingerprint(FingerprintMode.FAST_UNSAFE, "abc123")
    assert str(model.fingerprint) == "fast_unsafe:abc123"
    # a model's table applies over the daemon's [policy], not over the built-in defaults
    assert model.policy.min_tokens == 64
    assert model.policy.boundary_align_tokens == 256
    assert model.policy.prefill_chunk_size == math.inf
    assert model.load_settings() == {"path": gguf, "tier": "ram", "n_ctx": 8192, "n_batch": 256, "n_seq_max": 4,
                             "fingerprint": model.fingerprint, "n_threads": 3, "n_gpu_layers": 0, "flash_attn": True,
                             "type_k": "q8_0", "type_v": "q4_0", "swa_full": False}
    assert LoadOptions(**model.load_settings()).n_ctx == 8192 and LoadOptions().n_ctx == 4096  # unset: the registry's


def test_a_models_turn_ends_are_read(tmp_path: Path) -> None:
    config = load(tmp_path, "[[models]]\nname = 'smollm2'\nstop = [\"\\nUser:\", \"\\nAssistant:\"]\n")
    assert config.models[0].stop == ("\nUser:", "\nAssistant:")
    assert config.models[0].load_settings()["stop"] == ("\nUser:", "\nAssistant:")


def test_a_models_aliases_are_read(tmp_path: Path) -> None:
    (tmp_path / "b.gguf").touch()
    config = load(tmp_path, "[[models]]\nname = 'smollm2'\naliases = ['claude-*', 'gpt-4o']\n[[models]]\nname = 'b'\n"
                  f"path = '{tmp_path / 'b.gguf'}'\n")
    assert [m.aliases for m in config.models] == [("claude-*", "gpt-4o"), ()]


def test_a_models_chat_template_is_read_from_its_file_beside_the_config(tmp_path: Path) -> None:
    (tmp_path / "gemma.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    config = load(tmp_path, "[[models]]\nname = 'smollm2'\nchat_template = 'gemma.jinja'\n")
    assert config.models[0].load_settings()["chat_template"].startswith("{% for m in messages %}")


def test_config_is_frozen(tmp_path: Path) -> None:
    config = load(tmp_path, CONTRACT_EXAMPLE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.policy = Policy()  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.tiers["ram"] = config.tiers["disk"]  # type: ignore[index]


# data dir


def test_data_dir_argument_beats_the_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[daemon]\ndata_dir = "from-file"\n')
    assert load_config(path, tmp_path / "cli").data_dir == tmp_path / "cli"
    config = load_config(path)
    assert config.data_dir == tmp_path / "from-file", "relative to the config file's directory"
    assert config.tiers["disk"].root == tmp_path / "from-file" / "kvc"


def test_data_dir_defaults_to_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_data_dir() == tmp_path / "xdg" / "barrel"
    assert load_config(None).data_dir == tmp_path / "xdg" / "barrel"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/is/ignored")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_data_dir() == tmp_path / ".local/share/barrel"


def test_default_config_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    if not Path("/etc/barrel/barreld.toml").exists():
        assert default_config_path() is None
    (tmp_path / "barrel").mkdir()
    (tmp_path / "barrel/barreld.toml").write_text("")
    assert default_config_path() == tmp_path / "barrel/barreld.toml"


# every mistake: one line naming the file and the key


BAD = [
    # (file text, key, fragment of the reason)
    ("[tiers.ram\nquota = 1", "line 1, column 11", "TOML syntax error"),
    ("quota = = 1", "line 1, column 9", "TOML syntax error"),
    ("colour = 1", "colour", "unknown key"),
    ("[daemon]\npidfile = 'x'", "daemon.pidfile", "unknown key"),
    ("[tiers.ram]\nquotta = '1G'", "tiers.ram.quotta", "unknown key"),
    ("[tiers.ram]\nroot = '/tmp'", "tiers.ram.root", "unknown key"),
    ("[scheduler]\nhigh = 0.9", "scheduler.high", "unknown key"),
    ("[policy]\nmin_token = 5", "policy.min_token", "unknown policy key"),
    ("[[models]]\nname = 'smollm2'\ncolour = 1", "models[0].colour", "unknown key"),
    ("[[models]]\nname = 'smollm2'\npolicy = { nope = 1 }", "models[0].policy.nope", "unknown policy key"),
    ("[tiers.nvme]\nquota = '1G'", "tiers.nvme", "unknown key"),
    ("[[models]]\nname = 'smollm2'\ntier = 'nvme'", "models[0].tier", "unknown tier 'nvme'"),
    ("[[models]]\nname = 'smollm2'\naliases = 'claude-*'", "models[0].aliases", "array of glob patterns"),
    ("[[models]]\nname = 'smollm2'\nstop = '\\nUser:'", "models[0].stop", "array of strings"),
    ("[[models]]\nname = 'smollm2'\nstop = ['']", "models[0].stop", "1..256 bytes"),
    ("[[models]]\nname = 'smollm2'\nstop = [1]", "models[0].stop", "expected a string"),
    ("[[models]]\nname = 'smollm2'\naliases = ['claude *']", "models[0].aliases", "bad alias 'claude *'"),
    ("[[models]]\nname = 'smollm2'\naliases = [1]", "models[0].aliases", "expected a string"),
    ("[[models]]\nname = 'smollm2'\nchat_template = 'none.jinja'", "models[0].chat_template", "cannot read"),
    ("[scheduler]\nevict_tiers = ['ram', 'gpu']", "scheduler.evict_tiers", "unknown tier 'gpu'"),
    ("[scheduler]\nevict_tiers = []", "scheduler.evict_tiers", "non-empty list"),
    ("[scheduler]\nevict_tiers = 'ram'", "scheduler.evict_tiers", "non-empty list"),
    ("[scheduler]\nevict_tiers = ['ram', 'ram']", "scheduler.evict_tiers", "twice"),
    ("[tiers.ram]\nquota = -1", "tiers.ram.quota", "cannot be negative"),
    ("[tiers.disk]\nquota = '-5G'", "tiers.disk.quota", "bad size '-5G'"),
    ("[tiers.disk]\nquota = '12X'", "tiers.disk.quota", "bad size '12X'"),
    ("[tiers.disk]\nquota = 1.5", "tiers.disk.quota", "bad size 1.5"),
    ("[tiers.disk]\nquota = true", "tiers.disk.quota", "bad size True"),
    ("[tiers.disk]\nquota = '9000000T'", "tiers.disk.quota", "larger than the maximum"),
    ("tiers = 5", "tiers", "expected a table"),
    ("[scheduler]\nlow_watermark = 0.9", "scheduler.low_watermark", "must be below high_watermark"),
    ("[scheduler]\nlow_watermark = 0.85", "scheduler.low_watermark", "must be below high_watermark"),
    ("[scheduler]\nhigh_watermark = 1.5", "scheduler.high_watermark", "from 0 to 1"),
    ("[scheduler]\nlow_watermark = -0.1", "scheduler.low_watermark", "from 0 to 1"),
    ("[scheduler]\nhigh_watermark = '0.9'", "scheduler.high_watermark", "from 0 to 1"),
    ("[scheduler]\nhigh_watermark = nan", "scheduler.high_watermark", "from 0 to 1"),
    (
        "[scheduler]\npressure_source = 'memsup'",
        "scheduler.pressure_source",
        "unknown pressure source 'memsup'",
    ),
    (
        "[scheduler]\npressure_source = 'module:barrel_nope.x'",
        "scheduler.pressure_source",
        "cannot find module",
    ),
    ("[scheduler]\npressure_source = 5", "scheduler.pressure_source", "expected a string"),
    ("[scheduler]\nenabled = 'yes'", "scheduler.enabled", "expected true or false"),
    ("[scheduler]\ninterval_ms = 0", "scheduler.interval_ms", "whole number >= 1"),
    ("[scheduler]\ninterval_ms = 1.5", "scheduler.interval_ms", "whole number >= 1"),
    ("[policy]\nmin_tokens = 'lots'", "policy.min_tokens", "bad value 'lots'"),
    ("[policy]\nboundary_align_tokens = 0", "policy.boundary_align_tokens", "bad value 0"),
    ("[policy]\nprefill_chunk_size = [1]", "policy.prefill_chunk_size", "bad value [1]"),
    (
        "[[models]]\nname = 'smollm2'\npolicy = { min_tokens = -1 }",
        "models[0].policy.min_tokens",
        "bad value -1",
    ),
    ("[[models]]\ntier = 'disk'", "models[0].name", "missing"),
    ("[[models]]\nname = 'a b'", "models[0].name", "bad model name"),
    ("[[models]]\nname = 42", "models[0].name", "expected a string"),
    ("[[models]]\nname = 'smollm2'\n[[models]]\nname = 'smollm2'", "models[1].name", "listed twice"),
    ("[[models]]\nname = 'other'", "models[0].path", "only the bundled model"),
    ("[[models]]\nname = 'x'\npath = 'missing.gguf'", "models[0].path", "no such model file"),
    ("[[models]]\nname = 'smollm2'\nn_ctx = 0", "models[0].n_ctx", "whole number >= 1"),
    ("[[models]]\nname = 'smollm2'\nn_batch = '512'", "models[0].n_batch", "whole number >= 1"),
    ("[[models]]\nname = 'smollm2'\nn_seq_max = true", "models[0].n_seq_max", "whole number >= 1"),
    ("[[models]]\nname = 'smollm2'\nfingerprint = 'md5'", "models[0].fingerprint", "unknown mode 'md5'"),
    ("[[models]]\nname = 'smollm2'\nfingerprint = 'fast_unsafe'", "models[0].fingerprint_digest", "missing"),
    (
        "[[models]]\nname = 'smollm2'\nfingerprint_digest = 'ab'",
        "models[0].fingerprint_digest",
        "fast_unsafe",
    ),
    ("[[models]]\nname = 'smollm2'\nn_threads = 0", "models[0].n_threads", "whole number >= 1"),
    ("[[models]]\nname = 'smollm2'\nn_gpu_layers = -2", "models[0].n_gpu_layers", "whole number >= -1"),
    ("[[models]]\nname = 'smollm2'\nflash_attn = 'on'", "models[0].flash_attn", "expected true or false"),
    ("[[models]]\nname = 'smollm2'\nswa_full = 1", "models[0].swa_full", "expected true or false"),
    ("[[models]]\nname = 'smollm2'\ntype_k = 'q3_k'", "models[0].type_k", "unknown cache type 'q3_k'"),
    ("[[models]]\nname = 'smollm2'\ntype_v = 8", "models[0].type_v", "expected a string"),
    ("[[models]]\nname = 'smollm2'\ntype_v = 'q8_0'\nflash_attn = false", "models[0].type_v", "needs flash_attn"),
    ("[models]\nname = 'smollm2'", "models", "array of tables"),
    ("[daemon]\nwriters = 0", "daemon.writers", "whole number >= 1"),
    ("[daemon]\nsocket = ''", "daemon.socket", "expected a path"),
]


@pytest.mark.parametrize(("text", "key", "fragment"), BAD, ids=[case[1] + ":" + case[2] for case in BAD])
def test_bad_config_is_one_line_naming_file_and_key(
    tmp_path: Path, text: str, key: str, fragment: str
) -> None:
    path = write_config(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, tmp_path / "data")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: {key}: "), message
    assert fragment in message
    assert (info.value.file, info.value.key) == (str(path), key)


# tier roots


def test_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=r": tiers\.disk\.root: .*afile is not a directory$"):
        load(tmp_path, "[tiers.disk]\nroot = '{tmp}/afile'")


def test_root_below_a_file_cannot_be_created(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(
        ConfigError, match=r": tiers\.ram_file\.root: .*cannot be created: .*afile is not a directory"
    ):
        load(tmp_path, "[tiers.ram_file]\nroot = '{tmp}/afile/sub/dir'")


def test_missing_root_under_a_writable_dir_is_fine(tmp_path: Path) -> None:
    config = load(tmp_path, "[tiers.disk]\nroot = '{tmp}/not/yet/there'")
    assert config.tiers["disk"].root == tmp_path / "not/yet/there"
    assert not (tmp_path / "not").exists(), "loading a config creates nothing"


def test_dangling_symlink_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match=r"tiers\.disk\.root: .*dangling symbolic link"):
        load(tmp_path, "[tiers.disk]\nroot = '{tmp}/link'")


def test_unwritable_root_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes anywhere, so stand in for the kernel's answer to an ordinary user
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    try:
        with pytest.raises(ConfigError, match=r"tiers\.disk\.root: .*locked is not readable, writable and searchable"):
            load(tmp_path, "[tiers.disk]\nroot = '{tmp}/locked'")
        with pytest.raises(
            ConfigError, match=r"tiers\.disk\.root: .*cannot be created: .*locked is not readable, writable"
        ):
            load(tmp_path, "[tiers.disk]\nroot = '{tmp}/locked/kvc'")
    finally:
        locked.chmod(0o700)


def test_shared_root_for_two_file_tiers_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tiers\.disk\.root: must not be the same directory"):
        load(tmp_path, "[tiers.ram_file]\nroot = '{tmp}/same'\n[tiers.disk]\nroot = '{tmp}/same/'")


def test_bad_data_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=r": daemon\.data_dir: .*afile is not a directory"):
        load_config(write_config(tmp_path, "[daemon]\ndata_dir = 'afile'"))
    with pytest.raises(ConfigError, match=r"\(built-in defaults\): data_dir: .*afile is not a directory"):
        load_config(None, tmp_path / "afile")


# the file itself


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^.*nope\.toml: cannot read: No such file or directory$"):
        load_config(tmp_path / "nope.toml", tmp_path)


def test_directory_as_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path, tmp_path)


def test_binary_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError) as info:
        load_config(path, tmp_path)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"{path}: ")


@pytest.mark.parametrize("text", ["safe", "gguf_chunked", "fast_unsafe:my-model-v1"])
def test_a_fingerprint_is_parsed_once_and_written_back_alike(text: str) -> None:
    assert str(Fingerprint.parse(text)) == text


@pytest.mark.parametrize("text", ["", "bogus", "safe:x", "fast_unsafe", "fast_unsafe:", "fast_unsafe:" + "x" * 257])
def test_a_bad_fingerprint_is_refused_with_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError):
        Fingerprint.parse(text)
