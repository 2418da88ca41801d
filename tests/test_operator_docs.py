"""The operator's documents stay true to the code: man pages, shell completions, the systemd unit.

Coverage is checked against the code itself (the typer app, barreld's --help, the config validator's own
lists of keys, the environment variables the sources read), so adding a command, option, key or variable
without documenting it fails here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAN1 = ROOT / "man" / "barrelctl.1"
MAN8 = ROOT / "man" / "barreld.8"
UNIT = ROOT / "systemd" / "barreld.service"
SYSUSERS = ROOT / "systemd" / "barrel.sysusers.conf"
COMPLETIONS = ROOT / "completions"


# ---- a small man(7) reader: enough to check what the text says without needing groff ----------------

_ESCAPES = {r"\-": "-", r"\e": "\\", r"\(lq": '"', r"\(rq": '"', r"\(ti": "~", r"\(em": "--", r"\ ": " ", r"\&": ""}
_ALTERNATING = {"BR", "RB", "BI", "IB", "IR", "RI"}


def _plain(text: str) -> str:
    text = re.sub(r"\\f[BIRP]", "", text)
    for escape, plain in _ESCAPES.items():
        text = text.replace(escape, plain)
    return text


def _roff_args(args: str) -> list[str]:
    """A macro's arguments as roff splits them: on spaces, except inside double quotes, where "" is a quote."""
    out, i = [], 0
    while i < len(args):
        if args[i] == " ":
            i += 1
        elif args[i] == '"':
            i, word = i + 1, []
            while i < len(args):
                if args.startswith('""', i):
                    word.append('"')
                    i += 2
                elif args[i] == '"':
                    i += 1
                    break
                else:
                    word.append(args[i])
                    i += 1
            out.append("".join(word))
        else:
            j = args.find(" ", i)
            j = len(args) if j < 0 else j
            out.append(args[i:j])
            i = j
    return out


def _macro_text(name: str, args: str) -> str:
    return ("" if name in _ALTERNATING else " ").join(_plain(a) for a in _roff_args(args))


def man_sections(path: Path) -> dict[str, str]:
    """Plain text per section and subsection: {"OPTIONS": ..., "COMMANDS/barrelctl cache dump ...": ...}."""
    sections: dict[str, list[str]] = {"": []}
    current_sh = current = ""
    for raw in path.read_text().splitlines():
        if raw.startswith('.\\"'):
            continue
        line = raw.replace("\\\\", "\\e")
        if line.startswith("."):
            name, _, args = line[1:].partition(" ")
            text = _macro_text(name, args)
            if name == "SH":
                current_sh = current = text
                sections.setdefault(current, [])
                continue
            if name == "SS":
                current = f"{current_sh}/{text}"
                sections.setdefault(current, [])
                continue
            sections[current].append(text)
        else:
            sections[current].append(_plain(line))
    return {name: "\n".join(lines) for name, lines in sections.items()}


def section(sections: dict[str, str], name: str) -> str:
    """A section's text with its subsections."""
    return "\n".join(text for key, text in sections.items() if key == name or key.startswith(name + "/"))


# ---- the man pages render ----------------------------------------------------------------------------


@pytest.mark.parametrize("page", [MAN1, MAN8], ids=lambda p: p.name)
def test_man_page_renders_without_warnings(page: Path) -> None:
    groff = shutil.which("groff")
    man = shutil.which("man")
    if not groff and not man:
        pytest.skip("neither groff nor man is installed")
    if groff:
        p = subprocess.run([groff, "-man", "-ww", "-z", str(page)], capture_output=True, text=True)
        assert p.returncode == 0 and p.stderr == "", p.stderr
    if man:
        env = {**os.environ, "MANWIDTH": "80", "MAN_KEEP_FORMATTING": "0"}
        p = subprocess.run([man, "-l", "--warnings", str(page)], capture_output=True, text=True, env=env)
        assert p.returncode == 0 and p.stderr == "", p.stderr
        text = p.stdout
        assert text.count("\n") > 100
        wide = [line for line in re.sub(r".\x08", "", text).splitlines() if len(line) > 80]
        assert not wide, wide   # examples and JSON shapes fit an 80-column terminal


