"""Every family on the pools against transformers' model of the same tiny checkpoint: one test
per shared check (tests/family_checks.py), parametrized over the table FAMILIES."""
import pytest

from family_checks import (FAMILIES, check_engine_generate, check_engine_under_pressure,
                           check_prefix_hit_and_migration, check_prefix_hit_resumes, check_prompt_logits,
                           check_ragged_batch_greedy, check_state_checkpoint_at_block_boundary,
                           check_transformers_names_load_the_same, check_uneven_chunks_equal_one_pass)


# the longest rows (3-5 s of checks each, measured): in the slow tier only. zaya, granitemoe_swa,
# recurrent_gemma and rwkv keep fast-tier checks against transformers in their own files
# (test_zaya.py, test_granitemoe_swa.py, test_recurrent_gemma.py, test_pure_recurrent.py / test_rwkv.py);
# tiny-code is a trained Bamba (the bamba row) with its own fast tests (test_builtin_models.py).
SLOW = {"lara_mini", "kimi_linear", "bailing_hybrid", "zamba", "olmo_hybrid", "minimax", "lfm2_moe",
        "inkling", "inkling2", "inkling2_loop", "glm5_next", "qwen4_exp",
        "zaya", "tiny-code", "granitemoe_swa", "rwkv", "recurrent_gemma"}  # 2026-12-02: 8, 5, 3, 3, 2.6 s a row


def rows(has: str = ""):
    """The table's rows (those whose field `has` is set, when given), with the family as test id."""
    return [pytest.param(f, id=f.name, marks=pytest.mark.slow if f.name in SLOW else ())
            for f in FAMILIES.values() if not has or getattr(f, has)]


@pytest.mark.parametrize("fam", rows())
def test_full_prompt_logits(fam, family_models):
    _, ours, hf = family_models(fam.name)
    check_prompt_logits(ours, hf, n=fam.logits_len)


@pytest.mark.parametrize("fam", rows())
def test_ragged_batch_greedy_20_tokens(fam, family_models):
    _, ours, hf = family_models(fam.name)
    check_ragged_batch_greedy(ours, hf, lengths=fam.ragged)


@pytest.mark.parametrize("fam", rows())
def test_uneven_chunks_equal_one_pass(fam, family_models):
    _, ours, _ = family_models(fam.name)
    check_uneven_chunks_equal_one_pass(ours, chunks=fam.chunks, tol=fam.chunk_tol)


@pytest.mark.parametrize("fam", rows())
def test_state_checkpoint_at_block_boundary(fam, family_models):
    _, ours, hf = family_models(fam.name)
    check_state_checkpoint_at_block_boundary(ours, hf)


@pytest.mark.parametrize("fam", rows("engine"))
def test_engine_generate_matches_transformers(fam, family_models):
    path, _, hf = family_models(fam.name)
    lengths, seed = fam.engine
    check_engine_generate(path, hf, lengths=lengths, seed=seed)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("fam", rows("pressure"))
def test_engine_under_memory_pressure(fam, mode, family_models):
    path, ours, hf = family_models(fam.name)
    check_engine_under_pressure(path, ours, hf, fam.pressure, mode)


@pytest.mark.parametrize("fam", rows("prefix_migration"))
def test_prefix_hit_and_migration_mid_decode(fam, family_models):
    path, _, hf = family_models(fam.name)
    check_prefix_hit_and_migration(path, hf)


@pytest.mark.parametrize("fam", rows("prefix_hit"))
def test_prefix_hit_resumes_from_shared_pages_and_the_state(fam, family_models):
    path, _, hf = family_models(fam.name)
    check_prefix_hit_resumes(path, hf)


@pytest.mark.parametrize("fam", rows("names"))
def test_transformers_in_memory_names_load_the_same(fam, family_models, tmp_path):
    """A checkpoint holding transformers' own parameter names (stacked experts) loads identically."""
    path, ours, hf = family_models(fam.name)
    published, stacked_suffix = fam.names
    check_transformers_names_load_the_same(ours, hf, path, tmp_path, published, stacked_suffix)


def test_every_registered_family_has_a_row_and_a_readme_entry():
    """The registry, the family table and the README's "Supported architectures" paragraph agree."""
    import re
    from pathlib import Path

    from hybridkv.models.registry import family_names, supported_architectures

    assert set(family_names()) == {name for name, f in FAMILIES.items() if not f.builtin}
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    paragraph = readme.split("Supported architectures:", 1)[1].split("\n\n", 1)[0]
    named = re.findall(r"`(\w+For(?:CausalLM|ConditionalGeneration))`", paragraph)
    assert set(named) == set(supported_architectures())
