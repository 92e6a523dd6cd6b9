"""A malformed checkpoint directory is refused with a CheckpointError naming the file and what is
wrong; each case corrupts a copy of one tiny checkpoint."""
import json
import os
import shutil

import pytest
from transformers import AutoModelForCausalLM

from hybridkv import LLM
from hybridkv.models import CheckpointError, load_model
from hybridkv.models.config_check import check_config
from hybridkv.models.tiny import make_tiny_checkpoint

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=5)


@pytest.fixture(scope="module")
def sharded_dir(llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "ckpt"
    AutoModelForCausalLM.from_pretrained(llama_dir).save_pretrained(path, max_shard_size="40KB")
    assert (path / INDEX).is_file()
    return path


def _write(name, text):
    return lambda d: (d / name).write_text(text)


def _config(**changes):
    def mutate(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
    return mutate


def _truncate(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


# (case, corruption of the single-file checkpoint, what the message says)
SINGLE_FILE_CASES = [
    ("config_not_json", _write("config.json", "{not json"), r"config\.json is not valid JSON .*line 1, column 2"),
    ("config_a_list", _write("config.json", "[1, 2]"), r"config\.json holds a JSON list, not an object"),
    ("generation_config_not_json", _write("generation_config.json", '{"eos_token_id": 2,'),
     r"generation_config\.json is not valid JSON"),
    ("tokenizer_not_json", _write("tokenizer.json", "\x00garbage"), r"tokenizer\.json is not valid JSON"),
    ("tokenizer_config_not_json", _write("tokenizer_config.json", "{"),
     r"tokenizer_config\.json is not valid JSON"),
    ("safetensors_garbage", lambda d: (d / "model.safetensors").write_bytes(b"junk" * 64),
     r"model\.safetensors is not a readable safetensors file"),
    ("safetensors_truncated", _truncate, r"model\.safetensors is not a readable safetensors file"),
    ("zero_kv_heads", _config(num_key_value_heads=0), r"config\.json has num_key_value_heads=0; .*positive"),
    ("zero_heads", _config(num_attention_heads=0), r"config\.json has num_attention_heads=0"),
    ("zero_hidden", _config(hidden_size=0), r"config\.json has hidden_size=0"),
    ("zero_layers", _config(num_hidden_layers=0), r"config\.json has num_hidden_layers=0"),
    ("zero_max_len", _config(max_position_embeddings=0), r"config\.json has max_position_embeddings=0"),
    ("negative_max_len", _config(max_position_embeddings=-8), r"config\.json has max_position_embeddings=-8"),
    ("string_head_dim", _config(head_dim="16"), r"config\.json has head_dim='16'"),
    ("heads_not_divisible", _config(num_key_value_heads=3),
     r"config\.json: num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
]


@pytest.mark.parametrize("case,corrupt,message", SINGLE_FILE_CASES, ids=[c[0] for c in SINGLE_FILE_CASES])
def test_single_file_checkpoint_errors_name_the_file(llama_dir, tmp_path, case, corrupt, message):
    path = tmp_path / "ckpt"
    shutil.copytree(llama_dir, path)
    corrupt(path)
    with pytest.raises(CheckpointError, match=message) as e:
        load_model(path)
    assert str(path) in str(e.value)


def _index(mutate_index):
    def mutate(d):
        index = json.loads((d / INDEX).read_text())
        mutate_index(index, sorted(set(index["weight_map"].values())))
        (d / INDEX).write_text(json.dumps(index))
    return mutate


def _outside(index, shards, target):
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = target


def _swap_first_two(index, shards):
    first = [n for n, f in index["weight_map"].items() if f == shards[0]][0]
    index["weight_map"][first] = shards[1]


SHARDED_CASES = [
    ("index_not_json", _write(INDEX, "weight_map: {}"), rf"{INDEX} is not valid JSON"),
    ("index_without_weight_map", _index(lambda i, s: i.pop("weight_map")), rf"{INDEX} has no 'weight_map'"),
    ("shard_in_parent", _index(lambda i, s: _outside(i, s, "../" + s[0])),
     rf"{INDEX}: weight_map\[.*\] names shard '\.\./model-.*', outside the checkpoint directory"),
    ("shard_absolute", _index(lambda i, s: _outside(i, s, "/etc/hostname")),
     rf"{INDEX}: weight_map\[.*\] names shard '/etc/hostname', outside"),
    ("tensor_in_wrong_shard", _index(_swap_first_two), rf"{INDEX} places 1 tensor\(s\) in .* that it does not hold"),
    ("shard_garbage", lambda d: sorted(d.glob("model-*.safetensors"))[0].write_bytes(b"x" * 9),
     r"model-0+1-of-\d+\.safetensors is not a readable safetensors file"),
]


@pytest.mark.parametrize("case,corrupt,message", SHARDED_CASES, ids=[c[0] for c in SHARDED_CASES])
def test_sharded_checkpoint_errors_name_the_file(sharded_dir, tmp_path, case, corrupt, message):
    path = tmp_path / "ckpt"
    shutil.copytree(sharded_dir, path)
    corrupt(path)
    with pytest.raises(CheckpointError, match=message):
        load_model(path)


def test_symlinked_shards_of_a_hub_cache_snapshot_load(sharded_dir, tmp_path):
    """A Hugging Face cache snapshot holds its shards as symlinks into ../../blobs: still inside."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    shutil.copytree(sharded_dir, blobs)
    snap.mkdir(parents=True)
    for f in blobs.iterdir():
        if f.suffix == ".safetensors":
            os.symlink(os.path.join("..", "..", "blobs", f.name), snap / f.name)
        else:
            shutil.copy(f, snap / f.name)
    assert load_model(snap).fingerprint == load_model(sharded_dir).fingerprint


def test_nested_text_config_is_checked(tmp_path):
    file = tmp_path / "config.json"
    check_config({"hidden_size": 8, "text_config": {"hidden_size": 8, "num_key_value_heads": 2}}, file)
    check_config({"time_step_rank": "auto", "head_dim": None}, file)  # derived / unused: accepted
    with pytest.raises(CheckpointError, match=r"config\.json has text_config\.num_key_value_heads=0"):
        check_config({"text_config": {"num_key_value_heads": 0}}, file)


@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_max_model_len_option_refused_at_load(llama_dir, value):
    with pytest.raises(ValueError, match=rf"max_model_len={value!r}; it must be a positive number"):
        load_model(llama_dir, max_model_len=value)
    with pytest.raises(ValueError, match=rf"max_model_len={value!r}"):
        LLM(str(llama_dir), max_model_len=value)


def test_max_model_len_option_caps_the_checkpoint(llama_dir):
    assert load_model(llama_dir).max_model_len == 512
    assert load_model(llama_dir, max_model_len=100).max_model_len == 100
    assert load_model(llama_dir, max_model_len=4096).max_model_len == 512


def test_llm_surfaces_the_checkpoint_error_unchanged(llama_dir, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(llama_dir, path)
    _config(num_key_value_heads=0)(path)
    with pytest.raises(CheckpointError) as direct:
        load_model(path)
    with pytest.raises(CheckpointError) as through_llm:
        LLM(str(path), memory_budget_bytes=1 << 20)
    assert type(through_llm.value) is CheckpointError and str(through_llm.value) == str(direct.value)
