"""The run's card: what was trained on (digests), how (seed, hyperparameters), and how well (selection, validation)."""
from __future__ import annotations

import json
import platform
from pathlib import Path

from tune.merge import file_sha256


def write_card(out: Path, *, sources, base: dict, args: dict, counts: dict, losses: list[float],
               seconds: float, selection: dict, validation: dict, extra: dict | None = None) -> dict:
    """Write `out` (JSON) and return it: data digests, base model, arguments, example counts, the loss at the
    start and end, training time, the selection and validation splits' metrics."""
    import torch
    import transformers
    head = losses[: max(1, len(losses) // 20)]
    tail = losses[-max(1, len(losses) // 20):]
    card = {
        "data": {s.name: {"registry": str(s.registry), "registry_sha256": file_sha256(s.registry),
                          "queries": str(s.queries), "queries_sha256": file_sha256(s.queries)} for s in sources},
        "base": base,
        "hyperparameters": args,
        "examples": counts,
        "steps": len(losses),
        "loss_first_5pct": round(sum(head) / len(head), 4) if losses else None,
        "loss_last_5pct": round(sum(tail) / len(tail), 4) if losses else None,
        "train_seconds": round(seconds, 1),
        "selection": selection,
        "validation": validation,
        "software": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        **(extra or {}),
    }
    Path(out).write_text(json.dumps(card, indent=1, default=str) + "\n")
    return card
