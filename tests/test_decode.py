"""Exactness of the speculative decoding engine on tiny random models.

The drafter is a freshly initialised DFlash drafter: deliberately imperfect, but over a small
vocabulary its DDTree trees still contain the target's choice often enough that multi-token
acceptances, commits and bonus tokens are all exercised (asserted below through tau > 1).

False-alarm budget: the chi-square tests of the sampling law run at ALPHA = 1e-6 / 7 each: seven
in the default run (a family-wise false-alarm rate of at most 1e-6), nine with the slow tests (1.3e-6).
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tevjax import verifiers
from tevjax.builder import ngram_table
from tevjax.decode import DecodeConfig, Decoder, engine
from tevjax.models.cache import KVCache
from tevjax.models.dflash import DFlashConfig, DFlashDrafter
from tevjax.models.layers import causal_mask
from tevjax.testing import random_model, tiny_config
from treegen import chi2_pvalue, softmax

SPECULATIVE = ("tev", "predraw", "sequential")
AR = None  # `verifier=AR` below: a Decoder without a drafter (autoregressive decoding)
PROMPTS = [[1, 5, 7, 9, 11], [1, 3], [1, 4, 4, 4, 4, 4, 8, 9, 10, 12, 14], [6]]


@pytest.fixture(scope="module")
def models():
    tcfg = tiny_config("llama", vocab_size=24)
    target = random_model(tcfg, seed=0)
    dcfg = DFlashConfig.for_target(tcfg, num_layers=1, block_size=6, mask_token_id=23)
    drafter = DFlashDrafter(dcfg, rngs=nnx.Rngs(1))
    return target, drafter


_DECODERS: dict = {}


def _decoder(models, verifier, ngrams=None, **kw):
    """Decoders are cached so that tests sharing a configuration share one Decoder (its placed
    weights and its per-capacity programs; the compiled programs themselves are shared by any
    Decoders with equal statics). `verifier=AR` gives no drafter (the config keeps its default
    verifier, which goes unused)."""
    target, drafter = models
    kw.setdefault("max_new_tokens", 24)
    kw.setdefault("budget", 8)
    kw.setdefault("prompt_bucket", 16)
    kw.setdefault("capacity", 64)
    key = (id(target), verifier, id(ngrams), tuple(sorted(kw.items())))
    if key not in _DECODERS:
        _DECODERS[key] = Decoder(target, drafter if verifier is not AR else None,
                                 DecodeConfig(**({} if verifier is AR else {"verifier": verifier}), **kw),
                                 ngrams=ngrams)
    return _DECODERS[key]


@pytest.fixture(scope="module")
def ar_greedy(models):
    return [g.tokens for g in _decoder(models, AR).generate(PROMPTS)]


# At temperature 0 `verifiers.verify` runs the one greedy verifier whatever the method, so the
# default suite decodes with TEV alone (test_verify.py checks every method's greedy path); predraw
# and sequential, which compile the same program again, run with the slow tests.
@pytest.mark.parametrize("lookup", [0, 5])
@pytest.mark.parametrize("verifier", ["tev"] + [pytest.param(v, marks=pytest.mark.slow) for v in SPECULATIVE[1:]])
def test_greedy_speculative_equals_autoregressive(models, ar_greedy, verifier, lookup):
    dec = _decoder(models, verifier, lookup=lookup)
    batched = dec.generate(PROMPTS)
    assert [g.tokens for g in batched] == ar_greedy
    assert max(g.tau for g in batched) > 1.2, "no multi-token acceptance: the commit path went untested"
    alone = dec.generate(PROMPTS[:1])
    assert alone[0].tokens == ar_greedy[0]


@pytest.mark.parametrize("architecture", ["mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "qwen2_moe",
                                          "smollm3", "granite", "olmo3", "olmoe", "granitemoe",
                                          "gpt_oss"])
def test_every_target_family_decodes_exactly(architecture):
    """The engine knows no architecture: for each family besides the fixture's Llama (biases on
    q/k/v only, q/k norms, tied or untied heads, Gemma's capped scores and logits and two ropes),
    greedy TEV over a fresh drafter and the context chain gives AR's tokens, with multi-token
    rounds (tau > 1)."""
    tcfg = tiny_config(architecture, vocab_size=24)
    target = random_model(tcfg, seed=4)
    drafter = DFlashDrafter(DFlashConfig.for_target(tcfg, num_layers=1, block_size=6, mask_token_id=23),
                            rngs=nnx.Rngs(1))
    kw = dict(max_new_tokens=24, budget=8, prompt_bucket=16, capacity=64)
    ar = Decoder(target, None, DecodeConfig(**kw)).generate(PROMPTS)
    spec = Decoder(target, drafter, DecodeConfig(verifier="tev", lookup=4, **kw)).generate(PROMPTS)
    assert [g.tokens for g in spec] == [g.tokens for g in ar]
    assert sum(len(g.tokens) for g in spec) > sum(g.rounds for g in spec)


def test_batched_rows_equal_rows_alone(models):
    dec = _decoder(models, "tev")
    batched = dec.generate(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        one = dec.generate([prompt])[0]
        assert one.tokens == batched[i].tokens
        assert one.rounds == batched[i].rounds


def test_eos_cuts_the_output_and_finished_rows_stop(models, ar_greedy):
    eos = ar_greedy[0][6]  # a token row 0 produces mid-way
    dec = _decoder(models, "tev", eos_ids=(eos,))
    out = dec.generate(PROMPTS)
    for row, ref in zip(out, ar_greedy):
        cut = ref.index(eos) + 1 if eos in ref else len(ref)
        assert row.tokens == ref[:cut], "tokens after EOS were emitted (or the output diverged)"
        assert row.stop == ("eos" if eos in ref else "length")
    assert out[0].stop == "eos" and len(out[0].tokens) <= 7


@pytest.mark.parametrize("verifier, temperature", [(AR, 0.0), ("tev", 1.0)])
def test_continuous_batching_equals_one_batch_of_every_prompt(models, verifier, temperature):
    """Seven prompts of several lengths and limits, some ending at an EOS, through 3 rows
    refilled as they finish: each prompt's output (and its rounds) equals `generate`'s for one
    batch of all seven, sampled ones too, since a prompt's stream is its own. Prompt 5 needs
    more cache slots than the ones before it, so the live caches grow when it is placed."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 23, rng.integers(1, 12)).tolist() for _ in range(7)]
    prompts[5] = rng.integers(0, 23, 40).tolist()  # a later prompt bucket: 96 slots, not 64
    limits = [5, 24, 3, 17, 9, 24, 2]
    dec = _decoder(models, verifier, temperature=temperature, eos_ids=(4,), capacity=None, capacity_bucket=32,
                   **({} if verifier is AR else {"lookup": 5}))
    want = dec.generate(prompts, seed=3, max_new_tokens=limits)
    assert any(g.stop == "eos" for g in want) and len({len(g.tokens) for g in want}) > 3  # rows end at many times
    placed = dec._place._cache_size()  # (Decoders with equal statics share their programs)
    got = dec.generate_continuous(prompts, 3, seed=3, max_new_tokens=limits)
    assert [(g.tokens, g.rounds, g.stop) for g in got] == [(g.tokens, g.rounds, g.stop) for g in want]
    assert dec._place._cache_size() - placed <= 4  # per capacity, refills of 1 row or 2 (powers of two)
    assert list(dec._grow_fns) == [96]
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        dec.generate_continuous(prompts, 0)
    # `continuous` yields each prompt once, as it finishes: a row that ends sooner is yielded sooner.
    order = [(i, g.tokens) for i, g in dec.continuous(prompts, 3, seed=3, max_new_tokens=limits)]
    assert sorted(order) == sorted((i, g.tokens) for i, g in enumerate(want))
    assert [i for i, _ in order] != list(range(len(prompts)))  # prompt 1 (24 tokens) outlasts 2 (3 tokens)
    assert [i for i, _ in order].index(2) < [i for i, _ in order].index(1)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        dec.continuous(prompts, -1)  # raised at the call, not at the first result


