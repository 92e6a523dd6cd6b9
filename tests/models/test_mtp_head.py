"""The MTP head (models/mtp_head.py) of Qwen3-Next, Qwen3.5 and Qwen3.5-MoE drafting in the engine
(speculative method 'mtp'), against an oracle built from transformers' own modules: the target's
last hidden states from transformers' model, then the published head's arithmetic (pre-fc norms,
fc, one transformers decoder layer of the family as full attention, final norm, the target's
lm_head) over the whole token list. Every proposal the engine's runner makes — after prefill chunks, decodes and
verification runs alike — equals the oracle's greedy token at that position. A family or a
checkpoint without MTP weights is refused by name."""
import copy
import importlib
import random

import pytest
import torch
import torch.nn.functional as F

from engine_fixtures import hf_model, plain_truth, steer_mtp_drafts as steered
from hybridkv import LLM, SamplingParams
from hybridkv.models.tiny import add_tiny_mtp_weights, make_tiny_checkpoint

MTP = {"method": "mtp", "off_when_slower": False}


FAMILIES = {"qwen3_next": "Qwen3Next", "qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}  # transformers' prefixes


@pytest.fixture(scope="module", params=list(FAMILIES))
def mtp_checkpoint(request, tmp_path_factory):
    family = request.param
    return family, add_tiny_mtp_weights(make_tiny_checkpoint(family, tmp_path_factory.mktemp(f"{family}_mtp")))


def _oracle_head(family: str, hf, weights: dict):
    """The published head's pieces from transformers' modules: (decoder layer, norm(part))."""
    m = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    name = FAMILIES[family]
    config = copy.deepcopy(hf.config)
    config.layer_types = ["full_attention"] + list(config.layer_types[1:])
    config._attn_implementation = "eager"
    layer = getattr(m, f"{name}DecoderLayer")(config, 0).eval()
    prefix = "mtp.layers.0."
    state = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix) and ".experts." not in k}
    if getattr(config, "num_experts", 0):  # published per-expert tensors -> transformers' fused ones
        experts = range(config.num_experts)
        w = lambda e, part: weights[f"{prefix}mlp.experts.{e}.{part}.weight"]
        state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w(e, "gate_proj"), w(e, "up_proj")]) for e in experts])
        state["mlp.experts.down_proj"] = torch.stack([w(e, "down_proj") for e in experts])
    layer.load_state_dict(state)

    def norm(part):
        n = getattr(m, f"{name}RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)
        n.weight.data.copy_(weights[f"mtp.{part}.weight"])
        return n

    return layer, norm


def _head_inputs(hf, weights, norm, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    e = hf.model.embed_tokens(next_ids)
    return F.linear(torch.cat([norm("pre_fc_norm_embedding")(e), norm("pre_fc_norm_hidden")(hidden)], dim=-1),
                    weights["mtp.fc.weight"])


def _head_layer(hf, layer, x: torch.Tensor) -> torch.Tensor:
    """The decoder layer over x [t, H] at positions 0..t-1, causal."""
    t = x.shape[0]
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    return layer(x[None], position_embeddings=hf.model.rotary_emb(x[None], pos), attention_mask=mask,
                 position_ids=pos)[0]


def reference_drafts(family: str, hf, weights: dict, tokens: list[int]) -> list[int]:
    """ref[p]: the head's greedy token at position p (proposing index p + 2) over `tokens`."""
    layer, norm = _oracle_head(family, hf, weights)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state[0, :-1]  # after the final norm
        y = _head_layer(hf, layer, _head_inputs(hf, weights, norm, h, ids[0, 1:]))
        return hf.lm_head(norm("norm")(y)).argmax(dim=-1).tolist()


def reference_chain(family: str, hf, weights: dict, context: list[int], steps: int) -> list[int]:
    """The head's chained proposal after `context` (the head at its second-to-last position p, then
    at p + 1, p + 2, ... reading its own last output and proposal): `steps` tokens, the first the
    one proposed for index len(context) + 1."""
    layer, norm = _oracle_head(family, hf, weights)
    ids = torch.tensor([context])
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state[0, :-1]
        x = _head_inputs(hf, weights, norm, h, ids[0, 1:])
        out = []
        for _ in range(steps):
            last = norm("norm")(_head_layer(hf, layer, x)[-1:])
            out.append(int(hf.lm_head(last).argmax(dim=-1)))
            x = torch.cat([x, _head_inputs(hf, weights, norm, last, torch.tensor([out[-1]]))])
        return out


@pytest.mark.parametrize("chunk", [2048, 16], ids=["whole-prompts", "chunked-prefill"])
def test_every_proposal_equals_the_transformers_oracle(mtp_checkpoint, chunk):
    """Most proposals (70%) are replaced by the true token before the drafter gets them, so runs are
    accepted and the head's next positions read accepted draft tokens; the output stays the plain
    engine's."""
    from safetensors.torch import load_file

    family, mtp_checkpoint = mtp_checkpoint
    rng = random.Random(1)
    prompts = [[rng.randrange(4, 128) for _ in range(n)] for n in (5, 23, 40)]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain, truth = plain_truth(mtp_checkpoint, prompts, greedy)
    llm = LLM(str(mtp_checkpoint), memory_budget_bytes=32 << 20, max_num_batched_tokens=chunk,
              speculative_config={**MTP, "num_speculative_tokens": 1})
    seen = steered(llm, truth, 0.7)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    hf, weights = hf_model(mtp_checkpoint), load_file(str(mtp_checkpoint / "model.safetensors"))
    checked = 0
    rids = sorted({rid for rid, _ in seen}, key=lambda rid: rid[-1])  # generate()'s keys, in submission order
    assert len(rids) == len(prompts), rids
    for prompt, out, key in zip(prompts, outs, rids):
        tokens = prompt + list(out.outputs[0].token_ids)
        ref = reference_drafts(family, hf, weights, tokens)
        mine = {i: toks[0] for (rid, i), toks in seen.items() if rid == key}
        assert min(mine) == len(prompt) + 1 and max(mine) == len(tokens), sorted(mine)  # from the prompt's end on
        for i, tok in mine.items():
            assert tok == ref[i - 2], (out.request_id, i, tok, ref[i - 2])
            checked += 1
    assert checked >= 40
    s = llm.stats()
    assert s["spec_verify_runs"] > 0 and s["spec_draft_tokens"] == s["spec_verify_runs"]  # one token a run
    assert s["spec_accepted_tokens"] >= 8, s["spec_accepted_tokens"]


@pytest.mark.parametrize("k", [3])
def test_every_chained_proposal_equals_the_transformers_oracle(mtp_checkpoint, k):
    """num_speculative_tokens k > 1: the head chained on its own output and proposals, each chain
    at most the request's next k (adaptive) and as long as the block of its last computed position
    allows (block size 8 here, so chains are cut often), every token equal to the oracle's chain
    from the same context; the output stays the plain engine's."""
    from safetensors.torch import load_file

    family, mtp_checkpoint = mtp_checkpoint
    rng = random.Random(5)
    prompts = [[rng.randrange(4, 128) for _ in range(n)] for n in (6, 21)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, truth = plain_truth(mtp_checkpoint, prompts, greedy)
    bs = 8
    llm = LLM(str(mtp_checkpoint), memory_budget_bytes=32 << 20, block_size=bs,
              speculative_config={**MTP, "num_speculative_tokens": k})
    seen = steered(llm, truth, 0.85)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    hf, weights = hf_model(mtp_checkpoint), load_file(str(mtp_checkpoint / "model.safetensors"))
    rids = sorted({rid for rid, _ in seen}, key=lambda rid: rid[-1])
    lengths, cut = set(), False
    for prompt, out, key in zip(prompts, outs, rids):
        tokens = prompt + list(out.outputs[0].token_ids)
        for (rid, i), chain in seen.items():
            if rid != key or i > len(tokens):
                continue
            p = i - 2  # the head's last computed position: the chain runs at p, p + 1, ...
            assert len(chain) <= 1 + min(k - 1, bs - 1 - p % bs), (i, chain)  # (adaptive k: shorter too)
            assert chain == reference_chain(family, hf, weights, tokens[:i], len(chain)), (key, i)
            lengths.add(len(chain))
            cut |= len(chain) < k and p % bs + len(chain) == bs  # stopped by its block's end
    assert lengths == {1, 2, 3} and cut, (lengths, cut)
    s = llm.stats()
    assert s["spec_draft_tokens"] > s["spec_verify_runs"] and s["spec_accepted_tokens"] > s["spec_verify_runs"], s


def test_families_and_checkpoints_without_mtp_are_refused_by_name(tmp_path):  # (once, not per family)
    plain = make_tiny_checkpoint("qwen3_next", tmp_path / "plain")
    with pytest.raises(ValueError, match="no MTP weights .*mtp.fc.weight"):
        LLM(str(plain), memory_budget_bytes=16 << 20, speculative_config=MTP)
    bamba = make_tiny_checkpoint("bamba", tmp_path / "bamba")
    with pytest.raises(ValueError, match="BambaForCausalLM has no multi-token-prediction head"):
        LLM(str(bamba), memory_budget_bytes=16 << 20, speculative_config=MTP)
    with pytest.raises(ValueError, match="'mtp' runs without tensor parallelism, CUDA graphs and quantized caches"):
        LLM(str(plain), memory_budget_bytes=16 << 20, speculative_config=MTP, kv_cache_dtype="int8")


def test_the_head_keeps_its_kv_in_the_targets_pools(mtp_checkpoint):
    """One more attention layer in the plan (index num_hidden_layers), none without MTP."""
    _, mtp_checkpoint = mtp_checkpoint
    with_head = LLM(str(mtp_checkpoint), memory_budget_bytes=16 << 20, speculative_config=MTP)
    without = LLM(str(mtp_checkpoint), memory_budget_bytes=16 << 20)
    layers = with_head.model.config.num_hidden_layers
    assert sorted(with_head.manager.kv_caches) == sorted(without.manager.kv_caches) + [layers]
    assert without.model.mtp is None
