"""SlotSplit's verification of drafts position by position (models/slot_split.py), with a decode
written here: each position's state starts from the previous position's (through the pool's
rounding when the state is quantized), the live slot is never written."""
import torch

from hybridkv.models.forward_batch import ForwardBatch
from hybridkv.models.slot_split import split_decode_prefill


def verifying_batch(requantize=None) -> ForwardBatch:
    """One request verifying 3 tokens from live slot 1 into slots 4, 5, 6."""
    return ForwardBatch(
        input_ids=torch.tensor([10, 11, 12]), positions=torch.tensor([7, 8, 9]),
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32), seq_lens=torch.tensor([10], dtype=torch.int32),
        block_table=torch.zeros(1, 1, dtype=torch.int32), slot_mapping=torch.full((3,), -1),
        state_slots=torch.tensor([1], dtype=torch.int32), has_initial_state=torch.tensor([True]),
        query_lens_cpu=[3], seq_lens_cpu=[10], verify_slots={0: [1, 4, 5, 6]}, requantize=requantize)


def run(requantize=None):
    state = torch.zeros(8, 2)
    state[1] = torch.tensor([1.0, -3.0])

    def decode(x, split):  # state <- 0.5 * state + token id, read back as the output
        s = split.decode_slots.long()
        state[s] = 0.5 * state[s] + x[:, :1]
        return state[s].clone()
    x = torch.tensor([[10.0, 0.0], [11.0, 0.0], [12.0, 0.0]])
    out = split_decode_prefill(verifying_batch(requantize)).run(x, decode, None, states=(state,))
    return state, out


def test_each_position_starts_from_the_previous_positions_state():
    state, out = run()
    s4 = 0.5 * torch.tensor([1.0, -3.0]) + 10
    s5 = 0.5 * s4 + 11
    s6 = 0.5 * s5 + 12
    assert torch.equal(state[4], s4) and torch.equal(state[5], s5) and torch.equal(state[6], s6)
    assert torch.equal(state[1], torch.tensor([1.0, -3.0]))  # the live slot as it was
    assert torch.equal(out, torch.stack([s4, s5, s6]))


def test_a_quantized_state_passes_through_the_pools_rounding_between_positions():
    """requantize(pool, slots) is applied to the previous position's state before each position
    after the first (the first reads the live slot, which is already what the pool keeps)."""
    calls = []

    def requantize(t, slots):
        calls.append(slots.tolist())
        return torch.floor(t[slots])  # a rounding that shows
    state, _ = run(requantize)
    assert calls == [[4], [5]]
    s4 = 0.5 * torch.tensor([1.0, -3.0]) + 10
    s5 = 0.5 * torch.floor(s4) + 11
    s6 = 0.5 * torch.floor(s5) + 12
    assert torch.equal(state[4], s4) and torch.equal(state[5], s5) and torch.equal(state[6], s6)