def test_a_later_batch_samples_with_its_prompts_own_streams(models):
    """`first_row`: a batch holding prompts 2.. of a list samples as rows 2.. of one batch of the
    whole list (the CLI's --batch-size decodes batch by batch), not with rows 0..'s streams again."""
    dec = _decoder(models, "tev", temperature=1.0, lookup=5)
    whole = [g.tokens for g in dec.generate(PROMPTS[:2] * 2, seed=3)]
    assert whole[0] != whole[2] or whole[1] != whole[3]  # the same prompts, other streams
    assert [g.tokens for g in dec.generate(PROMPTS[:2], seed=3, first_row=2)] == whole[2:]
    streamed = [[], []]
    for new, _ in dec.stream(PROMPTS[:2], seed=3, first_row=2):
        for row, toks in zip(streamed, new):
            row.extend(toks)
    assert streamed == whole[2:]
    for bad in (-1, 2**31 - 2, 1.0):
        with pytest.raises(ValueError, match=f"first_row must be an int from 0 to {2**31 - 1 - len(PROMPTS)}"):
            dec.generate(PROMPTS, first_row=bad)


def test_continuous_refills_never_prefill_more_rows_than_the_batch(models, ar_greedy, monkeypatch):
    """Refill groups are powers of two capped at batch_size: three rows that finish together are
    refilled by one prefill of three rows, not four; fewer prompts than rows take no idle rows."""
    dec = _decoder(models, AR)
    sizes, prefill = [], dec._prefill
    monkeypatch.setattr(dec, "_prefill", lambda prompts, *a: sizes.append(len(prompts)) or prefill(prompts, *a))
    prompts = PROMPTS[:3] * 2
    gens = dec.generate_continuous(prompts, 3, max_new_tokens=2)
    assert [g.tokens for g in gens] == [a[:2] for a in ar_greedy[:3]] * 2
    assert sizes == [3, 3]
    sizes.clear()
    gens = dec.generate_continuous(PROMPTS[:2], 3, max_new_tokens=2)
    assert [g.tokens for g in gens] == [a[:2] for a in ar_greedy[:2]]
    assert sizes == [2]


@pytest.mark.parametrize("verifier", [AR, "tev"])
def test_rows_take_their_own_max_new_tokens(models, ar_greedy, verifier):
    """Per-row limits are data, not shapes: each row stops at its own, with the loop compiled once."""
    dec = _decoder(models, verifier)
    limits = [5, 24, 1, 12]
    gens = dec.generate(PROMPTS, max_new_tokens=limits)
    compiled = dec._loop._cache_size()  # (other tests share this decoder with other batch shapes)
    assert [g.tokens for g in gens] == [a[:n] for a, n in zip(ar_greedy, limits)]
    assert all(g.stop == "length" for g in gens)
    assert [g.tokens for g in dec.generate(PROMPTS, max_new_tokens=3)] == [a[:3] for a in ar_greedy]
    streamed = [[] for _ in PROMPTS]
    for new, _ in dec.stream(PROMPTS, max_new_tokens=limits):
        for row, toks in zip(streamed, new):
            row.extend(toks)
    assert streamed == [a[:n] for a, n in zip(ar_greedy, limits)]
    assert dec._loop._cache_size() == compiled
    for bad, error, message in [([1, 25, 1, 1], ValueError, r"max_new_tokens\[1\] = 25 is outside \[1, 24\]"),
                                ([0, 1, 1, 1], ValueError, r"max_new_tokens\[0\] = 0 is outside"),
                                ([3, 3], ValueError, "2 values for 4 prompts"),
                                (2.5, TypeError, "must be an int, a list of ints or None, got float"),
                                (True, TypeError, "must be an int, a list of ints or None, got bool"),  # not 1
                                ([3, True, 3, 3], TypeError, r"max_new_tokens\[1\] must be an int")]:
        with pytest.raises(error, match=message):
            dec.generate(PROMPTS, max_new_tokens=bad)


@pytest.mark.parametrize("verifier", [AR, "tev"])
def test_rows_take_their_own_temperatures(models, ar_greedy, verifier):
    """With `sampling_per_row`, rows of one batch decode at their own temperatures: a greedy row
    gives autoregressive greedy decoding's tokens and a sampled row the tokens of the same row in
    a batch all at its temperature (same seed, so the same key stream), in fixed and continuous
    batches; other temperatures reuse the compiled loop. Without the flag, only the config's
    temperature is accepted."""
    dec = _decoder(models, verifier, sampling_per_row=True)
    temps = [0.0, 1.0, 0.0, 0.7]
    gens = dec.generate(PROMPTS, seed=5, temperature=temps)
    compiled = dec._loop._cache_size()
    uniform = {t: [g.tokens for g in _decoder(models, verifier, temperature=t).generate(PROMPTS, seed=5)]
               for t in (1.0, 0.7)}
    assert [g.tokens for g in gens] == [ar_greedy[0], uniform[1.0][1], ar_greedy[2], uniform[0.7][3]]
    assert uniform[1.0][1] != ar_greedy[1] and uniform[0.7][3] != ar_greedy[3]  # the rows really sampled
    assert [g.tokens for g in dec.generate(PROMPTS)] == ar_greedy  # default: the config's temperature, 0
    # Padding rows take the last value, as they take the last prompt.
    assert [g.tokens for g in dec.generate(PROMPTS, seed=5, temperature=[1.0, 1.0, 1.0, 1.0])] == uniform[1.0]
    assert dec._loop._cache_size() == compiled
    cont = dec.generate_continuous(PROMPTS, 2, seed=5, temperature=temps)
    assert [g.tokens for g in cont] == [g.tokens for g in gens]

    fixed = _decoder(models, verifier)
    assert [g.tokens for g in fixed.generate(PROMPTS, temperature=0.0)] == ar_greedy  # the config's own value
    for bad, error, message in [([0.0, 1.0, 0.0, 0.0], ValueError, r"sampling_per_row=True"),
                                (0.5, ValueError, r"sampling_per_row=True")]:
        with pytest.raises(error, match=message):
            fixed.generate(PROMPTS, temperature=bad)
    for bad, error, message in [([0.0, -1.0, 0.0, 0.0], ValueError, r"temperature\[1\] = -1.0 is not a finite float32"),
                                ([float("nan")] * 4, ValueError, r"temperature\[0\] = nan"),
                                ([0.0, 0.0, 1e39, 0.0], ValueError, r"temperature\[2\] = 1e\+39 is not a finite float32"),
                                ([0.0, 1.0], ValueError, "2 values for 4 prompts"),
                                ([0.0, "hot", 0.0, 0.0], TypeError, r"temperature\[1\] must be a number"),
                                ("hot", TypeError, "must be a number, a list of numbers or None, got str")]:
        with pytest.raises(error, match=message):
            dec.generate(PROMPTS, temperature=bad)


