"""DecodeGraphs in its dry-run mode (the capture replaced by a direct call of the same forward on
the same persistent buffers, the Triton kernels interpreted, NoHostSync around it) against the
eager forward with the torch kernels, over tiny Llama, Bamba and Qwen3.5 (GDN) models, and the
latent-attention (MLA) families Kimi-Linear (KDA + MLA) and Ling 3 (gated MLA), and GPT-OSS (MoE
with biases, attention sinks), whose decode steps once synced on the host.

Two Harnesses with the same seed hold identical pools (filled with garbage) and block/slot
assignments: one decodes eagerly, the other through the graphs. Steps cover padding to a bucket
(3 requests -> 4), a block-table row gaining a block, a request finishing mid-run (rows shift,
bucket 2), and after the run every KV block and every state slot but the null slot must match:
padding writes nothing a request owns.
"""
import pytest
import torch

from hybridkv.models.loader import load_model
from hybridkv.models.tiny import make_tiny_checkpoint
from hybridkv.scheduler.decode_graphs import DecodeGraphs, DecodeInputs, decode_buckets
from hybridkv.scheduler.host_sync_check import HostSyncError
from model_harness import Harness, assert_close_rel

# the smallest models that still mix each kind of layer (the interpreter is slow)
FAMILIES = {
    "llama": dict(num_hidden_layers=1),
    "bamba": dict(num_hidden_layers=2, attn_layer_indices=[1]),
    "qwen3_5": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
    "kimi_linear": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                        mlp_layer_types=["dense", "sparse"]),
    "bailing_hybrid": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                           mlp_layer_types=["dense", "sparse"]),
    "gpt_oss": dict(num_hidden_layers=1, layer_types=["full_attention"]),  # one attention group
}
PROMPTS = [list(range(5, 21)), [30, 31, 32], [40, 41, 42, 43, 44, 45, 46]]  # 16: next token opens a block


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            path = make_tiny_checkpoint(family, tmp_path_factory.mktemp(family), **FAMILIES[family])
            cache[family] = load_model(path)
        return cache[family]

    return get


def twin_harnesses(model):
    torch.manual_seed(1)
    eager = Harness(model, seed=3)
    torch.manual_seed(1)
    graphed = Harness(model, seed=3)
    return eager, graphed


