"""Conversations end to end, against the real daemon and model: `barrelctl chat` in a real pseudo-terminal
(prompt_toolkit reading keys, the reply streamed, Ctrl-C and Ctrl-D), the same with stdin piped, and
`complete --messages` against the same conversation rendered by hand.

One daemon serves the module. Turns after the first must start warm: route `live` or `exact`, and at least
the previous turn's prompt restored, less SLACK: a restore may stop short of the prompt's end at a block
boundary (256 tokens), so the conversation opens with a system message longer than that.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pexpect
import pytest

from barreld.engine.chat import Message
from tests.support.sandbox import Sandbox
from tests.support.sandbox_models import gemma_path

pytestmark = pytest.mark.model

SLACK = 256
SYSTEM = "You are a patient science teacher. " + " ".join(
    f"Rule {i}: answer in plain words, keep it short, and never repeat the question." for i in range(1, 25)
)
FOOTER = re.compile(
    rb"(live|exact|resume|longest_prefix|miss)(?: from (\w+))? \xc2\xb7 (\d+) restored \xc2\xb7 (\d+) prefilled "
    rb"\xc2\xb7 first token [\d.]+ m?s \xc2\xb7 (\d+) tokens"
)
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\r")
SPINNER = "waiting for the model…".encode()


@dataclass(frozen=True)
class Footer:
    route: str
    restored: int
    prefilled: int

    @property
    def prompt(self) -> int:
        return self.restored + self.prefilled

    def warm_after(self, earlier: Footer) -> bool:
        return self.route in ("live", "exact") and self.restored > 0 and self.restored >= earlier.prompt - SLACK


class Terminal:
    """`barrelctl chat` on a pseudo-terminal, as a person at an xterm would drive it; `stdout` redirects the
    command's standard output to that file, as a shell's `>` would."""

    def __init__(self, box: Sandbox, *args: str, stdout: Path | None = None) -> None:
        # No cursor-position requests: nobody on this terminal answers them.
        # Faulthandler: SIGABRT makes the client print every thread's stack (`expect`).
        env = box.env(TERM="xterm-256color", PROMPT_TOOLKIT_NO_CPR="1", PYTHONFAULTHANDLER="1")
        self.box = box
        argv = [sys.executable, "-m", "barrelctl", "chat", *args]
        if stdout is not None:
            argv = ["/bin/sh", "-c", 'exec "$@" > "$0"', str(stdout), *argv]
        self.child = pexpect.spawn(argv[0], argv[1:], env=env, cwd=str(box.base), timeout=180,
                                   dimensions=(40, 200))

    def ask(self, text: str) -> Footer:
        self.expect(">>>")
        self.child.sendline(text)
        self.expect(FOOTER)
        m = self.child.match
        return Footer(m.group(1).decode(), int(m.group(3)), int(m.group(4)))

    def expect(self, pattern: str | re.Pattern[bytes]) -> None:
        """Expects pattern; when it does not come, fails with what the client wrote and the daemon's log. On
        a timeout SIGABRT first makes the client and the daemon (faulthandler, on in both) write every
        thread's stack, the client's to the terminal, the daemon's to its log, whose lines before it show."""
        try:
            self.child.expect(pattern)
            return
        except pexpect.EOF:
            client = self.child.before or b""
            self.child.close()
            what = f"the client ended (exit status {self.child.exitstatus}, signal {self.child.signalstatus})"
        except pexpect.TIMEOUT:
            for pid in [self.child.pid, *self.box.daemon_pids()]:
                os.kill(pid, signal.SIGABRT)
            time.sleep(2)
            try:
                client = self.child.read_nonblocking(1 << 20, timeout=5)
            except (pexpect.TIMEOUT, pexpect.EOF):
                client = b""
            what = "it timed out"
        shown = ANSI.sub(b"", client).decode(errors="replace")[-6000:]
        log = self.box.log_text()
        dump = log.rfind("Fatal Python error")
        raise AssertionError(
            f"{getattr(pattern, 'pattern', pattern)!r} did not come: {what}. The client:\n{shown}"
            f"\nThe daemon's log:\n{log[max(0, dump - 6000) if dump >= 0 else -12000:]}"
        ) from None

    def command(self, line: str, answer: str) -> None:
        self.expect(">>>")
        self.child.sendline(line)
        self.expect(re.escape(answer))

    def reply_started(self, min_chars: int) -> str:
        """Reads until the reply (what follows the last spinner frame) holds min_chars letters."""
        seen = b""
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            seen += self.child.read_nonblocking(4096, timeout=180)
            plain = ANSI.sub(b"", seen)
            if SPINNER in plain:
                reply = plain.rsplit(SPINNER, 1)[1]
                if sum(c.isalpha() for c in reply.decode("utf-8", "replace")) >= min_chars:
                    return reply.decode("utf-8", "replace")
        raise AssertionError(f"no reply began: {seen[-400:]!r}")

    def leave(self) -> int:
        self.expect(">>>")
        self.child.sendeof()
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus


def running(box: Sandbox) -> int:
    return sum(m["running"] + m["queued"] for m in box.ctl("--json", "models").json()["models"])


