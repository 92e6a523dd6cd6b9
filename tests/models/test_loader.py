"""Checkpoint loading: formats, dtype, fingerprint, tokenizer, and the errors a user sees."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config

from hybridkv import LLM, SamplingParams
from hybridkv.models import (CheckpointError, UnsupportedArchitectureError, load_model,
                             supported_architectures)
from hybridkv.models.tiny import make_tiny_checkpoint
from model_harness import Harness, assert_close_rel, hf_logits

PROMPT = [5, 9, 33, 4, 17, 88, 21]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=3)


def _copy(src, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _logits(model, prompt=PROMPT):
    h = Harness(model, block_size=4)
    return h.step([(h.add(prompt), len(prompt))], return_all_logits=True)


def test_registry_lists_the_four_families():
    assert set(supported_architectures()) >= {"LlamaForCausalLM", "BambaForCausalLM",
                                              "JambaForCausalLM", "Qwen3NextForCausalLM"}


def test_attributes_tokenizer_and_eos(llama_dir):
    m = load_model(llama_dir)
    assert m.architecture == "LlamaForCausalLM" and m.vocab_size == 128
    assert m.max_model_len == 512 and m.eos_token_ids == [2]
    ids = m.tokenizer("Hi there!\n").input_ids
    assert m.tokenizer.decode(ids) == "Hi there!\n" and max(ids) < m.vocab_size
    assert len(m.fingerprint) == 64 and not m.training


def test_sharded_checkpoint_loads_the_same_weights(llama_dir, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(llama_dir)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, b = load_model(llama_dir), load_model(tmp_path / "sharded")
    torch.testing.assert_close(_logits(a), _logits(b), rtol=0, atol=0)


def test_tied_embeddings(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "tied", seed=4, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    assert_close_rel(_logits(load_model(path)), hf_logits(hf, PROMPT))


def test_dtype_and_fingerprint(llama_dir, tmp_path):
    a, b = load_model(llama_dir), load_model(llama_dir)
    assert a.fingerprint == b.fingerprint
    half = load_model(llama_dir, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.fingerprint != a.fingerprint
    assert all(s.dtype == torch.bfloat16 for s in half.cache_specs().values())
    # same config, one weight changed: a different model, a different fingerprint
    other = _copy(llama_dir, tmp_path)
    w = load_file(other / "model.safetensors")
    w["model.norm.weight"] = w["model.norm.weight"] + 1e-3
    save_file(w, other / "model.safetensors", metadata={"format": "pt"})
    assert load_model(other).fingerprint != a.fingerprint


def test_no_tokenizer_gives_none(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (path / f).unlink()
    assert load_model(path).tokenizer is None


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "empty")


def test_unsupported_architecture_lists_supported(tmp_path):
    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(tmp_path)
    assert "GPT2LMHeadModel" in str(e.value) and "BambaForCausalLM" in str(e.value)


def test_missing_weights_file(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(path)


def test_missing_shard(llama_dir, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(llama_dir)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "sharded" / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        load_model(tmp_path / "sharded")


def test_missing_tensor_is_named(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    w = load_file(path / "model.safetensors")
    del w["model.layers.1.self_attn.k_proj.weight"]
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path)


def test_wrong_shape_is_named(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    w = load_file(path / "model.safetensors")
    w["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(100, 64\)"):
        load_model(path)


@pytest.fixture(scope="module")
def bf16_dir(llama_dir, tmp_path_factory):
    """The tiny Llama saved in bfloat16: config.json says dtype "bfloat16"."""
    path = tmp_path_factory.mktemp("bf16") / "ckpt"
    AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16).save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    return path


def _set_config_dtype(path, **keys):
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps({**cfg, **keys}))


def test_dtype_auto_takes_the_checkpoint_dtype(bf16_dir, llama_dir, tmp_path):
    m = load_model(bf16_dir, dtype="auto")
    assert m.dtype == torch.bfloat16 and all(s.dtype == torch.bfloat16 for s in m.cache_specs().values())
    assert m.fingerprint == load_model(bf16_dir, dtype=torch.bfloat16).fingerprint
    assert load_model(bf16_dir, dtype="float32").dtype == torch.float32  # an explicit dtype wins
    assert load_model(llama_dir, dtype="auto").dtype == torch.float32  # saved in float32
    legacy = _copy(bf16_dir, tmp_path, "legacy")  # transformers 4 writes torch_dtype
    _set_config_dtype(legacy, torch_dtype="bfloat16")
    assert load_model(legacy, dtype="auto").dtype == torch.bfloat16
    unnamed = _copy(bf16_dir, tmp_path, "unnamed")  # no dtype in config.json: float32
    _set_config_dtype(unnamed)
    assert load_model(unnamed, dtype="auto").dtype == torch.float32


def test_dtype_auto_refuses_a_dtype_it_cannot_compute_in(bf16_dir, tmp_path):
    path = _copy(bf16_dir, tmp_path)
    _set_config_dtype(path, dtype="float8_e4m3fn")
    with pytest.raises(CheckpointError, match=r"config\.json names dtype 'float8_e4m3fn'.*pass dtype="):
        load_model(path, dtype="auto")
    assert load_model(path, dtype="bfloat16").dtype == torch.bfloat16


def test_llm_dtype_auto_and_unknown_names(bf16_dir):
    llm = LLM(str(bf16_dir), dtype="auto", memory_budget_bytes=4 << 20, max_num_seqs=2)
    assert llm.model.dtype == torch.bfloat16
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match=r"dtype='fp8'; choose 'auto' .* or one of \['bfloat16'"):
        LLM(str(bf16_dir), dtype="fp8")


def test_fingerprint_reads_headers_and_samples_not_paths_or_times(llama_dir, tmp_path):
    """Two copies of the same files match (migration between them works); a fine-tune of the same
    shapes (every weight moved a little) and a changed tensor layout do not."""
    import os

    from hybridkv.models.checkpoint import SAMPLE_BYTES, SAMPLES_PER_FILE

    a = load_model(llama_dir)
    copy = _copy(llama_dir, tmp_path, "copy")
    os.utime(copy / "model.safetensors", (1, 1))  # another mtime: still the same checkpoint
    assert load_model(copy).fingerprint == a.fingerprint
    w = load_file(llama_dir / "model.safetensors")
    # big enough that identity() samples instead of hashing every byte
    w["model.pad.weight"] = torch.randn(SAMPLES_PER_FILE * SAMPLE_BYTES // 4 + 1000)
    big = _copy(llama_dir, tmp_path, "big")
    save_file(w, big / "model.safetensors", metadata={"format": "pt"})
    g = torch.Generator().manual_seed(0)
    tuned = _copy(llama_dir, tmp_path, "tuned")
    save_file({k: v + 1e-4 * torch.randn(v.shape, generator=g) for k, v in w.items()},
              tuned / "model.safetensors", metadata={"format": "pt"})
    relaid = _copy(llama_dir, tmp_path, "relaid")
    save_file({**w, "model.pad.weight": w["model.pad.weight"][:-1]}, relaid / "model.safetensors",
              metadata={"format": "pt"})
    fps = {load_model(p).fingerprint for p in (big, tuned, relaid)}
    assert len(fps) == 3 and a.fingerprint not in fps


def _hub_layout(src, hub, repo_id, rev="0123456789abcdef0123456789abcdef01234567"):
    """`src` as huggingface_hub caches a download: models--org--name/{blobs,snapshots/<rev>,refs/main}."""
    root = hub / ("models--" + repo_id.replace("/", "--"))
    snap = root / "snapshots" / rev
    (root / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, root / "blobs" / f.name)
        (snap / f.name).symlink_to(f"../../blobs/{f.name}")
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(rev)
    return snap


def test_model_id_from_the_local_hub_cache_offline(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    import socket

    def no_network(*a, **k):
        raise AssertionError("a connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    _hub_layout(llama_dir, tmp_path / "hf" / "hub", "tiny-org/tiny-llama")
    m = load_model("tiny-org/tiny-llama")
    assert m.fingerprint == load_model(llama_dir).fingerprint
    llm = LLM("tiny-org/tiny-llama", memory_budget_bytes=4 << 20, max_num_seqs=2)
    ref = LLM(str(llama_dir), memory_budget_bytes=4 << 20, max_num_seqs=2)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    assert (llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
            == ref.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids)
    where = str(tmp_path / "hf" / "hub" / "models--tiny-org--absent")
    with pytest.raises(FileNotFoundError, match=rf"'tiny-org/absent' is neither .*looked in {where}.*never downloads"):
        load_model("tiny-org/absent")
    assert not (tmp_path / "hf" / "hub" / "models--tiny-org--absent").exists()


def test_device_auto(llama_dir):
    from hybridkv.models.loader import resolve_device

    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want
    assert load_model(llama_dir, device="auto").device.type == want
    with pytest.raises(ValueError, match=r"device='gpu0'; choose 'auto'"):
        resolve_device("gpu0")
