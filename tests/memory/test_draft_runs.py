"""The manager's draft verbs (hybridkv/draft_runs.py, speculative decoding): `drafts.allocate` hands
out KV slots for the k + 1 positions and a state slot chain, refusing (nothing changed) when a pool
cannot give them without evicting; `drafts.commit` keeps the accepted positions — the state after the last one
becomes the live state by a slot move, a checkpoint due inside the run comes from its position's
draft slot, the KV blocks and slots of rejected positions go back — and `finish` / `preempt`
free a chain that was never committed."""
import pytest
import torch

from hybridkv.cache_manager import HybridCacheManager
from hybridkv.errors import RequestStateError
from hybridkv.request import Request
from hybridkv.specs import AttentionSpec, RecurrentSpec
from hybridkv.state_pool import DRAFT, FREE, LIVE

BS = 4
HYBRID = {0: RecurrentSpec((3, 2), (2, 4), torch.float32), 1: AttentionSpec(2, 4, torch.float32)}


def decoding(prompt_len=6, slots=8, blocks=16, max_tokens=20, **kw):
    """A manager with request "a" past its prompt (one sampled token left to compute)."""
    m = HybridCacheManager(HYBRID, BS, blocks, slots, fingerprint="m", **kw)
    r = Request("a", list(range(10, 10 + prompt_len)), max_tokens=max_tokens)
    m.admit(r)
    m.allocate("a", prompt_len)
    m.commit("a", prompt_len)
    r.token_ids.append(99)
    return m, r


def fill(m, slot, value):
    for t in list(m.conv_states.values()) + list(m.ssm_states.values()):
        t[slot] = value


def slot_value(m, slot):
    return m.ssm_states[0][slot].flatten()[0].item()


