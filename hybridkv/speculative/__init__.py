"""Speculative decoding: drafters propose tokens, one target forward verifies them (docs/design.md,
"Speculative decoding"). The scheduler's side is scheduler/speculation.py; the rollback of recurrent
state is a slot move (models/slot_split.py, hybridkv/memory/recurrent.py)."""
from .config import SpeculativeConfig
from .ngram import NgramDrafter

__all__ = ["SpeculativeConfig", "NgramDrafter"]