def test_a_chat_starts_warm_every_turn_and_resumes_warm(served: Sandbox, tmp_path: Path) -> None:
    term = Terminal(served, "--system", SYSTEM, "--max-tokens", "24")
    first = term.ask("Why is the sky blue?")
    second = term.ask("And why are sunsets red?")
    third = term.ask("Say both answers again in one line.")
    assert first.prompt > SLACK
    assert second.warm_after(first), (first, second)
    assert third.warm_after(second), (second, third)
    saved = tmp_path / "chat.json"
    term.command(f"/save {saved}", f"saved 7 messages to {saved}")
    assert term.leave() == 0
    doc = json.loads(saved.read_text())
    assert [m["role"] for m in doc] == ["system"] + ["user", "assistant"] * 3
    assert doc[0]["content"] == SYSTEM and doc[5]["content"] == "Say both answers again in one line."

    again = Terminal(served, "--resume", str(saved), "--max-tokens", "8")
    resumed = again.ask("Thank you.")
    assert resumed.warm_after(third), (third, resumed)
    assert again.leave() == 0


@pytest.mark.serial
def test_ctrl_c_stops_the_reply_in_the_daemon_and_the_session_goes_on(served: Sandbox, tmp_path: Path) -> None:
    term = Terminal(served, "--max-tokens", "300")
    term.expect(">>>")
    term.child.sendline("Write a very long story about a dragon and a knight.")
    term.reply_started(min_chars=12)
    term.child.sendintr()
    term.child.expect("cancelled; this turn is not kept")
    deadline = time.monotonic() + 15
    while running(served) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running(served) == 0   # the daemon stopped generating the story
    # History: Up recalls the cancelled line; Ctrl-U clears it for a new question.
    term.expect(">>>")
    term.child.send("\x1b[A")
    term.child.expect("a knight.")
    term.child.send("\x15")
    term.child.sendline("Say hello.")
    term.expect(FOOTER)
    saved = tmp_path / "after.json"
    term.command(f"/save {saved}", "saved 2 messages")
    assert [m["content"] for m in json.loads(saved.read_text()) if m["role"] == "user"] == ["Say hello."]
    assert term.leave() == 0


def test_with_stdout_redirected_the_prompt_stays_on_the_terminal(served: Sandbox, tmp_path: Path) -> None:
    out = tmp_path / "replies.txt"
    term = Terminal(served, "--max-tokens", "8", stdout=out)
    term.ask("Name a fruit.")
    saved = tmp_path / "fruit.json"
    term.command(f"/save {saved}", "saved 2 messages")
    assert term.leave() == 0
    assert out.read_text() == json.loads(saved.read_text())[1]["content"] + "\n"


def test_piped_stdin_is_one_message_per_line(served: Sandbox, tmp_path: Path) -> None:
    saved = tmp_path / "piped.json"
    lines = f"Name a colour.\n\n/nonsense\nName another one.\n/save {saved}\n/exit\nNever sent.\n"
    r = served.ctl("chat", "--system", SYSTEM, "--max-tokens", "12", input=lines.encode())
    assert r.rc == 0, r.err
    footers = [Footer(m.group(1).decode(), int(m.group(3)), int(m.group(4)))
               for m in FOOTER.finditer(r.err.encode())]
    assert len(footers) == 2, r.err
    assert footers[1].warm_after(footers[0]), footers
    assert "barrelctl: unknown command /nonsense; /help lists the commands" in r.err
    doc = json.loads(saved.read_text())
    assert [m["content"] for m in doc if m["role"] == "user"] == ["Name a colour.", "Name another one."]
    replies = [m["content"] for m in doc if m["role"] == "assistant"]
    assert r.out == "".join(reply + "\n" for reply in replies)   # stdout holds the replies and nothing else


HAND_RENDERED = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n"
    "<|im_start|>assistant\nRayleigh scattering.<|im_end|>\n"
    "<|im_start|>user\nAnd sunsets?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"},
                {"role": "assistant", "content": "Rayleigh scattering."}, {"role": "user", "content": "And sunsets?"}]


def test_messages_reply_is_byte_identical_to_the_conversation_rendered_by_hand(served: Sandbox,
                                                                              tmp_path: Path) -> None:
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps(CONVERSATION))
    by_messages = served.ctl("--json", "complete", "--messages", str(path), "--max-tokens", "24")
    by_hand = served.ctl("--json", "complete", "-", "--max-tokens", "24", input=HAND_RENDERED.encode())
    assert by_messages.rc == by_hand.rc == 0, (by_messages.err, by_hand.err)
    a, b = by_messages.json(), by_hand.json()
    assert a["prompt_key"] == b["prompt_key"]   # the same rendered bytes
    assert a["text"] == b["text"] and a["tokens"] == b["tokens"]
    streamed = served.ctl("complete", "--messages", "-", "--max-tokens", "24", input=path.read_bytes())
    raw = served.ctl("complete", HAND_RENDERED, "--max-tokens", "24")
    assert streamed.out == raw.out and streamed.out.strip()


def test_the_daemon_refuses_mixed_input_and_a_model_without_a_template(served: Sandbox) -> None:
    from barrelctl.errors import ClientError

    user = [Message("user", "Hello?")]
    with served.client() as c:
        with pytest.raises(ClientError) as both:
            c.complete(b"raw", messages=user).result()
        assert (both.value.status, both.value.code) == ("INVALID_ARGUMENT", 2)
        c.load("base", path=str(gemma_path()), n_ctx=1024, timeout=120)
        try:
            with pytest.raises(ClientError) as no_template:
                c.complete(b"", model="base", messages=user, max_tokens=2).result()
            assert no_template.value.status == "FAILED_PRECONDITION"
            assert "model base has no chat template" in str(no_template.value)
            template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
            done = c.complete(b"", model="base", messages=user, chat_template=template, max_tokens=2).result()
            plain = c.complete(b"user: Hello?\nassistant:", model="base", max_tokens=2).result()
            assert done.prompt_key == plain.prompt_key and done.text == plain.text
        finally:
            c.unload("base")