def test_pages_name_each_other_and_sections_match() -> None:
    assert MAN1.read_text().splitlines()[3].startswith(".TH BARRELCTL 1 ")
    assert MAN8.read_text().splitlines()[3].startswith(".TH BARRELD 8 ")
    assert "barreld(8)" in section(man_sections(MAN1), "SEE ALSO")
    assert "barrelctl(1)" in section(man_sections(MAN8), "SEE ALSO")


# ---- barrelctl.1 covers the CLI ----------------------------------------------------------------------


def _cli():
    import typer.main

    from barrelctl.app import app

    return typer.main.get_command(app)


def _walk(command, path: tuple[str, ...]):
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _walk(sub, (*path, name))


def _names(command, ctx, root: bool) -> list[str]:
    """Every spelling of every option, and each argument's metavar (PROMPT, NAME, SIZE)."""
    names = []
    params = list(command.params)
    help_option = command.get_help_option(ctx)
    if help_option is not None and root:   # the root's -h/--help covers every command
        params.append(help_option)
    for param in params:
        if param.param_type_name == "argument":
            names.append(param.name.upper())
        else:
            names.extend(param.opts + param.secondary_opts)
    return names


def test_every_command_and_option_is_in_barrelctl_1() -> None:
    import typer._click as click

    sections = man_sections(MAN1)
    headings = {key.split("/", 1)[1]: text for key, text in sections.items() if key.startswith("COMMANDS/")}
    root = _cli()
    missing = []
    commands = list(_walk(root, ("barrelctl",)))
    for path, command in commands:
        ctx = click.Context(command, info_name=path[-1])
        if path == ("barrelctl",):
            where, text = "OPTIONS", section(sections, "OPTIONS")
            assert "for the command it follows" in text   # -h/--help, once for every command
        elif getattr(command, "commands", None):
            continue   # a group (cache, daemon, scheduler): its commands have the headings
        else:
            title = " ".join(path)
            matches = [h for h in headings if h == title or h.startswith(title + " ")]
            if len(matches) != 1:
                missing.append(f"no COMMANDS subsection headed {title!r}")
                continue
            where, text = matches[0], headings[matches[0]] + "\n" + matches[0]
        for name in _names(command, ctx, path == ("barrelctl",)):
            if name.startswith("-"):
                found = re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)
            else:
                found = re.search(rf"\b{re.escape(name)}\b", text)
            if not found:
                missing.append(f"{' '.join(path)}: {name} not in {where}")
    assert not missing, "\n".join(missing)
    # ...and nothing documented that does not exist.
    leaves = {" ".join(p) for p, c in commands if not getattr(c, "commands", None)}
    stale = [h for h in headings if not any(h == leaf or h.startswith(leaf + " ") for leaf in leaves)]
    assert not stale, stale


def test_barrelctl_exit_statuses_are_documented() -> None:
    from barrelctl import errors

    text = section(man_sections(MAN1), "EXIT STATUS")
    codes = {v for k, v in vars(errors).items() if k.startswith("EXIT_")}
    assert codes == {0, 1, 2, 3}
    for code in codes:
        assert re.search(rf"^{code}\n", text, re.M), code


# ---- barreld.8 covers the daemon ---------------------------------------------------------------------


def test_every_barreld_option_is_in_barreld_8() -> None:
    p = subprocess.run([sys.executable, "-m", "barreld", "--help"], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    options = set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", p.stdout.split("options:", 1)[1]))
    assert {"--socket", "--data-dir", "--config", "--log-level", "--version", "-h", "--help"} <= options
    text = section(man_sections(MAN8), "OPTIONS")
    missing = [o for o in sorted(options) if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text)]
    assert not missing, missing


def _allowed_keys(tmp_path: Path, toml: str) -> list[str]:
    """The keys the config validator accepts in a table, read off its own unknown-key message."""
    from barreld.config import ConfigError, load_config

    cfg = tmp_path / "probe.toml"
    shm = f"\n[tiers.ram_file]\nroot = '{tmp_path / 'shm'}'\n"   # keep /dev/shm out of it
    cfg.write_text(toml if "[tiers.ram_file]" in toml else toml + shm)
    with pytest.raises(ConfigError) as info:
        load_config(cfg, tmp_path / "data")
    match = re.search(r"\((?:expected one of|known): ([^)]*)\)", info.value.reason)
    assert match, info.value.reason
    return [k.strip() for k in match.group(1).split(",")]


