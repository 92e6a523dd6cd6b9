"""The tensors of a safetensors checkpoint (single file or sharded with an index), read lazily."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory is missing something or holds a tensor of the wrong shape."""


class CheckpointTensors:
    """Name -> tensor over `model.safetensors` or the shards listed in `model.safetensors.index.json`.

    Tensors are read on demand (`get`), so a model loads one tensor at a time.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        index = self.directory / INDEX_FILE
        single = self.directory / SINGLE_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            for name, fname in weight_map.items():
                self._file_of[name] = self.directory / fname
            for f in sorted(set(self._file_of.values())):
                if not f.is_file():
                    raise CheckpointError(f"{index} lists shard {f.name}, which is missing from "
                                          f"{self.directory}; re-download the checkpoint")
        elif single.is_file():
            for name in self._open(single).keys():
                self._file_of[name] = single
        else:
            found = sorted(p.name for p in self.directory.glob("*.safetensors"))
            raise CheckpointError(
                f"no {SINGLE_FILE} or {INDEX_FILE} in {self.directory} (found safetensors files: "
                f"{found or 'none'}); save the model with save_pretrained(..., safe_serialization=True)")

    def _open(self, f: Path):
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
        return self._handles[f]

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def files(self) -> list[Path]:
        return sorted(set(self._file_of.values()))

    def get(self, name: str) -> torch.Tensor:
        """The stored tensor `name` (CPU, stored dtype); CheckpointError naming it when absent."""
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")
        return self._open(self._file_of[name]).get_tensor(name)

    def checksum(self) -> str:
        """blake2b over every safetensors file's bytes, files in name order: the weight identity."""
        h = hashlib.blake2b(digest_size=16)
        for f in self.files():
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
        return h.hexdigest()