def decode_inputs(seqs, h: Harness) -> DecodeInputs:
    """The next token of each seq (appended, not yet computed), blocks allocated as the engine would."""
    ids, pos, kv_slots, tables = [], [], [], []
    for s in seqs:
        p = s.num_computed
        while len(s.blocks) * h.bs <= p:
            s.blocks.append(h.free_blocks.pop())
        ids.append(s.tokens[p])
        pos.append(p)
        kv_slots.append(s.blocks[p // h.bs] * h.bs + p % h.bs)
        tables.append(s.blocks)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return DecodeInputs(ids, pos, kv_slots, [s.slot for s in seqs], table)


def graph_step(graphs: DecodeGraphs, h: Harness, seqs) -> torch.Tensor:
    logits = graphs.run(decode_inputs(seqs, h))
    for k, s in enumerate(seqs):
        s.num_computed += 1
        s.last_logits = logits[k]
    return logits


@pytest.mark.slow  # interpreted Triton (the dry run forces the Triton backend)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_graph_decode_matches_eager_and_padding_writes_nothing(models, family):
    model = models(family)
    eager, graphed = twin_harnesses(model)
    a = [eager.add(p) for p in PROMPTS]
    b = [graphed.add(p) for p in PROMPTS]
    eager.prefill(a)
    graphed.prefill(b)
    graphs = DecodeGraphs(model, graphed.caches, max_num_seqs=8, max_model_len=64,
                          block_size=graphed.bs, mode="dry_run")
    graphs.capture()
    assert graphs.buckets == [1, 2, 4, 8]
    for step in range(3):
        if step == 2:  # the middle request finishes: the last one moves up a row, bucket 2
            a, b = [a[0], a[2]], [b[0], b[2]]
        for x, y in zip(a, b):
            tok = int(x.last_logits.argmax())
            assert tok == int(y.last_logits.argmax()), f"step {step}: greedy tokens differ"
            x.tokens.append(tok)
            y.tokens.append(tok)
        ref = eager.step([(s, 1) for s in a])
        got = graph_step(graphs, graphed, b)
        # only changed block-table rows travel: all 3 new, then none, then the row that moved up
        assert graphs.rows_uploaded == [3, 0, 1][step]
        assert got.shape == ref.shape
        assert_close_rel(got, ref, rtol=1e-4)
    assert graphs.replays == 3
    caches_e, caches_g = eager.caches, graphed.caches
    for i in caches_e.kv:  # padding rows wrote no KV
        torch.testing.assert_close(caches_g.kv[i], caches_e.kv[i], rtol=1e-5, atol=1e-5)
    for pools_e, pools_g in ((caches_e.conv, caches_g.conv), (caches_e.state, caches_g.state)):
        for i in pools_e:  # slot 0 is padding's; every other slot must match
            torch.testing.assert_close(pools_g[i][1:], pools_e[i][1:], rtol=1e-4, atol=1e-5)


def test_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        decode_buckets(0)


@pytest.mark.slow  # interpreted Triton
def test_planted_item_in_the_step_is_caught(models, monkeypatch):
    model = models("llama")
    h = Harness(model, seed=3)
    seqs = [h.add([5, 6, 7])]
    h.prefill(seqs)
    graphs = DecodeGraphs(model, h.caches, max_num_seqs=2, max_model_len=64, block_size=h.bs,
                          mode="dry_run")
    graphs.capture()
    norm = model.model.norm
    original = norm.forward
    monkeypatch.setattr(norm, "forward", lambda x: original(x) * (x.abs().max().item() > 0))
    seqs[0].tokens.append(9)
    with pytest.raises(HostSyncError, match=r"item forces a host sync"):
        graphs.run(decode_inputs(seqs, h))


def test_bad_batches_are_refused_and_change_nothing(models):
    model = models("llama")
    h = Harness(model, seed=3)
    seqs = [h.add([5, 6, 7]) for _ in range(3)]
    h.prefill(seqs)
    for s in seqs:
        s.tokens.append(9)
    graphs = DecodeGraphs(model, h.caches, max_num_seqs=2, max_model_len=64, block_size=h.bs,
                          mode="dry_run")
    with pytest.raises(RuntimeError, match="capture"):
        graphs.run(decode_inputs(seqs[:1], h))
    graphs.capture()
    before = [t.clone() for t in h.caches.kv.values()]
    table = graphs.block_table.clone()
    with pytest.raises(ValueError, match="3 requests; decode graphs hold 1..2"):
        graphs.run(decode_inputs(seqs, h))
    wide = decode_inputs(seqs[:1], h)
    wide.block_table = torch.zeros(1, graphs.max_blocks + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table has shape \(1, 5\)"):
        graphs.run(wide)
    assert graphs.replays == 0 and torch.equal(graphs.block_table, table)
    assert all(torch.equal(x, y) for x, y in zip(before, h.caches.kv.values()))
    h.caches.kv[0] = h.caches.kv[0].clone()  # a pool reallocated behind the graphs' back
    with pytest.raises(RuntimeError, match="reallocated"):
        graphs.run(decode_inputs(seqs[:1], h))


def test_modes_refused_where_they_cannot_work(models, monkeypatch):
    model = models("llama")
    h = Harness(model, seed=3)
    with pytest.raises(ValueError, match="CUDA device; it is on cpu"):
        DecodeGraphs(model, h.caches, max_num_seqs=2, max_model_len=64, block_size=16, mode="cuda")
    with pytest.raises(ValueError, match="mode 'eager'"):
        DecodeGraphs(model, h.caches, max_num_seqs=2, max_model_len=64, block_size=16, mode="eager")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        DecodeGraphs(model, h.caches, max_num_seqs=2, max_model_len=64, block_size=16, mode="dry_run")


def test_option_refused_before_loading_where_it_cannot_work(tmp_path):
    from hybridkv import LLM
    from hybridkv.cli import llm_kwargs, parser

    assert llm_kwargs(parser().parse_args(["serve", "--cuda-graphs"]))["cuda_graphs"] is True
    assert llm_kwargs(parser().parse_args(["serve"]))["cuda_graphs"] is False
    missing = str(tmp_path / "no-checkpoint-here")  # refused before anything looks for it
    with pytest.raises(ValueError, match="cuda_graphs=True captures CUDA graphs, but the model runs on cpu"):
        LLM(missing, device="cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match=r"cuda_graphs='yes'; choose one of \(False, True, 'dry_run'\)"):
        LLM(missing, device="cpu", cuda_graphs="yes")
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        LLM(missing, device="cpu", cuda_graphs="dry_run", tensor_parallel_size=2)


def test_which_steps_replay_a_graph(models):
    from types import SimpleNamespace as Chunk

    h = Harness(models("llama"), seed=3)
    graphs = DecodeGraphs(h.model, h.caches, max_num_seqs=4, max_model_len=64, block_size=16,
                          mode="dry_run")
    decode = Chunk(num_tokens=1, start=7)
    assert graphs.takes([decode] * 3, None)
    assert not graphs.takes([decode, Chunk(num_tokens=5, start=0)], None)  # mixed: eager
    assert not graphs.takes([Chunk(num_tokens=1, start=0)], None)  # a one-token prompt: eager
    assert not graphs.takes([decode], torch.tensor([0]))  # prompt logprobs: eager
    assert not graphs.takes([decode] * 5, None)  # wider than the largest bucket: eager
    assert not graphs.takes([], None)


def assert_same_generation(got, want):
    """Greedy tokens equal and each token's logprob within 1e-4, request by request."""
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            (tg, vg), (tw, vw) = next(iter(lg.items())), next(iter(lw.items()))
            assert tg == tw and vg.logprob == pytest.approx(vw.logprob, abs=1e-4)


@pytest.mark.slow  # long
def test_engine_generates_the_eager_tokens_through_graphs(tmp_path):
    """LLM(cuda_graphs="dry_run") against LLM(): greedy tokens equal, logprobs close; requests
    finish after 2, 3 and 4 tokens, so decode batches of 3 (padded to 4), 2 and 1 replay."""
    from hybridkv import LLM, SamplingParams

    path = str(make_tiny_checkpoint("bamba", tmp_path, **FAMILIES["bamba"]))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
              for n in (4, 2, 3)]
    kw = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=64, memory_budget_bytes=8 << 20)
    want = LLM(path, **kw).generate(PROMPTS, params, use_tqdm=False)
    graphed = LLM(path, cuda_graphs="dry_run", **kw)
    got = graphed.generate(PROMPTS, params, use_tqdm=False)
    assert graphed.engine.runner.decode_graphs.replays == 3
    assert_same_generation(got, want)


@pytest.mark.slow  # interpreted Triton
def test_engine_with_two_attention_groups_generates_the_eager_tokens(tmp_path):
    """LFM3 (conv, sliding window 24, full): a table and write slots per group; a 40-token
    prompt decodes past its first block's leaving the window (a -1 entry in the sliding table)."""
    from hybridkv import LLM, SamplingParams

    path = str(make_tiny_checkpoint("lfm3", tmp_path, num_hidden_layers=3,
                                    layer_types=["conv", "sliding_attention", "full_attention"]))
    prompts = [list(range(4, 44)), [50, 51, 52]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0) for n in (3, 2)]
    kw = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=64, memory_budget_bytes=8 << 20)
    want = LLM(path, **kw).generate(prompts, params, use_tqdm=False)
    graphed = LLM(path, cuda_graphs="dry_run", **kw)
    assert sorted(graphed.engine.runner.decode_graphs.windows, key=str) == sorted([None, 24], key=str)
    got = graphed.generate(prompts, params, use_tqdm=False)
    assert graphed.engine.runner.decode_graphs.replays == 2
    assert_same_generation(got, want)