def test_every_config_key_is_in_barreld_8(tmp_path: Path) -> None:
    sections = man_sections(MAN8)
    config = section(sections, "CONFIGURATION")
    tables = {
        "daemon": _allowed_keys(tmp_path, "[daemon]\nbogus = 1\n"),
        "policy": _allowed_keys(tmp_path, "[policy]\nbogus = 1\n"),
        "scheduler": _allowed_keys(tmp_path, "[scheduler]\nbogus = 1\n"),
        "models": _allowed_keys(tmp_path, "[[models]]\nname = 'x'\nbogus = 1\n"),
        "http": _allowed_keys(tmp_path, "[http]\nbogus = 1\n"),
        "cache": _allowed_keys(tmp_path, "[cache]\nbogus = 1\n"),
    }
    top = _allowed_keys(tmp_path, "bogus = 1\n")
    tiers = _allowed_keys(tmp_path, "[tiers.bogus]\n")
    assert set(top) == {"daemon", "tiers", "policy", "scheduler", "models", "http", "cache"}
    assert {"socket", "data_dir", "writers", "max_queue", "socket_group"} == set(tables["daemon"])
    heading = {"daemon": "[daemon]", "policy": "[policy]", "scheduler": "[scheduler]", "models": "[[models]]",
               "http": "[http]", "cache": "[cache]"}
    missing = []
    for table, keys in tables.items():
        text = sections.get(f"CONFIGURATION/{heading[table]}", "")
        assert text, f"no CONFIGURATION subsection {heading[table]}"
        missing += [f"{table}.{k}" for k in keys if not re.search(rf"(^|, ){re.escape(k)}\b", text, re.M)]
    tier_heading = "CONFIGURATION/" + ", ".join(f"[tiers.{t}]" for t in tiers)
    assert tier_heading in sections, sorted(sections)
    for tier in tiers:
        root = f"root = '{tmp_path / 'shm'}'\n" if tier == "ram_file" else ""
        keys = _allowed_keys(tmp_path, f"[tiers.{tier}]\n{root}bogus = 1\n")
        missing += [f"tiers.{tier}.{k}" for k in keys if not re.search(rf"^{k}\b", sections[tier_heading], re.M)]
    assert not missing, missing
    # The contract's example keys, once more by name, and the policy's defaults as the code has them.
    from barreld.engine.policy import Policy

    for key, value in Policy().as_dict().items():
        text = sections["CONFIGURATION/[policy]"]
        block = text.split(f"\n{key}\n", 1)[1].split("\n\n")[0] if f"\n{key}\n" in text else ""
        assert f"Default: {value}" in block.replace('"', "") or f"Default: {value}." in block, (key, value)
    assert "evict_save_timeout_ms" in config


def _env_vars(paths: list[Path]) -> set[str]:
    found: set[str] = set()
    for path in paths:
        for file in [path] if path.is_file() else path.rglob("*.py"):
            if "rpc" in file.parts or "sandbox" in file.stem:  # generated code; harnesses for tests and benches
                continue
            found |= set(re.findall(r"""["']((?:BARREL|XDG)_[A-Z_]+|NOTIFY_SOCKET)["']""", file.read_text()))
    return found


def test_every_environment_variable_is_documented() -> None:
    daemon_vars = _env_vars([ROOT / "barreld"])
    client_vars = _env_vars([ROOT / "barrelctl", ROOT / "barreld" / "paths.py"])
    assert {"BARREL_SOCKET", "BARREL_LOG_LEVEL", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "XDG_DATA_HOME",
            "NOTIFY_SOCKET"} <= daemon_vars
    # Test hooks go in through tests/faultd.py, never through the daemon's environment.
    assert not {v for v in daemon_vars | client_vars if v.startswith(("BARREL_TEST", "BARREL_FAULT"))}
    for page, names in ((MAN8, daemon_vars), (MAN1, client_vars)):
        text = section(man_sections(page), "ENVIRONMENT")
        missing = [n for n in sorted(names) if not re.search(rf"^{n}\b", text, re.M) and f", {n}" not in text]
        assert not missing, (page.name, missing)


