"""The Template: how one model family turns a conversation into token ids.

Encoding follows the LLaMA-Factory recipe, so its templates and datasets carry over:

    turn 0:  prefix + system(+tools) + user      ->  assistant
    turn t:  user | observation                  ->  assistant | function

Each message is encoded on its own (``slots_to_ids``) so the boundary between prompt and
response is exact and per-turn label masks never straddle a token.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from .formatters import FunctionFormatter, StringFormatter, ToolFormatter
from .slots import EOS, CallerText, Slot, join_text, slots_to_ids, slots_to_text

ROLES = ("user", "assistant", "function", "observation")
PROMPT_ROLES = ("user", "observation")
RESPONSE_ROLES = ("assistant", "function")


@dataclass
class Template:
    name: str
    format_user: StringFormatter
    format_assistant: StringFormatter
    format_system: StringFormatter
    format_function: FunctionFormatter
    format_observation: StringFormatter
    format_tools: ToolFormatter
    format_prefix: tuple[Slot, ...] = ()
    default_system: str = ""
    stop_words: tuple[str, ...] = ()
    # Reasoning families: the pair that wraps a thought, e.g. ("<think>\n", "\n</think>\n\n").
    thought_words: tuple[str, str] | None = None
    enable_thinking: bool = True
    # User and tool (observation) text whose spelling of a special token (``<|im_end|>``) is encoded
    # as plain text, so a caller cannot close its turn and open another. False is LLaMA-Factory's
    # behaviour (the data author is trusted); inference sets it for requests (stages/loading.py).
    escape_special_tokens: bool = False
    efficient_eos: bool = False  # the eos is appended once by the tokenizer step, not per turn
    replace_eos: bool = False  # the first stop word becomes the tokenizer's eos
    system_in_first_user: bool = False  # llama2 / mistral / gemma fold the system into turn 0
    # The vision plugin (registries/multimodal) that expands <image> for this family, as
    # LLaMA-Factory's template carries mm_plugin; None for text-only templates.
    mm_plugin: str | None = None
    # The model's image processor (e.g. Qwen2VLImageProcessor), bound by stages/loading.py for a
    # template with a vision plugin when the model folder has one: what tokenizing image rows needs.
    image_processor: Any = field(default=None, compare=False, repr=False)
    notes: str = field(default="", compare=False)  # documented deviations from the family's own template

    # ---------------------------------------------------------------- encoding
    def encode_oneturn(self, tokenizer, messages, system=None, tools=None) -> tuple[list[int], list[int]]:
        """Everything before the last message is the prompt; the last message is the response."""
        pairs = self.encode_multiturn(tokenizer, messages, system, tools)
        prompt_ids: list[int] = []
        for prompt, response in pairs[:-1]:
            prompt_ids += prompt + response
        return prompt_ids + pairs[-1][0], pairs[-1][1]

    def encode_multiturn(self, tokenizer, messages, system=None, tools=None) -> list[tuple[list[int], list[int]]]:
        """One (prompt_ids, response_ids) pair per user->assistant exchange."""
        validate_messages(messages)
        messages = self._apply_thinking_policy(messages)
        slots = self._add_empty_thoughts(messages, self._message_slots(messages, system, tools))
        encoded = [slots_to_ids(tokenizer, s) for s in slots]
        return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]

    def render(self, tokenizer, messages, system=None, tools=None) -> str:
        """The conversation as text, exactly as encoded (for diffs and debugging)."""
        validate_messages(messages, need_response=False)
        messages = self._apply_thinking_policy(messages)
        slots = self._add_empty_thoughts(messages, self._message_slots(messages, system, tools))
        return "".join(slots_to_text(tokenizer, s) for s in slots)

    def _message_slots(self, messages, system, tools) -> list[list[Slot]]:
        system = system or self.default_system
        tool_text = self.format_tools.apply(tools) if tools else ""
        if not system:
            # Tool blocks written to follow a system prompt open with a blank line; with no system
            # prompt the families' own templates start the block directly (Qwen3, Qwen2.5 w/o default).
            tool_text = tool_text.lstrip("\n")
        out = []
        for i, message in enumerate(messages):
            slots: list[Slot] = []
            role, content = message["role"], message["content"]
            if self.escape_special_tokens and role in PROMPT_ROLES:
                content = CallerText(content)
            if i == 0:
                slots += list(self.format_prefix)
                if system or tool_text:
                    system_slots = self.format_system.apply(system + tool_text)
                    if self.system_in_first_user:
                        content = join_text(slots_to_text(None, system_slots), content)
                    else:
                        slots += system_slots
            if role == "user":
                slots += self.format_user.apply(content, idx=str(i // 2))
            elif role == "assistant":
                slots += self.format_assistant.apply(content)
            elif role == "observation":
                slots += self.format_observation.apply(content)
            else:  # function
                slots += self.format_function.apply(content, thought_words=self.thought_words)
            out.append(slots)
        return out

    # ---------------------------------------------------------------- thinking
    def remove_thought(self, content: str) -> str:
        if self.thought_words is None:
            return content
        start, end = (re.escape(w.strip()) for w in self.thought_words)
        return re.sub(rf"{start}.*?{end}", "", content, flags=re.DOTALL).lstrip("\n")

    def empty_thought(self) -> str:
        return self.thought_words[0] + self.thought_words[1] if self.thought_words else ""

    def _has_thought(self, content: str) -> bool:
        return any(w.strip() in content for w in self.thought_words or ())

    def _apply_thinking_policy(self, messages: list[dict]) -> list[dict]:
        """Drop the thoughts that the family's own template drops.

        Reasoning templates (Qwen3, DeepSeek-R1, gpt-oss) keep no thought in replies that come
        before the last user query: that is history, and at inference the model never sees its
        old reasoning. Replies after it (a tool-calling chain answering that query) keep theirs.
        With thinking off, every thought goes.
        """
        if self.thought_words is None:
            return messages
        last_query = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        messages = copy.deepcopy(messages)
        for i, m in enumerate(messages):
            if m["role"] in RESPONSE_ROLES and (not self.enable_thinking or i < last_query):
                m["content"] = self.remove_thought(m["content"])
        return messages

    def _add_empty_thoughts(self, messages: list[dict], slots: list[list[Slot]]) -> list[list[Slot]]:
        """Mark "no thought" on the final reply with an empty thought block.

        Only the final reply gets one, as in the families' own templates. With thinking on it
        belongs to the response (the model learns to emit it); with thinking off it ends the
        prompt, where the family's no-thinking generation prompt puts it, also when the
        conversation ends on a prompt awaiting generation. The block is its own slot, so it is
        tokenized apart from the reply exactly as at generation time.
        """
        if self.thought_words is None:
            return slots
        slots = [list(s) for s in slots]
        last = messages[-1]
        if last["role"] in RESPONSE_ROLES:
            if not self._has_thought(last["content"]):
                if self.enable_thinking:
                    slots[-1].insert(0, self.empty_thought())
                else:
                    slots[-2].append(self.empty_thought())
        elif not self.enable_thinking:
            slots[-1].append(self.empty_thought())
        return slots

    # ---------------------------------------------------------------- tokenizer
    def fix_tokenizer(self, tokenizer) -> list[str]:
        """Make eos/pad/stop words what this family needs. Returns the tokens it had to add
        (non-empty means the model's embeddings must be resized)."""
        added: list[str] = []
        stop_words = list(self.stop_words)
        if self.replace_eos:
            if not stop_words:
                raise ValueError(f"Template {self.name!r} sets replace_eos but has no stop words.")
            added += _set_eos(tokenizer, stop_words.pop(0))
        if tokenizer.eos_token_id is None:
            added += _set_eos(tokenizer, "<|endoftext|>")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        new_stops = [w for w in stop_words if w not in tokenizer.get_vocab()]
        if stop_words:  # special, so they are never split and generation can stop on them
            tokenizer.add_special_tokens({"additional_special_tokens": stop_words}, replace_extra_special_tokens=False)
        return added + new_stops

    def stop_token_ids(self, tokenizer) -> list[int]:
        ids = {tokenizer.eos_token_id}
        ids.update(tokenizer.convert_tokens_to_ids(w) for w in self.stop_words)
        return sorted(i for i in ids if i is not None)

    def extract_tool_calls(self, reply: str):
        return self.format_tools.extract(reply)


def _set_eos(tokenizer, eos_token: str) -> list[str]:
    if tokenizer.eos_token == eos_token:
        return []
    is_new = eos_token not in tokenizer.get_vocab()
    tokenizer.add_special_tokens({"eos_token": eos_token})
    return [eos_token] if is_new else []


def validate_messages(messages: list[dict], need_response: bool = True) -> None:
    """Prompt roles and response roles must alternate, starting with a prompt."""
    if not messages:
        raise ValueError("A conversation needs at least one message.")
    if need_response and len(messages) % 2:
        raise ValueError(f"A conversation must end with an assistant turn; got {len(messages)} messages.")
    for i, m in enumerate(messages):
        allowed = PROMPT_ROLES if i % 2 == 0 else RESPONSE_ROLES
        if m.get("role") not in allowed:
            raise ValueError(
                f"Message {i} has role {m.get('role')!r}; expected one of {allowed} "
                "(user/observation and assistant/function turns must alternate)."
            )
        if not isinstance(m.get("content"), str):
            raise ValueError(f"Message {i} content must be a string, got {type(m.get('content')).__name__}.")


__all__ = ["Template", "validate_messages", "ROLES", "EOS"]