@pytest.mark.parametrize("verifier", [AR, "tev"])
def test_rows_take_their_own_truncation(models, ar_greedy, verifier):
    """Per-row top-k / top-p / min-p: top-k 1 at temperature 1 is greedy decoding; a row with
    top-p 0.5 or min-p 0.2 gives the tokens of the same row in a batch all with that setting; an
    untruncated row next to them those of plain sampling. Bad settings name their row."""
    dec = _decoder(models, verifier, sampling_per_row=True, temperature=1.0)
    gens = dec.generate(PROMPTS, seed=7, top_k=[1, 0, 0, 0], top_p=[1.0, 0.5, 1.0, 1.0], min_p=[0.0, 0.0, 0.2, 0.0])
    batch = {kw: [g.tokens for g in _decoder(models, verifier, temperature=1.0, **dict([kw])).generate(PROMPTS, seed=7)]
             for kw in (("top_p", 0.5), ("min_p", 0.2), ("top_k", 0))}
    assert [g.tokens for g in gens] == [ar_greedy[0], batch[("top_p", 0.5)][1], batch[("min_p", 0.2)][2],
                                        batch[("top_k", 0)][3]]
    assert len({tuple(batch[kw][1]) for kw in batch}) > 1  # the cuts change what a row samples
    # A batch whose only cut is one row's min-p cuts that row (the batch-wide "any cut?" test
    # reads every setting), and the others sample untruncated.
    only = [g.tokens for g in dec.generate(PROMPTS, seed=7, min_p=[0.0, 0.0, 0.2, 0.0])]
    assert only[2] == batch[("min_p", 0.2)][2] and only[3] == batch[("top_k", 0)][3]
    for kw, message in [(dict(top_k=[1, -1, 0, 0]), r"row 1: top_k must be >= 0"),
                        (dict(top_p=[1.0, 0.0, 1.0, 1.0]), r"row 1: top_p must be in \(0, 1\]"),
                        (dict(min_p=[0.0, 0.0, 1.0, 0.0]), r"row 2: min_p must be in \[0, 1\)")]:
        with pytest.raises(ValueError, match=message):
            dec.generate(PROMPTS, **kw)
    with pytest.raises(ValueError, match=r"top_k \[1, 0, 0, 0\] is not DecodeConfig.top_k \(0\)"):
        _decoder(models, verifier).generate(PROMPTS, top_k=[1, 0, 0, 0])


def test_sampling_per_row_with_the_fallback_keeps_greedy_rows_exact(models, ar_greedy):
    """The fallback's estimate of each row's block uses the row's own law (greedy: the realised
    block; sampled: 1 + C_p), and a greedy row stays exact next to sampled ones."""
    dec = _decoder(models, "tev", sampling_per_row=True, fallback_below=1.5)
    gens = dec.generate(PROMPTS, seed=2, temperature=[1.0, 0.0, 1.0, 0.0])
    assert [gens[1].tokens, gens[3].tokens] == [ar_greedy[1], ar_greedy[3]]
    assert all(len(g.tokens) == 24 or g.stop == "eos" for g in gens)


def test_cache_after_each_round_equals_fresh_prefill(models):
    target, drafter = models
    dec = _decoder(models, "tev", temperature=1.0, max_new_tokens=16)
    fresh = dec
    prompts = PROMPTS[:3]
    rounds = 0
    for _, state in dec.stream(prompts, seed=4):
        rounds += 1
        cache_len = np.asarray(state.cache_len)
        out, num_out = np.asarray(state.out), np.asarray(state.num_out)
        for i, prompt in enumerate(prompts):
            committed = list(prompt) + out[i, : num_out[i]].tolist()
            ref = fresh.prefill([committed])  # caches hold committed[:-1]; the last token is the root
            n = len(committed) - 1
            assert cache_len[i] == n and int(ref.cache_len[0]) == n
            assert int(state.root[i]) == committed[-1]
            for got, want in ((state.target_cache.k, ref.target_cache.k), (state.target_cache.v, ref.target_cache.v),
                              (state.drafter_cache.k, ref.drafter_cache.k), (state.drafter_cache.v, ref.drafter_cache.v)):
                np.testing.assert_allclose(np.asarray(got[:, i, :, :n]), np.asarray(want[:, 0, :, :n]), atol=2e-5)
    assert rounds >= 3


def test_lookup_history_holds_the_text_and_the_chain_shortens_decoding(models, ar_greedy):
    """With `lookup`, the state's history holds every committed token by slot, the root at slot
    cache_len, after every round; and on this target's repetitive greedy text the lookup chain
    takes fewer rounds than the drafter's tree alone, with the same tokens."""
    dec = _decoder(models, "tev", lookup=5, temperature=1.0, max_new_tokens=16)
    for _, state in dec.stream(PROMPTS, seed=3):
        cache_len, out, num_out = (np.asarray(x) for x in (state.cache_len, state.out, state.num_out))
        history = np.asarray(state.history)
        for i, prompt in enumerate(PROMPTS):
            committed = list(prompt) + out[i, : num_out[i]].tolist()
            if not np.asarray(state.done)[i]:
                assert history[i, : cache_len[i] + 1].tolist() == committed
    plain, looked = _decoder(models, "tev").generate(PROMPTS), _decoder(models, "tev", lookup=5).generate(PROMPTS)
    assert [g.tokens for g in looked] == [g.tokens for g in plain] == ar_greedy
    assert sum(g.rounds for g in looked) < sum(g.rounds for g in plain)
    assert _decoder(models, AR, lookup=5).generate(PROMPTS)[0].tokens == ar_greedy[0]  # no drafter: no lookup


def test_lookup_survival_ranks_the_chain_against_the_tree(models, ar_greedy):
    """`lookup_survival` sets the chain's estimated reach: a table of near-zero survival never
    outranks a drafter node (a full tree leaves no padding), so decoding takes the drafter-alone
    rounds exactly; a near-certain one puts the chain first. The tokens never change."""
    plain = _decoder(models, "tev").generate(PROMPTS)
    never = _decoder(models, "tev", lookup=5, lookup_survival=((1e-30, 1e-31),) * 5).generate(PROMPTS)
    always = _decoder(models, "tev", lookup=5, lookup_survival=((0.999, 0.998),) * 5).generate(PROMPTS)
    default = _decoder(models, "tev", lookup=5).generate(PROMPTS)
    assert [g.tokens for g in never] == [g.tokens for g in always] == ar_greedy
    assert [g.rounds for g in never] == [g.rounds for g in plain]
    assert [g.rounds for g in always] != [g.rounds for g in never]
    assert [g.rounds for g in default] != [g.rounds for g in never]