def test_barreld_8_signals_exit_statuses_and_files() -> None:
    from barreld.lifecycle import LOCK_NAME
    from barreld.paths import SYSTEM_SOCKET

    sections = man_sections(MAN8)
    signals = section(sections, "SIGNALS")
    assert "SIGTERM, SIGINT" in signals and "shutdown" in signals and "evict_save_timeout_ms" in signals
    exits = section(sections, "EXIT STATUS")
    for code in (0, 1, 2):
        assert re.search(rf"^{code}\n", exits, re.M), code
    files = section(sections, "FILES")
    for needle in (str(SYSTEM_SOCKET), "$XDG_RUNTIME_DIR/barrel/barreld.sock", "/tmp/barrel-$UID/barreld.sock",
                   LOCK_NAME, "barreld.log", "/dev/shm/barrel-$UID/", "/var/lib/barrel/", "$XDG_DATA_HOME/barrel/",
                   "/etc/barrel/barreld.toml", "$XDG_CONFIG_HOME/barrel/barreld.toml", "index.lmdb", ".kvc"):
        assert needle in files, needle


# ---- completions -------------------------------------------------------------------------------------


def test_committed_completions_are_current(tmp_path: Path) -> None:
    from barrelctl import completions

    fresh = completions.generate()
    assert set(fresh) == {"barrelctl.bash", "_barrelctl", "barrelctl.fish"}
    for name, text in fresh.items():
        committed = COMPLETIONS / name
        assert committed.is_file(), f"{committed} missing: run `python -m barrelctl.completions`"
        assert committed.read_text() == text, f"{committed} is stale: run `python -m barrelctl.completions`"
    # The documented command itself: writes the same files, and --check agrees.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "barrelctl.completions", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert {f.name: f.read_text() for f in tmp_path.iterdir()} == fresh
    p = subprocess.run([sys.executable, "-m", "barrelctl.completions", "--check"], capture_output=True, env=env)
    assert p.returncode == 0, p.stderr
    (tmp_path / "_barrelctl").write_text("# old\n")
    p = subprocess.run([sys.executable, "-m", "barrelctl.completions", "--check", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 1 and "_barrelctl" in p.stderr


@pytest.fixture
def barrelctl_on_path(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH has `barrelctl` as pip installs it: a console script named barrelctl."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "barrelctl"
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom barrelctl.app import main\nsys.exit(main())\n")
    script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BARREL_", "COMP_", "_BARRELCTL"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT),
               XDG_RUNTIME_DIR=str(tmp_path / "run"))
    return env


def _bash_complete(env: dict[str, str], *words: str) -> subprocess.CompletedProcess:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    words_arr = " ".join(shlex.quote(w) for w in words)
    script = (
        f"source {shlex.quote(str(COMPLETIONS / 'barrelctl.bash'))}\n"
        "complete -p barrelctl >/dev/null || exit 9\n"
        f"COMP_WORDS=({words_arr}); COMP_CWORD={len(words) - 1}\n"
        '_barrelctl_completion barrelctl "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"\n'
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    return subprocess.run([bash, "--norc", "--noprofile", "-c", script], capture_output=True, text=True,
                          env=env, timeout=60)


@pytest.mark.slow
def test_bash_completion_completes_ca_to_cache(barrelctl_on_path: dict[str, str]) -> None:
    p = _bash_complete(barrelctl_on_path, "barrelctl", "ca")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["cache"], (p.stdout, p.stderr)
    p = _bash_complete(barrelctl_on_path, "barrelctl", "cache", "ev")
    assert p.stdout.split() == ["evict-bytes"], (p.stdout, p.stderr)
    p = _bash_complete(barrelctl_on_path, "barrelctl", "cache", "dump", "--ti")
    assert p.stdout.split() == ["--tier"], (p.stdout, p.stderr)
    p = _bash_complete(barrelctl_on_path, "barrelctl", "")
    assert {"complete", "chat", "load", "unload", "models", "cache", "scheduler", "daemon"} <= set(p.stdout.split())


def test_bash_completion_prints_nothing_on_stderr(barrelctl_on_path: dict[str, str]) -> None:
    p = _bash_complete(barrelctl_on_path, "barrelctl", "ca")
    assert p.stderr == ""


@pytest.mark.slow
def test_zsh_and_fish_callbacks_answer(barrelctl_on_path: dict[str, str]) -> None:
    """What the zsh and fish scripts run at <Tab>, without needing those shells installed."""
    zsh = subprocess.run(["barrelctl"], capture_output=True, text=True, env={
        **barrelctl_on_path, "_BARRELCTL_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": "barrelctl ca"})
    assert '"cache":' in zsh.stdout, zsh.stdout
    fish = subprocess.run(["barrelctl"], capture_output=True, text=True, env={
        **barrelctl_on_path, "_BARRELCTL_COMPLETE": "complete_fish", "_TYPER_COMPLETE_FISH_ACTION": "get-args",
        "_TYPER_COMPLETE_ARGS": "barrelctl cache "})
    assert {"dump", "stats", "gc", "evict-bytes", "verify"} <= {line.split("\t")[0] for line in
                                                               fish.stdout.splitlines()}, fish.stdout
    for shell, name in (("zsh", "_barrelctl"), ("fish", "barrelctl.fish")):
        exe = shutil.which(shell)
        if exe:   # a syntax check where the shell exists
            p = subprocess.run([exe, "-n", str(COMPLETIONS / name)], capture_output=True, text=True)
            assert p.returncode == 0, p.stderr


# ---- systemd -----------------------------------------------------------------------------------------


def unit_settings(path: Path = UNIT) -> dict[str, list[str]]:
    """`Section.Key` -> every value it is given, in order."""
    out: dict[str, list[str]] = {}
    sect = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            sect = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{sect}.{key.strip()}", []).append(value.strip())
    return out


def _seconds(value: str) -> float:
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*(min|ms|s|h)?", value):
        total += float(number) * {"ms": 0.001, "s": 1, "": 1, "min": 60, "h": 3600}[unit]
    return total


def test_unit_runs_barreld_as_the_contract_says() -> None:
    from barreld.engine.policy import Policy
    from barreld.paths import SYSTEM_SOCKET

    s = {k: v[-1] for k, v in unit_settings().items()}
    assert s["Service.Type"] == "notify"
    argv = shlex.split(s["Service.ExecStart"])
    assert argv[0] == "/usr/local/bin/barreld"
    assert argv[1:] == ["--socket", str(SYSTEM_SOCKET), "--data-dir", "/var/lib/barrel"]
    assert s["Service.RuntimeDirectory"] == "barrel" == SYSTEM_SOCKET.parent.name
    assert s["Service.StateDirectory"] == "barrel"
    # The decode checks that passed are remembered where the service may write (barreld.engine.decodecheck).
    assert s["Service.CacheDirectory"] == "barrel" and s["Service.Environment"] == "XDG_CACHE_HOME=%C"
    assert s["Service.User"] == "barrel" or s.get("Service.DynamicUser") == "yes"
    assert s["Service.KillSignal"] == "SIGTERM"
    # Shutdown saves are each bounded by evict_save_timeout_ms; then the writers flush.
    assert _seconds(s["Service.TimeoutStopSec"]) >= Policy().evict_save_timeout_ms / 1000 + 30
    assert s["Service.ProtectSystem"] == "strict"
    assert s["Service.ProtectHome"] == "read-only"   # models under /home stay readable
    assert s["Service.PrivateTmp"] == "yes" and s["Service.NoNewPrivileges"] == "yes"
    # /dev/shm (the ram_file tier) stays writable: no private /dev, nothing making it read-only or hidden.
    assert s.get("Service.PrivateDevices", "no") == "no"
    # GPUs stay reachable: any DeviceAllow= (ProtectClock=yes implies one) closes every other device node.
    assert not {"Service.DeviceAllow", "Service.DevicePolicy"} & set(s)
    assert s.get("Service.ProtectClock", "no") == "no"
    assert "/dev/shm" in s.get("Service.ReadWritePaths", "")
    for key in ("ReadOnlyPaths", "InaccessiblePaths", "TemporaryFileSystem"):
        assert "/dev" not in s.get(f"Service.{key}", "")
    assert s.get("Service.RemoveIPC", "no") == "no"   # would delete the ram_file tier's files at stop
    assert s["Install.WantedBy"] == "multi-user.target"


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # ExecStart must name an executable for verify: stand in one that runs this tree's barreld.
    barreld = tmp_path / "barreld"
    barreld.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(ROOT))} exec {shlex.quote(sys.executable)} "
                       '-m barreld "$@"\n')
    barreld.chmod(0o755)
    unit = tmp_path / "barreld.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/barreld", str(barreld)))
    # Documentation=man:... is checked with man(1): our pages must be findable by name and section.
    for page, sect in ((MAN1, "man1"), (MAN8, "man8")):
        (tmp_path / "man" / sect).mkdir(parents=True, exist_ok=True)
        shutil.copy(page, tmp_path / "man" / sect / page.name)
    env = {**os.environ, "MANPATH": str(tmp_path / "man"), "SYSTEMD_LOG_COLOR": "0"}
    p = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip() == "" and p.stdout.strip() == "", p.stderr + p.stdout   # warnings count too
    p = subprocess.run([analyze, "security", "--offline=yes", str(unit)], capture_output=True, text=True,
                       env=env, cwd=tmp_path)
    if p.returncode == 0 or "Overall exposure level" in p.stdout:
        level = float(re.search(r"Overall exposure level for \S+: (\d+\.\d+)", p.stdout).group(1))
        assert level <= 4.0, p.stdout[-2000:]


