"""The tokenizer by model or encoding name (quicktok, offline): the workload's token counts and
the server's encoding use the same one."""

from __future__ import annotations

from typing import Any


def load_tokenizer(name: str) -> Any:
    """A quicktok encoding from a model name ("meta-llama/Meta-Llama-3-8B") or encoding name."""
    import quicktok

    try:
        return quicktok.encoding_for_model(name)
    except KeyError:
        try:
            return quicktok.get_encoding(name)
        except (RuntimeError, KeyError, ValueError):
            raise ValueError(f"workload.tokenizer: quicktok knows no model or encoding {name!r}"
                             ) from None