def test_corpus_chain_from_the_targets_own_answers_shortens_decoding(models, ar_greedy):
    """A corpus table counted on the target's own greedy answers (to the same prompts: the chain
    then knows the answer) takes far fewer rounds than the drafter's tree alone, merged alone or
    after the context chain, with the same tokens, as a table of random text does too. Without a
    table a corpus chain is refused."""
    texts = [list(p) + a for p, a in zip(PROMPTS, ar_greedy)]
    offsets = np.cumsum([0] + [len(t) for t in texts])
    own = ngram_table(np.concatenate(texts), offsets, np.asarray([len(p) for p in PROMPTS]), min_count=1)
    rng = np.random.default_rng(0)
    other_texts = rng.integers(0, 24, size=(20, 30))
    other = ngram_table(other_texts.ravel(), np.arange(0, 601, 30), np.zeros(20, int), min_count=1)
    plain = _decoder(models, "tev").generate(PROMPTS)
    runs = {name: _decoder(models, "tev", ngrams=table, corpus=6, lookup=lookup).generate(PROMPTS)
            for name, table, lookup in (("own", own, 0), ("own+context", own, 5), ("other", other, 0))}
    for gens in runs.values():
        assert [g.tokens for g in gens] == ar_greedy
    rounds = {name: sum(g.rounds for g in gens) for name, gens in runs.items()}
    assert rounds["own"] < 0.6 * sum(g.rounds for g in plain), (rounds, sum(g.rounds for g in plain))
    assert rounds["own+context"] <= 0.6 * sum(g.rounds for g in plain)
    target, drafter = models
    with pytest.raises(ValueError, match="corpus = 6 needs an n-gram table"):
        Decoder(target, drafter, DecodeConfig(corpus=6))
    assert Decoder(target, None, DecodeConfig(corpus=6)).ngrams is None  # no drafter: no lookup at all


# --- the sampling law of the first three tokens ------------------------------------------------

V_SMALL, NUM_ROWS, TEMPERATURE = 8, 6000, 1.0
# The NUM_ROWS-row runs spend most of their time in attention over the cache: capacities in steps
# of 8 (24 slots here) instead of the default 128 make them 2-3x faster.
SAMPLING_CAPACITY_BUCKET = 8
SAMPLING_PROMPT = [1, 5, 3]
ALPHA = 1e-6 / 7
# A prompt whose last two tokens occurred before: the lookup proposes a chain from round 0 on.
LOOP_PROMPT = [1, 5, 3, 1, 5]


@pytest.fixture(scope="module")
def small_models():
    tcfg = tiny_config("llama", vocab_size=V_SMALL)
    target = random_model(tcfg, seed=3)
    dcfg = DFlashConfig.for_target(tcfg, num_layers=1, block_size=4, mask_token_id=V_SMALL - 1)
    return target, DFlashDrafter(dcfg, rngs=nnx.Rngs(2))


@pytest.fixture(scope="module")
def exact_first3(small_models):
    return _first3_law(small_models[0], SAMPLING_PROMPT)


# Truncated sampling: top-k 4, then top-p 0.8 of those, then min-p 0.2.
TRUNCATION = {"top_k": 4, "top_p": 0.8, "min_p": 0.2}


def _truncated(p, top_k=0, top_p=1.0, min_p=0.0):
    """Reference truncation of probability rows [..., V] by sorting (transformers' rules; the rows
    here have no ties), renormalised."""
    p = p.copy()
    order = np.argsort(-p, axis=-1)
    rank = np.argsort(order, axis=-1)
    if top_k:
        p = np.where(rank < top_k, p, 0.0)
    p /= p.sum(-1, keepdims=True)
    if top_p < 1:
        s = np.take_along_axis(p, order, -1)
        before = np.cumsum(s, -1) - s
        p = np.where(np.take_along_axis(before, rank, -1) < top_p, p, 0.0)
    if min_p:
        p = np.where(p >= min_p * p.max(-1, keepdims=True), p, 0.0)
    return p / p.sum(-1, keepdims=True)


def _first3_law(target, prompt, truncation=None):
    """P(t1, t2, t3 | prompt) by enumerating every (t1, t2) continuation through the target."""
    seqs = np.array([prompt + [a, b] for a, b in itertools.product(range(V_SMALL), repeat=2)], np.int32)
    n, t = seqs.shape
    out = target(jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(t), (n, t)),
                 KVCache.init(target.cfg, n, t, tree_slots=t),
                 jnp.zeros(n, jnp.int32), jnp.broadcast_to(causal_mask(t), (n, t, t)))
    p = softmax(np.asarray(out.logits, np.float64)[:, -3:] / TEMPERATURE)  # [V*V, 3, V]
    if truncation:
        p = _truncated(p, **truncation)
    p1 = p[0, 0]
    law = np.zeros((V_SMALL,) * 3)
    for k, (a, b) in enumerate(itertools.product(range(V_SMALL), repeat=2)):
        law[a, b] = p1[a] * p[k, 1, b] * p[k, 2]
    return law


def _first3_counts(models, verifier, prompt=SAMPLING_PROMPT, lookup=0, truncation=None, **kw):
    """Counts of the first three tokens over NUM_ROWS sampled rows, and tau (`kw`: more config)."""
    target, drafter = models
    dec = Decoder(target, drafter if verifier is not AR else None,
                  DecodeConfig(**({} if verifier is AR else {"verifier": verifier}), temperature=TEMPERATURE,
                               budget=6, lookup=lookup, max_new_tokens=3, prompt_bucket=8,
                               capacity_bucket=SAMPLING_CAPACITY_BUCKET, **(truncation or {}), **kw))
    out = dec.run(dec.prefill([prompt] * NUM_ROWS, seed=11))
    toks = np.asarray(out.out)
    assert np.all(np.asarray(out.num_out) == 3)
    counts = np.zeros((V_SMALL,) * 3)
    np.add.at(counts, (toks[:, 0], toks[:, 1], toks[:, 2]), 1)
    return counts, float(np.asarray(out.block_total).sum() / np.asarray(out.rounds).sum())


def _first3_pvalue(models, verifier, law, prompt=SAMPLING_PROMPT, lookup=0):
    counts, tau = _first3_counts(models, verifier, prompt, lookup)
    return chi2_pvalue(counts, law), tau


# predraw and sequential are `slow` here: each verifier's law is tested on its own in
# test_verify.py, and the decoder passes them the same trees and logits as TEV (tested here).
@pytest.mark.parametrize("verifier", [pytest.param(AR, id="ar"), pytest.param("tev", id="tev")] + [
    pytest.param(v, id=v, marks=pytest.mark.slow) for v in SPECULATIVE[1:]])
def test_first_three_tokens_follow_the_target_law(small_models, exact_first3, verifier):
    p, tau = _first3_pvalue(small_models, verifier, exact_first3)
    assert p > ALPHA, f"{verifier or 'no drafter'}: the joint law of the first 3 tokens was rejected (p={p:.3g})"
    if verifier is not AR:
        assert tau > 1.3, f"tau {tau:.2f}: too few multi-token rounds for the test to mean anything"


