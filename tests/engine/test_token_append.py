"""TokenAppender.batch_stops + append_batch (the steady decode batch's path) against the row loop
`TokenAppender.__call__` on twin copies of random batches: random stop rules (max_tokens,
stop ids, EOS or ignore_eos, min_tokens, stop strings, max_model_len), tokens drawn often from the
stop ids, finish and check_stop that raise for some rows, and sibling rows a failure ends, the
batch rebuilt or kept (`BatchStops.keep`) without the rows that ended; after
every step the returned values, every row's tokens, status, finish reason and stop_reason, and the
order of the finish / fail calls must be the same."""
import random

import numpy as np
import pytest

from hybridkv.request import Request, RequestStatus
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler.token_append import TokenAppender

EOS = {200}
VOCAB = 260  # ids above the largest stop id (200, 77) too, for the table's clip


class LetterTokenizer:
    """Token t decodes to 'a' + t % 4; token 13 cannot be decoded (a check_stop that raises)."""

    def decode(self, ids, skip_special_tokens=True):
        if 13 in ids:
            raise ValueError("token 13 does not decode")
        return "".join("abcd"[t % 4] for t in ids)


class Twin:
    """One copy of a batch with its appender; finish and fail behave as the scheduler's and the
    engine's (fail ends every running sequence of the group) and log their calls."""

    def __init__(self, specs, max_model_len, tokenizer, doomed):
        self.log, self.doomed = [], doomed
        self.seqs = [Request(rid, prompt, params, group_id=gid) for rid, gid, prompt, params in specs]
        for s in self.seqs:
            s.status = RequestStatus.RUNNING
        self.groups = {}
        for s in self.seqs:
            self.groups.setdefault(s.group_id, []).append(s)
        self.appender = TokenAppender(EOS, max_model_len, tokenizer, self.finish)
        self.running = list(self.seqs)

    def finish(self, seq, reason):
        if seq.request_id in self.doomed:
            raise RuntimeError(f"cannot free {seq.request_id}")
        self.log.append(("finish", seq.request_id, reason))
        seq.status, seq.finish_reason = RequestStatus.FINISHED, reason

    def fail(self, seq, error):
        self.log.append(("fail", seq.request_id, str(error)))
        for s in self.groups[seq.group_id]:
            if not s.finished:
                s.status, s.finish_reason = RequestStatus.FINISHED, "error"

    def state(self):
        return [(s.request_id, s.token_ids, s.status, s.finish_reason, s.stop_reason) for s in self.seqs]


def random_specs(rng: random.Random, rows: int):
    specs, r = [], 0
    while r < rows:
        params = SamplingParams(
            max_tokens=rng.randint(4, 40), min_tokens=rng.choice([0, 0, 0, 4]), ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.choice([[], [], [5], [77, 6]]), stop=rng.choice([[], [], [], ["dd"], ["abc", "cc"]]))
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))]
        n = rng.choice([1, 1, 1, 2])  # siblings share params and a group (a fail ends both)
        for j in range(n):
            specs.append((f"g{r}.{j}", f"g{r}", prompt, params))
        r += n
    return specs


def draw(rng: random.Random, rows: int) -> list[int]:
    hot = [5, 6, 77, 200, 13, 3]  # stop ids, EOS, the undecodable token, a letter 'd'
    return [rng.choice(hot) if rng.random() < 0.25 else rng.randrange(VOCAB) for _ in range(rows)]


@pytest.mark.parametrize("seed", range(6))
def test_append_batch_answers_as_the_row_loop(seed):
    rng = random.Random(seed)
    asked = stopped_rows = failed = 0
    for _ in range(12):
        specs = random_specs(rng, rng.randint(1, 40))
        max_model_len = rng.choice([16, 30, 1000])
        tokenizer = rng.choice([None, LetterTokenizer(), LetterTokenizer()])
        doomed = {rid for rid, *_ in specs if rng.random() < 0.1}
        old, new = (Twin(specs, max_model_len, tokenizer, doomed) for _ in range(2))
        stops = new.appender.batch_stops(new.running)
        for _ in range(45):
            if not old.running:
                break
            tokens = draw(rng, len(old.running))
            want = old.appender(old.running, tokens, [None] * len(tokens), old.fail)
            lengths = np.array([len(s.token_ids) + 1 for s in new.running], dtype=np.int64)
            token_array = np.array(tokens, dtype=np.int64) if rng.random() < 0.5 else None
            got = new.appender.append_batch(new.running, list(tokens), stops, lengths, new.fail, token_array)
            assert got[0] == want[0]
            assert [s.request_id for s in got[1]] == [s.request_id for s in want[1]]
            assert new.state() == old.state() and new.log == old.log
            asked += len(tokens)
            stopped_rows += len(want[1])
            if any(s.finished for s in new.running):  # the engine rebuilds its batch without them
                old.running = [s for s in old.running if not s.finished]
                rows = [i for i, s in enumerate(new.running) if not s.finished]
                new.running = [new.running[i] for i in rows]
                stops = stops.keep(rows) if rng.random() < 0.5 else new.appender.batch_stops(new.running)
        failed += sum(entry[0] == "fail" for entry in old.log)
    assert stopped_rows > 20 and failed > 0 and asked > 500  # stops and failures did happen


def test_a_row_whose_finish_raises_fails_alone_and_the_others_are_appended():
    params = SamplingParams(max_tokens=3)
    specs = [(f"r{i}", f"r{i}", [1, 2], params) for i in range(5)]
    old, new = (Twin(specs, 1000, None, doomed={"r2"}) for _ in range(2))
    tokens = [9, 200, 200, 9, 200]  # EOS ends rows 1, 2 and 4; freeing row 2 raises
    want = old.appender(old.seqs, tokens, [None] * 5, old.fail)
    got = new.appender.append_batch(new.seqs, tokens, new.appender.batch_stops(new.seqs),
                                    np.full(5, 3, dtype=np.int64), new.fail, np.array(tokens))
    assert got[0] == want[0] == 5
    assert [s.request_id for s in got[1]] == [s.request_id for s in want[1]] == ["r1", "r4"]
    assert new.log == old.log == [("finish", "r1", "stop"), ("fail", "r2", "cannot free r2"),
                                  ("finish", "r4", "stop")]
    assert new.state() == old.state()
    assert [s.token_ids for s in new.seqs] == [[1, 2, t] for t in tokens]
    assert [s.finish_reason for s in new.seqs] == [None, "stop", "error", None, "stop"]


def test_a_failure_ends_its_siblings_later_in_the_batch_before_their_append():
    params = SamplingParams(max_tokens=10, stop=["dd"])
    specs = [("a", "a", [3], params), ("g.0", "g", [0], params), ("b", "b", [1], params), ("g.1", "g", [0], params)]
    old, new = (Twin(specs, 1000, LetterTokenizer(), doomed=set()) for _ in range(2))
    for twin in (old, new):
        twin.seqs[0].token_ids.append(3)  # "d" output already: one more "d" stops it
    tokens = [3, 13, 2, 3]  # row 1's check_stop raises: row 3, its sibling, ends unappended
    want = old.appender(old.seqs, tokens, [None] * 4, old.fail)
    got = new.appender.append_batch(new.seqs, tokens, new.appender.batch_stops(new.seqs),
                                    np.array([3, 2, 2, 2]), new.fail)
    assert got[0] == want[0] == 3
    assert [s.request_id for s in got[1]] == [s.request_id for s in want[1]] == ["a"]  # "dd"
    assert new.state() == old.state() and new.log == old.log
    assert new.seqs[3].token_ids == [0] and new.seqs[3].finish_reason == "error"
