"""generation_config.json's sampling defaults, read by the loader onto `model.generation_defaults`."""
import json
import shutil

import pytest

from hybridkv.models import CheckpointError, load_model
from hybridkv.models.generation_defaults import GenerationDefaults, read_generation_defaults
from hybridkv.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=6)


def _with_generation_config(src, tmp_path, content):
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    (path / "generation_config.json").write_text(json.dumps(content))
    return path


def test_model_carries_the_checkpoints_sampling_defaults(llama_dir, tmp_path):
    path = _with_generation_config(llama_dir, tmp_path, {
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0,
        "repetition_penalty": 1.05, "max_new_tokens": 64, "max_length": 4096, "eos_token_id": [7, 2],
        "bos_token_id": 1})
    m = load_model(path)
    assert m.generation_defaults == GenerationDefaults(
        temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, repetition_penalty=1.05, max_tokens=64,
        eos_token_ids=(7, 2))
    assert m.generation_defaults.sampling_overrides() == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05,
        "max_tokens": 64}
    assert isinstance(m.generation_defaults.min_p, float)
    assert m.eos_token_ids == [7, 2]  # the file's ids first, config.json's 2 already among them


def test_no_sampling_keys_or_no_file_means_no_overrides(llama_dir, tmp_path):
    m = load_model(llama_dir)  # save_pretrained's file: token ids only
    assert m.generation_defaults.sampling_overrides() == {} and m.generation_defaults.eos_token_ids == (2,)
    path = tmp_path / "bare"
    shutil.copytree(llama_dir, path)
    (path / "generation_config.json").unlink()
    bare = load_model(path)
    assert bare.generation_defaults == GenerationDefaults() and bare.eos_token_ids == [2]
    nulls = _with_generation_config(llama_dir, tmp_path / "nulls", {"temperature": None, "top_k": None})
    assert read_generation_defaults(nulls) == GenerationDefaults()


@pytest.mark.parametrize("key,value,words", [
    ("temperature", -0.5, "a number >= 0"),
    ("temperature", "hot", "a number >= 0"),
    ("temperature", float("nan"), "a number >= 0"),
    ("top_p", 0, r"a number in \(0, 1\]"),
    ("top_p", 1.5, r"a number in \(0, 1\]"),
    ("top_k", 2.5, "an integer >= -1"),
    ("min_p", 2, r"a number in \[0, 1\]"),
    ("repetition_penalty", 0, "a number > 0"),
    ("max_new_tokens", 0, "an integer >= 1"),
    ("max_new_tokens", True, "an integer >= 1"),
    ("eos_token_id", ["x"], "a token id or a list of them"),
])
def test_out_of_range_values_name_the_file_and_key(llama_dir, tmp_path, key, value, words):
    path = _with_generation_config(llama_dir, tmp_path, {key: value})
    with pytest.raises(CheckpointError, match=rf"generation_config\.json has {key}=.*; it must be {words}"):
        load_model(path)