def test_first_three_tokens_follow_the_target_law_on_a_hybrid_target():
    """A hybrid target (Qwen3-Next: a Gated DeltaNet layer, then gated attention with experts): TEV's
    first three tokens follow its law, computed by whole-sequence forwards, so the tree pass through
    the recurrence and the commit of multi-token paths into its state keep the law exact."""
    tcfg = tiny_config("qwen3_next", vocab_size=V_SMALL)
    target = random_model(tcfg, seed=3)
    dcfg = DFlashConfig.for_target(tcfg, num_layers=1, block_size=4, mask_token_id=V_SMALL - 1)
    models = (target, DFlashDrafter(dcfg, rngs=nnx.Rngs(2)))
    p, tau = _first3_pvalue(models, "tev", _first3_law(target, SAMPLING_PROMPT))
    assert p > ALPHA, f"TEV on a hybrid target: the joint law of the first 3 tokens was rejected (p={p:.3g})"
    assert tau > 1.3, f"tau {tau:.2f}: too few multi-token rounds for the test to mean anything"


def test_first_three_tokens_follow_the_target_law_with_lookup(small_models):
    """Lookup chains change the trees, never the law: any fixed tree is verified exactly."""
    p, tau = _first3_pvalue(small_models, "tev", _first3_law(small_models[0], LOOP_PROMPT), LOOP_PROMPT, lookup=6)
    assert p > ALPHA, f"TEV with lookup: the joint law of the first 3 tokens was rejected (p={p:.3g})"
    assert tau > 1.2, f"tau {tau:.2f}: too few multi-token rounds for the test to mean anything"


@pytest.mark.parametrize("verifier", [pytest.param(AR, id="ar"), pytest.param("tev", id="tev")])
def test_truncated_sampling_follows_the_truncated_target_law(small_models, exact_first3, verifier):
    """top-k, top-p and min-p change the target law, for the baseline and the verifier alike."""
    counts, tau = _first3_counts(small_models, verifier, truncation=TRUNCATION)
    law = _first3_law(small_models[0], SAMPLING_PROMPT, TRUNCATION)
    assert (law > 0).sum() < 0.5 * (exact_first3 > 0).sum()  # the truncation removes most sequences
    p = chi2_pvalue(counts, law)
    assert p > ALPHA, f"{verifier or 'no drafter'}: the truncated law of the first 3 tokens was rejected (p={p:.3g})"
    assert chi2_pvalue(counts, exact_first3) < 1e-9, "the test has no power against an untruncated decoder"
    if verifier is not AR:
        assert tau > 1.3, f"tau {tau:.2f}: too few multi-token rounds for the test to mean anything"


# --- fallback to plain target steps ----------------------------------------------------------


def _host(state):
    # A copy (the next step consumes, donates, the state); numpy holds keys as their key data.
    return jax.tree.map(np.asarray, dataclasses.replace(state, keys=jax.random.key_data(state.keys)))


def test_fallback_keeps_greedy_outputs_and_follows_its_schedule(models, ar_greedy):
    """A threshold no tree reaches makes every row draft at rounds 0, 1 + 2, 4 + 4, 9 + 8, ...
    (waits of fallback_rounds doubling); one that every tree reaches (a block is at least the
    bonus) never falls back. Greedy outputs are AR's either way."""
    k = 2
    dec = _decoder(models, "tev", fallback_below=100.0, fallback_rounds=k)
    state = dec.run(dec.prefill(PROMPTS))
    assert [g.tokens for g in dec.results(state)] == ar_greedy
    rounds, plain = np.asarray(state.rounds), np.asarray(state.plain_rounds)
    drafted_at, wait = [0], k
    while drafted_at[-1] < rounds.max():
        drafted_at.append(drafted_at[-1] + 1 + wait)
        wait = min(2 * wait, engine.FALLBACK_MAX_WAIT)
    np.testing.assert_array_equal(rounds - plain, [sum(d < r for d in drafted_at) for r in rounds])
    assert plain.min() > 0 and (rounds - plain).max() >= 3
    assert [g.plain_rounds for g in dec.results(state)] == plain.tolist()

    never = _decoder(models, "tev", fallback_below=1.0)
    always = _decoder(models, "tev").generate(PROMPTS)
    gens = never.generate(PROMPTS)
    assert [g.tokens for g in gens] == ar_greedy
    assert [g.rounds for g in gens] == [g.rounds for g in always]
    assert all(g.plain_rounds == 0 for g in gens) and all(g.plain_rounds == 0 for g in always)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fallback_bookkeeping_round_by_round(models, ar_greedy, temperature):
    """Each round: a drafted one when some active row is due (skip 0), which moves every active
    row's expected block halfway to its tree's (greedy: the block it got) and, where the estimate
    is below the threshold, sets skip to a wait of fallback_rounds, or twice the row's last one
    (0 where the estimate is not below); otherwise a plain one, in which
    every active row emits one token, counts it and waits one round less."""
    k, threshold = 2, 2.5
    dec = _decoder(models, "tev", fallback_below=threshold, fallback_rounds=k, temperature=temperature)
    state = dec.prefill(PROMPTS, seed=3)
    kinds = set()
    for _ in range(40):
        before = _host(state)
        if before.done.all():
            break
        state = dec.step(state)
        after = _host(state)
        active = ~before.done & ~after.nonfinite
        block = after.block_total - before.block_total
        drafted = bool(np.any(~before.done & (before.skip == 0)))
        kinds.add(drafted)
        if drafted:
            np.testing.assert_array_equal(after.plain_rounds, before.plain_rounds)
            if temperature == 0:
                want = np.where(active, 0.5 * before.expected_block + 0.5 * block, before.expected_block)
                np.testing.assert_allclose(after.expected_block, want, rtol=1e-6)
            low = active & (after.expected_block < threshold)
            wait = np.where(low, np.clip(2 * before.wait, k, engine.FALLBACK_MAX_WAIT),
                            np.where(active, 0, before.wait))
            np.testing.assert_array_equal(after.wait, wait)
            np.testing.assert_array_equal(after.skip, np.where(low, wait, 0))
        else:
            np.testing.assert_array_equal(block[active], 1)
            np.testing.assert_array_equal(after.plain_rounds, before.plain_rounds + active)
            np.testing.assert_array_equal(after.skip, np.where(active, np.maximum(before.skip - 1, 0), before.skip))
            np.testing.assert_array_equal(after.expected_block, before.expected_block)
    assert kinds == {True, False}, "the test saw only one kind of round"
    if temperature == 0:
        assert [g.tokens for g in dec.results(state)] == ar_greedy


