"""The tensors of a safetensors checkpoint (single file or sharded with an index), read lazily."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class PartsView:
    """A checkpoint seen under other names: `_parts(name)` lists the stored tensors that make up the
    tensor `name` (one read as it is, several stacked along dim 0); `ckpt`: anything with
    `__contains__` and `get(name)`."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def _parts(self, name: str) -> list[str]:
        return [name]

    def __contains__(self, name: str) -> bool:
        return all(p in self.ckpt for p in self._parts(name))

    def get(self, name: str) -> torch.Tensor:
        parts = self._parts(name)
        return self.ckpt.get(parts[0]) if len(parts) == 1 else torch.cat([self.ckpt.get(p) for p in parts])


class CheckpointError(ValueError):
    """A checkpoint directory is missing something or holds a malformed file, a tensor of the wrong
    shape or a config value no model can have; the message names the file and what is wrong."""


def renamed(name: str, renames: dict[str, str]) -> str:
    """`name` with the first of `renames`' keys found in it replaced by its value (our module
    name -> the checkpoint's); unchanged when none occurs."""
    for ours, theirs in renames.items():
        if ours in name:
            return name.replace(ours, theirs)
    return name


def read_json(file: Path) -> dict:
    """The JSON object in `file`; CheckpointError naming the file, the line and column when it is
    not valid JSON or not an object (a dict)."""
    try:
        value = json.loads(Path(file).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e.msg} at line {e.lineno}, column "
                              f"{e.colno}); restore or re-download this file") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file} is not UTF-8 text ({e.reason} at byte {e.start}); restore "
                              f"or re-download this file") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file} holds a JSON {type(value).__name__}, not an object; restore "
                              f"or re-download this file")
    return value


def _shard_path(directory: Path, index: Path, name: str, fname) -> Path:
    """The shard file `fname` for tensor `name`, refused unless it is a file name inside `directory`."""
    if not isinstance(fname, str) or not fname:
        raise CheckpointError(f"{index}: weight_map[{name!r}] is {fname!r}; it must be a shard file name")
    # lexical, not resolve(): a Hugging Face cache snapshot's shards are symlinks into ../../blobs
    if Path(fname).is_absolute() or ".." in Path(fname).parts:
        raise CheckpointError(f"{index}: weight_map[{name!r}] names shard {fname!r}, outside the "
                              f"checkpoint directory {directory}; shards must lie inside it")
    return directory / fname


class CheckpointTensors:
    """Name -> tensor over `model.safetensors` or the shards listed in `model.safetensors.index.json`.

    Every file's header is read at construction (a corrupt file is refused before any weight is
    loaded); tensors are read on demand (`get`), so a model loads one tensor at a time.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        index = self.directory / INDEX_FILE
        single = self.directory / SINGLE_FILE
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index} has no 'weight_map' (tensor name -> shard file) or "
                                      f"it is empty (got {weight_map!r:.80}); re-download the checkpoint")
            for name, fname in weight_map.items():
                self._file_of[name] = _shard_path(self.directory, index, name, fname)
            for f in self.files():
                if not f.is_file():
                    raise CheckpointError(f"{index} lists shard {f.name}, which is missing from "
                                          f"{self.directory}; re-download the checkpoint")
            for f in self.files():
                self._check_listed(f, index)
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
            try:
                self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{f} is not a readable safetensors file ({e}); it is corrupt "
                                      f"or truncated: re-download it") from None
        return self._handles[f]

    def _check_listed(self, f: Path, index: Path) -> None:
        """Each tensor the index puts in shard `f` must be in its header."""
        stored = set(self._open(f).keys())
        absent = sorted(n for n, g in self._file_of.items() if g == f and n not in stored)
        if absent:
            raise CheckpointError(f"{index} places {len(absent)} tensor(s) in {f.name} that it does "
                                  f"not hold (first: {absent[0]!r}); re-download the checkpoint")

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def files(self) -> list[Path]:
        return sorted(set(self._file_of.values()))

    def get(self, name: str) -> torch.Tensor:
        """The stored tensor `name` (CPU, stored dtype); CheckpointError naming it when absent or
        naming its file when the bytes cannot be read."""
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")
        f = self._file_of[name]
        try:
            return self._open(f).get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {f} ({e}); the file is corrupt "
                                  f"or truncated: re-download it") from None

    def identity(self) -> str:
        """blake2b over what tells two checkpoints apart without reading every weight byte: for each
        safetensors file (name order) its name, size and header (tensor names, dtypes, shapes, data
        offsets, metadata) and SAMPLES_PER_FILE chunks of SAMPLE_BYTES spread evenly over its data
        (all of it when the data is smaller), plus the index file's bytes. No path and no mtime,
        so two copies of the same files match (migration between them works). A fine-tune of the
        same shapes changes the sampled bytes; one value edited in place between samples of a file
        over SAMPLES_PER_FILE * SAMPLE_BYTES is NOT detected."""
        h = hashlib.blake2b(digest_size=16)
        index = self.directory / INDEX_FILE
        if index.is_file():
            h.update(index.read_bytes())
        for f in self.files():
            size = f.stat().st_size
            h.update(f"{f.name}\0{size}\0".encode())
            with open(f, "rb") as fh:
                header_len = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(header_len))
                for offset, n in sample_spans(8 + header_len, size):
                    fh.seek(offset)
                    h.update(fh.read(n))
        return h.hexdigest()


SAMPLES_PER_FILE = 128
SAMPLE_BYTES = 4096


def sample_spans(start: int, end: int) -> list[tuple[int, int]]:
    """(offset, length) chunks of [start, end) that `identity` hashes: all of it when it is at most
    SAMPLES_PER_FILE * SAMPLE_BYTES long, else that many chunks, the first at `start`, the last
    ending at `end`, evenly spaced between."""
    length = end - start
    if length <= SAMPLES_PER_FILE * SAMPLE_BYTES:
        return [(start, length)]
    step = (length - SAMPLE_BYTES) / (SAMPLES_PER_FILE - 1)
    return [(start + int(i * step), SAMPLE_BYTES) for i in range(SAMPLES_PER_FILE)]
