"""The prompt a catalog version is decoded under: a shared catalog prefix and a per-request suffix.

The prefix (system turn listing every tool, then the start of the user turn) is the same for every
request on a version, so the decoder computes its KV cache once. The suffix carries the intent and k
and ends with the assistant header, after which the model writes the tool names.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.catalog import Catalog

SYSTEM_TEXT = ("You route user requests to tools. Available tools, one per line as name: description:\n"
               "{tools}")
USER_TEXT = ("{intent}\n\nReply with exactly {k} tool name(s) from the list, one per line, "
             "most relevant first, and nothing else.")

# Chat formats by the marker their template contains: (turn start, turn end).
CHAT_FORMATS = {
    "<|im_start|>": ("<|im_start|>{role}\n", "<|im_end|>\n"),                    # ChatML: SmolLM2, Qwen
    "<|start_header_id|>": ("<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>"),  # Llama 3
}


@dataclass(frozen=True)
class PromptTemplate:
    prefix: str      # rendered catalog text, shared by every request on the version
    suffix: str      # holds {intent} and {k}; ends where the first tool name begins
    separator: str   # written between two tool names
    stop_token: str  # written after the last one

    def render_suffix(self, intent: str, k: int) -> str:
        """The request's own text; {k} first, so an intent that contains "{k}" stays as written."""
        return self.suffix.replace("{k}", str(k)).replace("{intent}", intent)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> "PromptTemplate":
        return cls(**json.loads(text))


def chat_format(model_dir: Path) -> tuple[str, str, str]:
    """(turn start, turn end, stop token) of the model's chat template from tokenizer_config.json."""
    config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    template = config.get("chat_template") or ""
    for marker, (start, end) in CHAT_FORMATS.items():
        if marker in template:
            stop = end.strip()
            return start, end, stop
    raise ValueError(f"{model_dir}: unsupported chat template (known markers: {', '.join(CHAT_FORMATS)})")


def tool_line(name: str, description: str) -> str:
    """One line per tool; newlines inside a description are folded so the list stays one tool a line."""
    description = " ".join(description.split())
    return f"- {name}: {description}" if description else f"- {name}"


def default_template(catalog: Catalog, turn_start: str, turn_end: str, stop_token: str,
                     separator: str = "\n") -> PromptTemplate:
    lines = []
    for t in catalog.tools:
        line = tool_line(t.name, t.description)
        if t.examples:
            line += " (e.g. " + "; ".join(" ".join(x.split()) for x in t.examples) + ")"
        lines.append(line)
    system = SYSTEM_TEXT.replace("{tools}", "\n".join(lines))
    prefix = turn_start.format(role="system") + system + turn_end + turn_start.format(role="user")
    suffix = USER_TEXT + turn_end + turn_start.format(role="assistant")
    return PromptTemplate(prefix=prefix, suffix=suffix, separator=separator, stop_token=stop_token)