def test_sysusers_snippet_creates_the_units_user(tmp_path: Path) -> None:
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is None:
        pytest.skip("systemd-sysusers is not installed")
    (tmp_path / "etc").mkdir()
    p = subprocess.run([sysusers, f"--root={tmp_path}", str(SYSUSERS)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    user = unit_settings()["Service.User"][-1]
    passwd = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    assert user in passwd
    assert passwd[user][5] == "/var/lib/barrel"


# ---- README ------------------------------------------------------------------------------------------


def test_readme_has_the_operator_sections() -> None:
    readme = (ROOT / "README.md").read_text()
    for heading in ("## Configuration", "## Running as a service", "## Inspecting the cache",
                    "## Man pages and completions"):
        assert heading in readme, heading
    for needle in ("systemd/barreld.service", "systemctl enable --now barreld", "systemd-sysusers",
                   "python -m barrelctl.completions", "man -l man/barrelctl.1", "barrelctl cache evict-bytes 256M"):
        assert needle in readme, needle


def _toml_blocks(text: str) -> list[str]:
    return re.findall(r"```toml\n(.*?)```", text, re.S)


def test_documented_config_examples_load_with_the_defaults(tmp_path: Path) -> None:
    """The README's annotated config and barreld.8's example are valid files that say the defaults."""
    from barreld.config import SchedulerConfig, load_config
    from barreld.engine.policy import Policy

    man_example = man_sections(MAN8)["CONFIGURATION/Example"]
    examples = [*_toml_blocks((ROOT / "README.md").read_text()), man_example]
    assert len(examples) == 2
    for i, text in enumerate(examples):
        text = text.replace("/dev/shm/barrel-1000", str(tmp_path / "shm")).replace(
            "/var/lib/barrel/kvc", str(tmp_path / "kvc"))
        cfg = tmp_path / f"example{i}.toml"
        cfg.write_text(text)
        config = load_config(cfg, tmp_path / "data")
        assert config.policy == Policy()
        assert config.scheduler == SchedulerConfig()
        assert {n: t.quota for n, t in config.tiers.items()} == {"ram": 2 << 30, "ram_file": 4 << 30,
                                                                  "disk": 50 << 30}
        assert [m.name for m in config.models] == ["smollm2"]
