"""What the engines say of a model (their ``GET /v1/models`` entries), merged across replicas and passed to peers.

A replica's entry for a model ("card") is a JSON object: OpenAI's ``id``, ``object``, ``created`` (unix s),
``owned_by``, and each engine's own fields (vLLM's and SGLang's ``max_model_len``, ``root``, ``parent``,
``permission``; llama-server's ``meta``). A balancer answers ``GET /v1/models`` with one merged entry per model, and
tells its peers a compact form of the same (``PeerStatus.model_cards``), so a model served only in another region is
listed with its engines' fields too. Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

__all__ = ["OPENAI_MODEL_FIELDS", "MAX_PEER_CARD_CHARS", "model_entry", "peer_card"]

#: The fields of OpenAI's model object, which every entry of ``GET /v1/models`` has.
OPENAI_MODEL_FIELDS = ("id", "object", "created", "owned_by")
#: The most characters (as JSON) of one model's card in a peer status: it travels with every status probe (every
#: 100 ms by default), so only its scalar fields go, and a larger card goes as nothing.
MAX_PEER_CARD_CHARS = 1024


def model_entry(model: str, cards: Iterable[dict]) -> dict:
    """One entry of ``GET /v1/models`` for ``model`` from the cards its replicas (then its peers) give, in order:
    OpenAI's fields (``created``: the earliest a card says, unix s, 0 when none does; ``owned_by``: the first
    card's, "skylb" when none says: a model only older peers serve, whose status carries no card), then the engines'
    own fields (``max_model_len``, ``root``, ``parent``, ...) as the first card having each says, except
    ``max_model_len``: the smallest, since a request must fit whichever replica serves it."""
    cards = list(cards)
    merged: dict = {}
    for card in reversed(cards):
        merged.update(card)
    created = [c["created"] for c in cards if type(c.get("created")) is int]
    lengths = [c["max_model_len"] for c in cards if type(c.get("max_model_len")) is int]
    if lengths:
        merged["max_model_len"] = min(lengths)
    owned_by = merged.get("owned_by")
    return {"id": model, "object": "model", "created": min(created, default=0),
            "owned_by": owned_by if isinstance(owned_by, str) else "skylb",
            **{k: v for k, v in merged.items() if k not in OPENAI_MODEL_FIELDS}}


def peer_card(model: str, cards: Iterable[dict]) -> dict | None:
    """The card a balancer sends its peers for ``model``: ``model_entry`` of its replicas' cards without ``id`` and
    ``object`` (the key and a constant), only the fields whose value is a string, number, bool or null (lists and
    objects, such as vLLM's ``permission``, stay home); ``created`` 0 and ``owned_by`` "skylb" only when a replica
    said so. None when no replica gave a card, or when the result is over MAX_PEER_CARD_CHARS as JSON."""
    cards = [c for c in cards if c]
    if not cards:
        return None
    entry = model_entry(model, cards)
    if not any(type(c.get("created")) is int for c in cards):
        del entry["created"]
    if not any(isinstance(c.get("owned_by"), str) for c in cards):
        del entry["owned_by"]
    card = {k: v for k, v in entry.items()
            if k not in ("id", "object") and (v is None or isinstance(v, (str, int, float, bool)))}
    if not card or len(json.dumps(card)) > MAX_PEER_CARD_CHARS:
        return None
    return card
