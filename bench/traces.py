"""Workloads built from the model's chat template: an OpenAI-style chat and an agent that edits its history.

Both render ChatML, the bundled model's template, as a client would:
`<|im_start|>role\\ncontent<|im_end|>\\n` per message, then `<|im_start|>assistant\\n` to ask for a reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.harness import Tokenizer

Message = tuple[str, str]


def chatml(messages: list[Message]) -> str:
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages) + (
        "<|im_start|>assistant\n"
    )


def reply_text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


# ---- chat -----------------------------------------------------------------------------------------

CHAT_SYSTEM_TOKENS = 700  # a long system prompt: the first turn is over min_tokens, so it gets a checkpoint


def chat_system(tok: Tokenizer) -> str:
    return tok.text(CHAT_SYSTEM_TOKENS, "chat-system", head="You are the support assistant of a cooperative. "
                    "Answer briefly. Here is the handbook: ")


def chat_user(tok: Tokenizer, turn: int) -> str:
    n = 50 + (turn * 37) % 70  # 50..119 tokens
    return tok.text(n, f"chat-user-{turn}", head=f"Question {turn + 1}. ") + " What should I do?"


# ---- agent ----------------------------------------------------------------------------------------

AGENT_SYSTEM_TOKENS = 900  # the tool descriptions every agent shares
FULL_STEPS = ("start", "append", "append", "insert", "append", "drop", "append")
QUICK_STEPS = ("start", "append", "insert", "drop")


@dataclass
class Agent:
    """One agent session. `history` is what it sends; `step` changes it the way agent frameworks do:
    - append: the tool result of its last call goes at the end (the prompt extends the previous one);
    - insert: a retrieved note is inserted right after the task, in the middle of the history (the prompt
      shares only the head up to the task with the previous one);
    - drop: the oldest exchanges are dropped to stay within budget (the prompt shares system + task).
    """

    name: str
    tok: Tokenizer
    system: str
    history: list[Message] = field(default_factory=list)
    n: int = 0

    def tool_result(self, what: str, tokens: int) -> Message:
        self.n += 1
        body = self.tok.text(tokens, f"{self.name}-{what}-{self.n}", head=f'{{"tool": "{what}", "output": "')
        return ("tool", body + '"}')

    def step(self, op: str) -> str:
        if op == "start":
            task = self.tok.text(150, f"{self.name}-task", head=f"Task for agent {self.name}: ")
            self.history = [("system", self.system), ("user", task)]
        elif op == "append":
            self.history.append(self.tool_result("run_tests", 300))
        elif op == "insert":
            self.history.insert(2, self.tool_result("recall_notes", 250))
        elif op == "drop":
            head, rest = self.history[:2], self.history[2:]
            if rest and rest[0][1].startswith('{"tool": "recall_notes"'):
                head, rest = head + rest[:1], rest[1:]
            self.history = head + rest[-2:] + [self.tool_result("read_file", 300)]
        else:
            raise ValueError(op)
        return chatml(self.history)

    def answered(self, text: str) -> None:
        self.history.append(("assistant", text))


def agent_system(tok: Tokenizer) -> str:
    return tok.text(AGENT_SYSTEM_TOKENS, "agent-system", head="You are a coding agent. You may call these tools: ")