def test_a_run_gives_kv_slots_and_a_chain_of_free_state_slots():
    m, r = decoding()
    live = m.live_slot("a")
    kv, chain = m.drafts.allocate("a", 3)
    assert kv == m.attention.slot_mapping("a", 6, 10)
    assert chain[0] == live and len(chain) == 5 and len(set(chain)) == 5
    assert [m.recurrent.states.kind[s] for s in chain[1:]] == [DRAFT] * 4


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_drafts_commit_moves_the_state_of_the_last_kept_position_into_place(accepted):
    m, r = decoding()
    old_live = m.live_slot("a")
    _, chain = m.drafts.allocate("a", 3)
    for j, s in enumerate(chain[1:]):  # the forward: the state after position j in slot j
        fill(m, s, float(j + 1))
    r.token_ids.extend([50, 51, 52][:accepted])
    m.drafts.commit("a", accepted + 1)
    assert r.num_computed_tokens == 6 + accepted + 1
    live = m.live_slot("a")
    assert live == chain[1 + accepted] and slot_value(m, live) == accepted + 1
    kinds = m.recurrent.states.kind
    assert kinds[old_live] == FREE and kinds[live] == LIVE
    assert all(kinds[s] == FREE for s in chain[1:] if s != live)
    assert len(m.block_ids("a")) == -(-r.num_computed_tokens // BS)  # rejected positions' blocks went back


def test_a_checkpoint_due_inside_the_run_comes_from_that_positions_slot():
    m, r = decoding(prompt_len=6, checkpoint_policy="every_n_blocks", checkpoint_every_n=2)
    _, chain = m.drafts.allocate("a", 3)  # positions 6..9; 8 = 2 blocks is due
    for j, s in enumerate(chain[1:]):
        fill(m, s, float(j + 1))
    r.token_ids.extend([50, 51, 52])
    m.drafts.commit("a", 4)  # computed 10 tokens: the boundary 8 lies inside the run
    h = r.block_hashes[1]
    ck = m.recurrent.checkpoints[h]
    assert ck.position == 8 and slot_value(m, ck.slot) == 2.0  # the state after position 7 (token 8)
    assert slot_value(m, m.live_slot("a")) == 4.0


def test_no_free_slot_refuses_and_changes_nothing():
    m, r = decoding(slots=3)  # null, live, one free: a chain of 3 does not fit
    free_before, blocks_before = m.recurrent.states.num_free, list(m.block_ids("a"))
    assert m.drafts.allocate("a", 2) is None
    assert m.recurrent.states.num_free == free_before and m.block_ids("a") == blocks_before
    assert m.drafts.allocate("a", 1) is None  # two draft slots, one free


def test_no_free_block_refuses_and_changes_nothing():
    m, r = decoding(blocks=2, max_tokens=2)  # positions 0..7 fit; a draft of 3 reaches position 9
    free_before = m.recurrent.states.num_free
    assert m.drafts.allocate("a", 3) is None
    assert m.recurrent.states.num_free == free_before and len(m.block_ids("a")) == 2
    assert m.drafts.allocate("a", 1) is not None  # positions 6, 7: inside the blocks held


@pytest.mark.parametrize("end", ["finish", "recompute", "swap", "failed"])
def test_a_chain_never_committed_is_freed_with_the_request(end):
    m, r = decoding()
    m.drafts.allocate("a", 3)
    if end == "finish":
        m.finish("a")
    elif end == "failed":
        m.finish("a", discard=True)
    else:
        m.preempt("a", end)
    kinds = m.recurrent.states.kind
    assert kinds.count(DRAFT) == 0 and kinds.count(LIVE) == 0
    assert m.stats().kv_blocks_used == 0


def test_a_draft_needs_one_token_left_and_no_negative_draft():
    m, r = decoding()
    with pytest.raises(RequestStateError, match="exactly one token left"):
        m.drafts.allocate("a", -1)
    r.token_ids.append(98)
    with pytest.raises(RequestStateError, match="exactly one token left"):
        m.drafts.allocate("a", 2)


@pytest.mark.parametrize("draft", [0, 3])
def test_a_run_kept_none_leaves_the_request_as_it_was(draft):
    """A draft model's run (speculative/draft_model.py): positions computed past the last real token
    and none kept (`commit(rid, 0)`): the live slot and its state, num_computed_tokens and the block
    table are as before the run; every draft slot and the blocks allocated for the run go back."""
    m, r = decoding(prompt_len=7)
    live, blocks = m.live_slot("a"), m.block_ids("a")
    fill(m, live, 7.0)
    used = m.stats().kv_blocks_used
    _, chain = m.drafts.allocate("a", draft)
    assert len(chain) == draft + 2
    for j, s in enumerate(chain[1:]):
        fill(m, s, float(j + 1))
    r.token_ids.extend([50, 51, 52][:draft])
    m.drafts.commit("a", 0)
    del r.token_ids[7 + 1:]
    assert r.num_computed_tokens == 7 and m.live_slot("a") == live and slot_value(m, live) == 7.0
    assert m.block_ids("a") == blocks and m.stats().kv_blocks_used == used
    assert m.recurrent.states.kind.count(DRAFT) == 0
    assert all(m.recurrent.states.kind[s] == FREE for s in chain[1:])


def test_checkpoints_leave_the_draft_reserve_free():
    """draft_slots=3 of 6 slots (null, live "a", 4 free): checkpoints take at most one free slot,
    evicting an older checkpoint rather than a reserved slot; the reserve stays for drafts."""
    m, r = decoding(prompt_len=8, slots=6, checkpoint_policy="every_n_blocks", checkpoint_every_n=1,
                    draft_slots=3)
    rec = m.recurrent
    for n in range(4):  # checkpoint at each block boundary, then compute the next block
        m.prefix_cache.checkpoint("a")
        assert rec.states.num_free >= 3
        r.token_ids.extend([60 + n] * 4)
        m.allocate("a", 4)
        m.commit("a", 4)
    assert len(rec.checkpoints) == 1
    assert m.drafts.allocate("a", 2) is not None  # the reserve holds a run of 2 drafted tokens


def test_the_plan_keeps_draft_slots_only_beside_a_first_request():
    from hybridkv.plan import plan, state_bytes_per_slot, kv_bytes_per_block

    slot, block = state_bytes_per_slot(HYBRID), kv_bytes_per_block(HYBRID, BS)
    p = plan(HYBRID, 100 * slot + 100 * block, BS, max_num_seqs=4, checkpoint_share=0.0, draft_slots=12)
    assert (p.draft_slots, p.live_slots, p.num_slots) == (12, 4, 1 + 4 + 12)
    small = plan(HYBRID, 3 * slot + block, BS, max_num_seqs=4, checkpoint_share=0.0, draft_slots=12)
    assert small.draft_slots == 0 and small.live_slots == 1
