"""Thread rules: add_request and abort may be called from any thread while another steps; they
take effect at once when no step runs, else at the start of the next step."""
import random
import threading

import pytest

from hybridkv import LLM
from hybridkv.models.tiny import make_tiny_checkpoint

from engine_fixtures import assert_no_leaks, greedy


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = str(make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba")))
    return LLM(path, memory_budget_bytes=8 << 20, max_num_seqs=6, max_num_batched_tokens=48)


@pytest.mark.slow  # 200 requests against a stepping engine
def test_add_and_abort_from_another_thread_while_stepping(llm):
    rng = random.Random(0)
    prompts = {f"t{i}": [rng.randrange(4, 128) for _ in range(rng.randint(1, 40))] for i in range(200)}
    lengths = {rid: rng.randint(1, 8) for rid in prompts}
    aborted, errors, started, during = set(), [], threading.Event(), []

    def hammer():
        try:
            added = []
            for rid, p in prompts.items():
                during.append(llm.engine.inbox.stepping)  # a step runs now: the add is queued
                llm.add_request(p, greedy(lengths[rid]), request_id=rid)
                added.append(rid)
                started.set()
                if rng.random() < 0.4:
                    victim = rng.choice(added)
                    llm.abort(victim)
                    aborted.add(victim)
        except Exception as e:  # reported by the main thread
            errors.append(e)
        finally:
            started.set()

    t = threading.Thread(target=hammer)
    t.start()
    started.wait(10)
    done, steps = {}, 0
    while t.is_alive() or llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        assert steps < 20_000
    t.join()
    assert not errors, errors
    assert sum(during) > 10, "no add_request ran while a step was running"
    assert_no_leaks(llm)
    for rid in prompts:
        assert rid in done or rid in aborted, rid
    kept = [rid for rid in prompts if rid in done]
    assert len(kept) > 50 and len(aborted) > 30
    ref = llm.generate([prompts[r] for r in kept], [greedy(lengths[r]) for r in kept], use_tqdm=False)
    assert [done[r].outputs[0].token_ids for r in kept] == [o.outputs[0].token_ids for o in ref]
    assert_no_leaks(llm)
