"""speculative_config (hybridkv/speculative/config.py): vLLM's shape, bad values refused by name."""
import pytest

from hybridkv.speculative.config import SpeculativeConfig


def test_a_dict_or_its_json_gives_the_config():
    want = SpeculativeConfig("ngram", 3, 5, 1)
    got = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
                                "prompt_lookup_min": 1})
    assert got == want
    assert SpeculativeConfig.of('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
                                '"prompt_lookup_min": 1}') == want
    assert SpeculativeConfig.of(None) is None


@pytest.mark.parametrize("value, words", [
    ({"method": "eagle"}, "method 'eagle'"),
    ({"method": "mtp", "model": "x"}, "'model' is for method 'draft_model'"),
    ({"method": "draft_model"}, "needs 'model'"),
    ({"method": "ngram", "model": "x"}, "'model' is for method 'draft_model'"),
    ({"off_when_slower": 1}, "off_when_slower=1"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens=True"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4"),
    ({"k": 3}, "unknown key(s) ['k']"),
    ("{not json", "not JSON"),
])
def test_bad_values_are_refused_naming_them(value, words):
    with pytest.raises(ValueError, match=None) as e:
        SpeculativeConfig.of(value)
    assert words in str(e.value)


def test_llm_refuses_a_bad_config_before_loading(tmp_path):
    from hybridkv import LLM

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(tmp_path / "nothing-here"), speculative_config={"num_speculative_tokens": -2})