def test_fallback_estimate_is_the_exit_laws_mean_block(small_models):
    """At temperature 1 a drafted round's estimate uses 1 + C_p of the verified tree, the mean of
    the block the row then gets: over NUM_ROWS rows after the first round, the mean estimate and
    the mean realised block agree within 5 standard errors (false alarm ~6e-7); estimates taken
    from another law (e.g. untempered logits) would not."""
    target, drafter = small_models
    dec = Decoder(target, drafter, DecodeConfig(verifier="tev", temperature=TEMPERATURE, budget=6, max_new_tokens=8,
                                                prompt_bucket=8, capacity_bucket=SAMPLING_CAPACITY_BUCKET,
                                                fallback_below=1.5))
    first = _host(dec.step(dec.prefill([SAMPLING_PROMPT] * NUM_ROWS, seed=5)))
    this = (first.expected_block - 0.5 * drafter.cfg.block_size) / 0.5  # 1 + C_p per row
    block = first.block_total.astype(np.float64)
    assert np.all(this >= 1 - 1e-5) and np.all(this <= drafter.cfg.block_size + 1e-5)
    assert np.ptp(this) < 1e-4, "the rows share one prompt and one drafter: one tree, one law"
    se = block.std() / np.sqrt(NUM_ROWS)
    assert abs(this.mean() - block.mean()) < 5 * se, (this.mean(), block.mean(), se)
    assert block.mean() > 1.3, "too few multi-token rounds for the test to mean anything"


def test_fallback_keeps_the_target_law(small_models, exact_first3):
    """Drafted rounds alternating with plain ones (fallback_rounds 1, a threshold no tree reaches):
    the first three tokens still follow the target's joint law."""
    counts, _ = _first3_counts(small_models, "tev", fallback_below=100.0, fallback_rounds=1)
    p = chi2_pvalue(counts, exact_first3)
    assert p > ALPHA, f"TEV with fallback: the joint law of the first 3 tokens was rejected (p={p:.3g})"


def _broken_tev(key, tree, logits, temperature):
    """TEV drawing the bonus from p_v instead of the residual: outputs are no longer target-distributed."""
    stats = verifiers._sample_stats(tree, logits, temperature)
    law = verifiers.law_from_edges(tree, stats.edge_prob)
    k1, k2 = jax.random.split(key)
    exit_node = jax.random.categorical(k1, jnp.log(law.exit_prob)).astype(jnp.int32)
    return verifiers._assemble(tree, exit_node, jax.random.categorical(k2, stats.scaled_row(exit_node)))


def test_a_broken_verifier_is_detected(small_models, exact_first3, monkeypatch):
    monkeypatch.setitem(verifiers.VERIFIERS, "broken", _broken_tev)
    p, _ = _first3_pvalue(small_models, "broken", exact_first3)
    assert p < 1e-9, f"the law test has no power against a broken verifier (p={p:.3g})"


# --- configuration errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"verifier": "nope"}, "unknown verifier 'nope'"),
        ({"verifier": "ar"}, r"autoregressive decoding pass no drafter, Decoder\(target, None, cfg\)"),
        ({"temperature": -1.0}, "temperature must be a finite float32 number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite float32 number >= 0"),
        ({"temperature": 1e39}, "temperature must be a finite float32 number >= 0"),
        ({"budget": 0}, "budget must be >= 1"),
        ({"budget": 4, "lookup": 5}, r"lookup must be between 0 and the budget \(4\), got 5"),
        ({"lookup": -1}, "lookup must be between 0 and the budget"),
        ({"budget": 4, "corpus": 5}, r"corpus must be between 0 and the budget \(4\), got 5"),
        ({"lookup_survival": ((0.5, 0.4),) * 4}, r"survival must be a 5 x D table .* got shape \(4, 2\)"),
        ({"lookup_survival": ((0.5,),) * 5}, r"D >= 2 depths\), got shape \(5, 1\)"),
        ({"lookup_survival": ((0.5, 0.0),) * 5}, r"probabilities in \(0, 1\], got 0.0 .. 0.5"),
        ({"lookup_survival": ((0.5, float("nan")),) * 5}, r"probabilities in \(0, 1\]"),
        ({"lookup_survival": ((0.4, 0.5),) * 5}, "must not grow with depth"),
        ({"lookup_survival": "high"}, "survival must be a table of numbers, got 'high'"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"top_k": -2}, r"top_k must be >= 0 \(0: off\), got -2"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\] \(1: off\), got 0.0"),
        ({"min_p": 1.0}, r"min_p must be in \[0, 1\) \(0: off\), got 1.0"),
        ({"prefill_chunk": 0}, r"DecodeConfig.prefill_chunk must be >= 1, got 0"),
        ({"prompt_bucket": -8}, r"DecodeConfig.prompt_bucket must be >= 1, got -8"),
        ({"fallback_below": -1.0}, r"fallback_below must be a finite number >= 0 .*got -1.0"),
        ({"fallback_below": float("inf")}, r"fallback_below must be a finite number >= 0 .*got inf"),
        ({"fallback_below": float("nan")}, r"fallback_below must be a finite number >= 0 .*got nan"),
        ({"fallback_below": True}, r"fallback_below must be a finite number >= 0 .*got True"),
        ({"fallback_rounds": 0}, r"fallback_rounds must be >= 1, got 0"),
        ({"capacity": 0}, r"DecodeConfig.capacity must be >= 1 or None, got 0"),
        ({"verifier": ["tev"]}, r"unknown verifier \['tev'\]"),
    ],
)
def test_bad_config_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodeConfig(**kwargs)


def test_config_layers_must_be_ints_and_numpy_ints_become_ints():
    """int() read hidden layer 1.7 and True as layer 1 and the string "12" as layers 1 and 2; a
    NumPy int field made the shape arithmetic NumPy's (an np.int16 bucket overflows)."""
    for layers in ((1.7,), (True,), "12", 3, None):
        with pytest.raises(TypeError, match="DecodeConfig.hidden_layers must be a tuple of layer indices"):
            DecodeConfig(hidden_layers=layers)
    cfg = DecodeConfig(budget=np.int64(4), capacity_bucket=np.int16(128), capacity=np.int32(512),
                       hidden_layers=[np.int64(1)])
    assert (cfg.budget, cfg.capacity_bucket, cfg.capacity, cfg.hidden_layers) == (4, 128, 512, (1,))
    assert {type(cfg.budget), type(cfg.capacity_bucket), type(cfg.capacity)} == {int}


def test_bad_prompts_and_capacity_are_rejected(models):
    dec = _decoder(models, "tev")
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        dec.prefill([[1, 2], []])
    with pytest.raises(ValueError, match="token id 99 outside the vocabulary"):
        dec.prefill([[1, 99]])
    with pytest.raises(ValueError, match="capacity 64 is too small"):
        dec.prefill([list(range(1, 20)) * 3])


def test_without_a_drafter_a_round_has_one_tree_slot(models):
    """Whether rounds draft is the Decoder's (a drafter was given), not the config's: without one
    the budget goes unused and the caches and the positions check count N = 1 slot."""
    target, drafter = models
    cfg = DecodeConfig(budget=8, max_new_tokens=24, prompt_bucket=16, capacity=16 + 1 + 24 + 1)
    ar, spec = Decoder(target, None, cfg), Decoder(target, drafter, cfg)
    assert (ar.speculative, ar.tree_slots, ar.dstate) == (False, 1, None)
    assert (spec.speculative, spec.tree_slots) == (True, 9)
    assert ar.shapes([10]) == (16, 42)
    with pytest.raises(ValueError, match="tree slots 9"):
        spec.shapes([10])
    limit = target.cfg.max_position_embeddings
    roomy = dataclasses.replace(cfg, capacity=None, max_new_tokens=limit - 10 - 1)
    Decoder(target, None, roomy).shapes([10])  # 10 + max_new_tokens + 1 fits the positions
    with pytest.raises(ValueError, match="exceeds the model's"):
        Decoder(target, drafter, roomy).shapes([10])


