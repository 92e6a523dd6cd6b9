"""StopRule (scheduler/stopping.py) is a prefilter of check_stop: on random sequences, params and
tokens, wherever check_stop ends a sequence the rule said it may (so asking check_stop only then
gives the same answers), and the rule lets most tokens of a plain decode through without asking."""
import random

from hybridkv.request import Request
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler.stopping import StopRule, check_stop


class LetterTokenizer:
    """Token t decodes to the letter 'a' + t % 4 (enough for stop strings to appear by chance)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("abcd"[t % 4] for t in ids)


def test_stop_rule_never_misses_a_stop():
    rng = random.Random(0)
    eos, stops, asked, tokens = {2}, 0, 0, 0
    for _ in range(400):
        tokenizer = rng.choice([None, LetterTokenizer()])
        params = SamplingParams(
            max_tokens=rng.randint(3, 30), min_tokens=rng.choice([0, 0, 3]), ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.choice([[], [5], [1, 6]]), stop=rng.choice([[], ["dd"], ["abc", "cc"]]))
        max_model_len = rng.choice([20, 64, 1000])
        prompt = [rng.randrange(8) for _ in range(rng.randint(1, 12))]
        if len(prompt) >= max_model_len:
            continue
        seq = Request("r", prompt, params)
        rule = StopRule.of(seq, eos, max_model_len, tokenizer)
        while True:
            tok = rng.randrange(8)
            seq.token_ids.append(tok)
            tokens += 1
            stop = check_stop(seq, eos, max_model_len, tokenizer)
            may = rule.may_stop(len(seq.token_ids), tok)
            asked += may
            assert may or stop is None, (params, seq.token_ids, stop)
            if stop is not None:
                stops += 1
                break
    assert stops > 300 and asked < tokens  # it ended sequences, and skipped check_stop for some tokens


def test_a_plain_decode_is_never_asked_before_its_limit():
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    seq = Request("r", [1, 2, 3], params)
    rule = StopRule.of(seq, {2}, 1000, None)
    assert not any(rule.may_stop(n, 2) for n in range(4, 53))
    done = Request("r", [1, 2, 3] + [2] * 50, params, num_prompt_tokens=3)
    assert rule.may_stop(53, 2) and check_stop(done, {2}, 1000, None).finish_reason == "length"
