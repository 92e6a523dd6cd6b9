"""Prompt-lookup drafting (hybridkv/speculative/ngram.py) against a brute-force search."""
import random

from hybridkv.speculative.ngram import NgramDrafter


def brute(tokens, k, min_n, max_n):
    """The longest suffix n-gram's latest earlier occurrence, then what followed it."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # latest first, ending before the last token
            if tokens[end - n:end] == suffix:
                out = tokens[end:end + k]
                while len(out) < k:
                    out.append(out[len(out) - (len(tokens) - end)])
                return out
    return []


def test_proposals_equal_a_brute_force_search_as_tokens_grow():
    rng = random.Random(0)
    for trial in range(40):
        min_n, max_n = rng.choice([(1, 1), (1, 3), (2, 4), (3, 5)])
        drafter = NgramDrafter(min_n, max_n)
        tokens = [rng.randrange(6) for _ in range(rng.randint(1, 8))]
        for _ in range(60):
            k = rng.randint(1, 6)
            assert drafter.propose(("r", trial), tokens, k) == brute(tokens, k, min_n, max_n)
            tokens.append(rng.randrange(6) if rng.random() < 0.7 else rng.choice(tokens))


def test_a_repeated_phrase_is_continued_and_a_fresh_one_is_not():
    d = NgramDrafter(2, 4)
    code = [10, 11, 12, 13, 14, 15, 16]
    assert d.propose("a", code + [90, 10, 11, 12], 3) == [13, 14, 15]
    assert d.propose("b", [1, 2, 3, 4, 5], 3) == []


def test_a_loop_continues_past_the_end_of_the_sequence():
    d = NgramDrafter(2, 3)
    assert d.propose("a", [9, 7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]  # period 2
    assert d.propose("b", [1, 5, 5, 5], 3) == [5, 5, 5]  # period 1


def test_forget_and_a_shorter_list_start_the_index_again():
    d = NgramDrafter(1, 2)
    assert d.propose("a", [1, 2, 3, 1], 2) == [2, 3]
    assert d.propose("a", [7, 8, 7], 2) == [8, 7]  # another list under the same id: indexed afresh
    tokens = [4, 4, 9, 4]
    assert d.propose("a", tokens, 2) == [9, 4]
    del tokens[1:]
    assert d.propose("a", tokens + [4], 1) == [4]
    d.forget("a")
    assert d.propose("a", [5, 6, 5], 1) == [6]