def test_shapes_round_prompts_and_caches_up_to_whole_buckets(models):
    """prompt[:-1] is rounded up to the prompt bucket (an exact multiple stays), the cache to the
    capacity bucket: bucket + 1 (the root) + max_new_tokens + 1 (the tree slot), here 32 exactly
    for prompts of up to 17 tokens."""
    target, _ = models
    dec = Decoder(target, None, DecodeConfig(prompt_bucket=16, capacity_bucket=32, max_new_tokens=14))
    assert [dec.shapes([n]) for n in (1, 2, 17, 18, 33, 34)] == [(16, 32), (16, 32), (16, 32), (32, 64), (32, 64),
                                                                  (48, 64)]
    assert dec.shapes([3, 17, 5]) == (16, 32)  # the longest prompt decides


def test_scatter_block_writes_each_rows_span_only():
    """Row b gets block entries 0 .. end - start - 1 at columns start .. end - 1 and nothing else:
    the output buffer stays -1 past num_out (and the log-probabilities 0)."""
    buf = jnp.full((4, 6), -1, jnp.int32)
    block = jnp.arange(1, 17, dtype=jnp.int32).reshape(4, 4)
    got = engine.scatter_block(buf, jnp.asarray([0, 2, 5, 1]), jnp.asarray([3, 2, 6, 5]), block)
    assert np.asarray(got).tolist() == [[1, 2, 3, -1, -1, -1], [-1] * 6, [-1, -1, -1, -1, -1, 9],
                                        [-1, 13, 14, 15, 16, -1]]


def test_loop_until_one_returns_when_another_row_finishes(models):
    """Continuous batching's loop stops after the round in which a row not done before the call
    finishes (not after max_rounds, nor at once because of a row done before), and within
    max_rounds otherwise. Autoregressive rows emit one token a round."""
    dec = _decoder(models, AR)
    loop = functools.partial(dec._loop_until_one, dec.tstate, dec.dstate)
    state = dec.prefill(PROMPTS, max_new_tokens=[24, 3, 24, 10])
    state = loop(state, np.int32(100), dec.ngrams, dec.stops)
    assert np.asarray(state.rounds).tolist() == [3, 3, 3, 3]
    assert np.asarray(state.done).tolist() == [False, True, False, False]
    state = loop(state, np.int32(5), dec.ngrams, dec.stops)  # row 1, done before, does not end the call
    assert np.asarray(state.rounds).tolist() == [8, 3, 8, 8]
    state = loop(state, np.int32(100), dec.ngrams, dec.stops)
    assert np.asarray(state.rounds).tolist() == [10, 3, 10, 10]
    assert np.asarray(state.done).tolist() == [False, True, False, True]


def test_a_fallback_wait_longer_than_the_cap_is_kept(models):
    """FALLBACK_MAX_WAIT caps the doubling, not the configured wait: fallback_rounds above it is
    waited in full after a drafted round that did not pay."""
    k = 2 * engine.FALLBACK_MAX_WAIT
    dec = _decoder(models, "tev", fallback_below=100.0, fallback_rounds=k)
    state = dec.step(dec.prefill(PROMPTS))
    assert not np.asarray(state.done).any()
    assert np.asarray(state.wait).tolist() == np.asarray(state.skip).tolist() == [k] * len(PROMPTS)


def test_after_speculative_moves_the_estimate_and_sets_the_waits():
    """Greedy, threshold 2.5, fallback_rounds 2, every row at estimate 1 after a wait of 4: a row
    whose tree paid (a block of 6: 0.5 * 1 + 0.5 * 6 = 3.5) drafts again with its wait reset to
    0; one that did not (a block of 1) waits twice its last wait; a done row keeps its estimate
    and its wait."""
    b = 3
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    fields = {f.name: None for f in dataclasses.fields(engine.DecodeState)}
    before = engine.DecodeState(**{**fields, "done": jnp.asarray([False, False, True]), "block_total": i32([0] * b),
                                   "expected_block": jnp.ones(b, jnp.float32), "skip": i32([0] * b),
                                   "wait": i32([4] * b)})
    after = dataclasses.replace(before, block_total=i32([6, 1, 0]))
    cfg = DecodeConfig(fallback_below=2.5, fallback_rounds=2)
    got = engine._after_speculative(before, after, None, None, cfg)
    np.testing.assert_allclose(np.asarray(got.expected_block), [3.5, 1.0, 1.0])
    assert np.asarray(got.wait).tolist() == [0, 8, 4] and np.asarray(got.skip).tolist() == [0, 8, 0]


def test_a_budget_past_the_draft_vocabulary_builds_the_whole_tree():
    """Each depth offers at most Vd tokens: with Vd = 3, G = 2 and a budget of 20 the tree holds
    all 3 + 9 paths (and padding), each depth-1 node with the 3 tokens below it."""
    logits = jax.random.normal(jax.random.key(0), (2, 2, 3))
    trees = engine.draft_trees(logits, jnp.asarray([5, 6]), 20)
    valid, parents, tokens = (np.asarray(x) for x in (trees.valid, trees.parents, trees.tokens))
    assert valid.sum(axis=1).tolist() == [13, 13] and tokens[:, 0].tolist() == [5, 6]
    for row in range(2):
        for node in [0] + [v for v in range(21) if valid[row, v] and parents[row, v] == 0]:
            kids = [v for v in range(21) if valid[row, v] and parents[row, v] == node]
            assert sorted(tokens[row, kids].tolist()) == [0, 1, 2]


def test_merge_lookups_matches_the_text_up_to_the_root():
    """The context chain continues the latest earlier match of the text's end, root included:
    history 1 2 3 4 1 2 3 (root 3 at slot cache_len = 6) proposes 4 1 2 3, which a near-certain
    survival table puts in the merged tree as a path from the root."""
    v, budget, g = 8, 6, 3
    cfg = DecodeConfig(budget=budget, lookup=4, lookup_survival=((0.999, 0.998),) * 5)
    history = jnp.asarray([[1, 2, 3, 4, 1, 2, 3, 0, 0, 0]], jnp.int32)
    root = jnp.asarray([3], jnp.int32)
    trees, scores = engine.draft_trees(jnp.zeros((1, g, v)), root, budget, with_scores=True)
    merged = engine.merge_lookups(trees, scores, history, jnp.asarray([6], jnp.int32), None, cfg)
    tokens, parents = np.asarray(merged.tokens)[0], np.asarray(merged.parents)[0]
    node = 0
    for token in (4, 1, 2, 3):
        children = [c for c in range(budget + 1) if parents[c] == node and tokens[c] == token]
        assert children, f"no child {token} under node {node}: {tokens.tolist()} {parents.tolist()}"
        node = children[0]


