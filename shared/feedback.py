"""Feedback: the tools callers chose for their intents, kept per catalog and tool in Redis, bounded.

A tool's newest PER_TOOL intents are kept (a repeated intent moves to the front instead of taking a second
place), so storage is bounded by the catalog's size whatever the traffic. Learn (compiler_service/learn.py)
turns the intents a tool was chosen for on its own into that tool's examples in a new catalog version: a
request that chose several tools is no example of any one of them (docs/quality.md), so it is kept but not
learned from.
"""
from __future__ import annotations

import json

from shared.store import CatalogStore

PER_TOOL = 100          # newest intents kept per tool (MetaTool's training split: 31 a tool on average)
MAX_TOOLS = 16          # tools one feedback may name
MAX_INTENT_CHARS = 4000  # the decoder's own bound on an intent


class FeedbackStore:
    """Redis lists under the catalog's keys: `<ns>:cat:<name>:feedback:<tool>`, newest first, each entry
    `[intent, number of tools chosen with it]`; the set `<ns>:cat:<name>:feedback` names the tools that have any."""

    def __init__(self, store: CatalogStore):
        self.r, self.ns = store.r, store.ns

    def _tools_key(self, name: str) -> str:
        return f"{self.ns}:cat:{name}:feedback"

    def _key(self, name: str, tool: str) -> str:
        return f"{self._tools_key(name)}:{tool}"

    def record(self, name: str, intent: str, tools: list[str]) -> None:
        """Keep one checked feedback: the intent at the front of each chosen tool's list, trimmed to PER_TOOL."""
        entry = json.dumps([intent, len(tools)], ensure_ascii=False)
        with self.r.pipeline() as p:   # MULTI/EXEC: all of it or none
            for tool in tools:
                key = self._key(name, tool)
                p.lrem(key, 0, entry)
                p.lpush(key, entry)
                p.ltrim(key, 0, PER_TOOL - 1)
                p.sadd(self._tools_key(name), tool)
            p.execute()

    def alone(self, name: str, tools: list[str]) -> dict[str, list[str]]:
        """For each of `tools` with feedback, the intents it was chosen for on its own, oldest first."""
        wanted = set(tools)
        have = [t for t in (m.decode("utf-8") for m in self.r.smembers(self._tools_key(name))) if t in wanted]
        with self.r.pipeline(transaction=False) as p:
            for tool in have:
                p.lrange(self._key(name, tool), 0, -1)
            lists = p.execute()
        out = {}
        for tool, entries in zip(have, lists):
            intents = [intent for intent, n in map(json.loads, reversed(entries)) if n == 1]
            if intents:
                out[tool] = intents
        return out
