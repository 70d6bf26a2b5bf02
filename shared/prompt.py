"""The prompt a request is decoded under: the retrieved shortlist of tools, then the intent.

The prefix (the start of the system turn) is the same for every request on a version, so the decoder
computes its KV once. The rest is the request's own: its shortlisted tools, one `- name: description`
line each (descriptions cut to `description_chars`), then the intent and k, ending with the assistant
header after which the model writes the tool names. Serving and training (`tune`) both build prompts
with `request_ids`, so a tuned model sees exactly the tokens it is served.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

SYSTEM_TEXT = "You route user requests to tools. Candidate tools, one per line as name: description:\n"
USER_TEXT = ("{intent}\n\nReply with exactly {k} tool name(s) from the list, one per line, "
             "most relevant first, and nothing else.")
DESCRIPTION_CHARS = 120  # docs/quality.md: the budget per tool line

# Chat formats by the marker their template contains: (turn start, turn end).
CHAT_FORMATS = {
    "<|im_start|>": ("<|im_start|>{role}\n", "<|im_end|>\n"),                    # ChatML: SmolLM2, Qwen
    "<|start_header_id|>": ("<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>"),  # Llama 3
}


@dataclass(frozen=True)
class PromptTemplate:
    prefix: str      # the start of the system turn, shared by every request on the version
    suffix: str      # holds {tools} (or lists none), then {intent}, and {k}; ends where the first name begins
    separator: str   # written between two tool names
    stop_token: str  # written after the last one
    description_chars: int = DESCRIPTION_CHARS

    def to_json(self) -> str:
        return json.dumps(self.__dict__, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> "PromptTemplate":
        return cls(**json.loads(text))

    def line(self, name: str, description: str) -> str:
        """One tool's line of the shortlist (request_ids joins their tokens)."""
        return tool_line(name, description, self.description_chars)

    def request_ids(self, tokenizer, lines: list[list[int]], intent: str, k: int,
                    intent_ids: list[int] | None = None) -> list[int]:
        """The request's own tokens after the prefix: the suffix with {k} filled, the shortlist's lines (`line`,
        tokenized) joined by newlines at {tools}, and the intent at {intent}, tokenized as user text (`encode_plain`: a
        "<|im_end|>" typed by a user cannot end the turn). Each part is tokenized alone, so a description cannot
        reach the template's placeholders and a version tokenizes each tool's line once; a byte-level BPE
        splits the whole text at those seams anyway (tests/test_prompt.py: the same tokens). intent_ids: the
        intent's `encode_plain` tokens where the caller took them already (while the device retrieved: P120)."""
        head, middle, tail, newline, listed = template_ids(self, tokenizer, k)
        ids = list(head)
        for i, line in enumerate(lines if listed else []):
            if i:
                ids += newline
            ids += line
        ids += middle
        ids += tokenizer.encode_plain(intent) if intent_ids is None else intent_ids
        ids += tail
        return ids


@functools.lru_cache(maxsize=256)
def template_ids(template: PromptTemplate, tokenizer, k: int) -> tuple:
    """The tokens of a template's fixed pieces for k, as tuples: (before {tools}, between {tools} and {intent},
    after {intent}, a newline, whether it lists tools); taken once, not on every request."""
    head, tools, rest = template.suffix.replace("{k}", str(k)).rpartition("{tools}")   # ("", "", all) without
    middle, tail = rest.split("{intent}", 1)
    return (*(tuple(tokenizer.encode(text)) for text in (head, middle, tail, "\n")), bool(tools))


def line_units(template: PromptTemplate, tokenizer, lines: list[list[int]],
               k: int) -> tuple[list[list[int]], int] | None:
    """A shortlist's lines as tool-line KV computes them (decoder_service/engine/lines.py, tune/lines.py): each line
    with the newline after it, and the prompt rows they fill (the last newline is not the prompt's); None where the
    template does not list the tools right after its prefix."""
    head, _, _, newline, listed = template_ids(template, tokenizer, k)
    if head or not listed or not lines:
        return None
    units = [list(line) + list(newline) for line in lines]
    return units, sum(map(len, units)) - len(newline)


def chat_format(model_dir: Path) -> tuple[str, str, str]:
    """(turn start, turn end, stop token) of the model's chat template from tokenizer_config.json."""
    config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    template = config.get("chat_template") or ""
    for marker, (start, end) in CHAT_FORMATS.items():
        if marker in template:
            stop = end.strip()
            return start, end, stop
    raise ValueError(f"{model_dir}: unsupported chat template (known markers: {', '.join(CHAT_FORMATS)})")


def tool_line(name: str, description: str, chars: int = DESCRIPTION_CHARS) -> str:
    """One line per tool; a description's whitespace is folded (one tool a line) and cut at a word
    boundary within `chars`."""
    description = " ".join(description.split())
    if len(description) > chars:
        cut = description[:chars].rsplit(" ", 1)[0] if " " in description[:chars] else description[:chars]
        description = cut.rstrip(" ,;:.") + "..."
    return f"- {name}: {description}" if description else f"- {name}"


def default_template(turn_start: str, turn_end: str, stop_token: str, separator: str = "\n",
                     description_chars: int = DESCRIPTION_CHARS) -> PromptTemplate:
    """The shortlist prompt in the model's chat format."""
    prefix = turn_start.format(role="system") + SYSTEM_TEXT
    suffix = ("{tools}" + turn_end + turn_start.format(role="user") + USER_TEXT + turn_end
              + turn_start.format(role="assistant"))
    return PromptTemplate(prefix=prefix, suffix=suffix, separator=separator, stop_token=stop_token,
                          description_chars=description_chars)