def test_prompt_lengths_share_one_compilation_per_bucket(models):
    dec = _decoder(models, "tev", max_new_tokens=6, capacity=None)
    # Programs compiled before (Decoders with equal statics share them) are not counted.
    loops, chunks = dec._loop._cache_size(), dec._prefill_chunk._cache_size()
    for prompt in ([1, 2], [1, 2, 3, 4, 5], [3] * 9, [4] * 15):  # all within one 16-token bucket
        dec.generate([prompt])
    assert dec._loop._cache_size() - loops <= 1
    assert len(dec._empty_fns) == 1 and dec._prefill_chunk._cache_size() - chunks <= 1
    loops, chunks = dec._loop._cache_size(), dec._prefill_chunk._cache_size()
    dec.generate([[5] * 20])  # the next prompt bucket: one more prefill chunk shape (32 tokens), not
    # one per prompt; the loop's shapes depend on the capacity only
    assert dec._prefill_chunk._cache_size() - chunks <= 1 and dec._loop._cache_size() == loops


@pytest.mark.parametrize("verifier", [AR, "tev"])
def test_kept_hidden_states_equal_one_forward_over_the_text(models, verifier):
    """`hidden_layers` returns, for every committed token but the last, the target's tapped hidden
    states: what one causal forward over prompt + output computes (the last layer final-normed)."""
    from tevjax.models.dflash import tapped_hidden

    target, _ = models
    layers = (0, 1)  # tiny_config has 2 layers: layer 1 is the last one (read final-normed)
    gens = _decoder(models, verifier, hidden_layers=layers).generate(PROMPTS)
    plain = _decoder(models, verifier).generate(PROMPTS)
    for prompt, g, p in zip(PROMPTS, gens, plain):
        assert g.tokens == p.tokens and p.hidden is None
        text = prompt + g.tokens[:-1]
        t = len(text)
        out = target(jnp.asarray([text]), jnp.arange(t)[None], KVCache.init(target.cfg, 1, t),
                     jnp.zeros((1,), jnp.int32), causal_mask(t)[None], hidden_layers=layers, compute_logits=False)
        ref = np.asarray(tapped_hidden(out, layers, target.cfg.num_layers)[0])
        assert g.hidden.shape == ref.shape == (t, 2, target.cfg.hidden_size)
        np.testing.assert_allclose(g.hidden, ref, atol=3e-5, rtol=1e-5)
    # Continuous batching keeps them too, for rows refilled mid-run.
    flowing = _decoder(models, verifier, hidden_layers=layers).generate_continuous(PROMPTS, 2)
    for g, f in zip(gens, flowing):
        assert f.tokens == g.tokens
        np.testing.assert_allclose(f.hidden, g.hidden, atol=3e-5, rtol=1e-5)  # other batch shapes: last bits


def test_hidden_layers_are_checked():
    with pytest.raises(ValueError, match="hidden_layers"):
        DecodeConfig(hidden_layers=(1, 1))
    with pytest.raises(ValueError, match="hidden_layers"):
        DecodeConfig(hidden_layers=(-1,))


def test_prompt_and_config_types_are_checked(models):
    dec = _decoder(models, AR)
    for prompts, match in (([1, 2, 3], "pass \\[ids\\]"), (["hello"], "must be a list of token ids"),
                           ([[1.0, 2.5]], "token ids must be integers"), ("hello", "list of token-id lists"),
                           ([[1, True]], "token ids must be integers")):
        with pytest.raises(TypeError, match=match):
            dec.generate(prompts)
    with pytest.raises(TypeError, match="temperature must be a number"):
        DecodeConfig(temperature="0.5")
    with pytest.raises(TypeError, match="budget must be an int"):
        DecodeConfig(budget=2.5)
    # eos_ids: checked before a generation that would otherwise run and then fail or not stop.
    for eos in (2, None, ("19",), (19.7,), (True,), (-1,)):
        with pytest.raises(TypeError, match="DecodeConfig.eos_ids must be a tuple of token ids >= 0"):
            DecodeConfig(eos_ids=eos)
    assert DecodeConfig(eos_ids=[2, np.int64(3)]).eos_ids == (2, 3)  # a list is kept as a (hashable) tuple
    target, drafter = models
    v = target.cfg.vocab_size
    with pytest.raises(ValueError, match=rf"eos_ids \(2, {v}\) holds ids outside the target's vocabulary \[0, {v}\)"):
        Decoder(target, drafter, DecodeConfig(eos_ids=(2, v)))
    for args, message in (((None, None, DecodeConfig()), "target must be a Transformer, got NoneType"),
                          ((target, target, DecodeConfig()), "drafter must be a DFlashDrafter or None, got Transformer"),
                          ((target, None, {"budget": 4}), "cfg must be a DecodeConfig, got dict")):
        with pytest.raises(TypeError, match=f"Decoder: {message}"):
            Decoder(*args)
    assert dec.generate([np.asarray([1, 5, 7], np.int64)])[0].tokens  # numpy ids are fine


def test_an_ngram_table_of_another_vocabulary_is_refused(models):
    """A corpus whose continuations are past the target's vocabulary would embed them (garbage, or
    NaN rows reported as damaged weights): the Decoder refuses it by name."""
    target, drafter = models
    v = target.cfg.vocab_size
    records = [[a, b, v + 5] for a in range(8) for b in range(8)] * 2
    table = ngram_table(np.array(sum(records, [])), np.arange(len(records) + 1) * 3, np.zeros(len(records), int),
                        orders=(2,))
    with pytest.raises(ValueError, match=f"proposes token {v + 5}, outside the target's vocabulary"):
        Decoder(target, drafter, DecodeConfig(budget=4, corpus=4, lookup=0, max_new_tokens=4), ngrams=table)


def test_nonfinite_logits_stop_the_row_and_emit_nothing(models):
    """A row whose target logits turn NaN (here: a corrupted embedding row) stops with stop
    "nonfinite" and no garbage tokens; the other rows of the batch are unaffected."""
    target, drafter = models
    poisoned = random_model(target.cfg, seed=0)
    emb = poisoned.embed_tokens.embedding
    emb.set_value(emb.get_value().at[17].set(jnp.nan))
    prompts = [[1, 5, 7], [1, 17, 3]]  # token 17 poisons row 1 from its first pass on
    for d in (None, drafter):
        dec = Decoder(poisoned, d, DecodeConfig(max_new_tokens=8, budget=4, prompt_bucket=16, capacity=64))
        gens = dec.generate(prompts)
        assert gens[1].stop == "nonfinite" and gens[1].tokens == []
        # Its one round was not committed: no round counted, and tau is 0, not 0 / 0; its state
        # still holds the prompt alone (cache_len, root and block total as prefill left them).
        assert (gens[1].rounds, gens[1].tau) == (0, 0.0)
        state = dec.run(dec.prefill(prompts))
        assert (int(state.cache_len[1]), int(state.root[1]), int(state.block_total[1])) == (2, 3, 0)
        # Row 0 beside a healthy row (the same batch shape, so no second compilation).
        assert gens[0].stop != "nonfinite" and gens[0].tokens == dec.generate(prompts[:1] * 2)[0].tokens
