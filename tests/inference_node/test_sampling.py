"""The sampler's processors against hand-computed values, its reproducibility, and the stop strings'
streaming against the non-streamed answer (hypothesis)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_node.sampling import (
    Sampled,
    Sampler,
    SamplingParams,
    StopStrings,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    cut_at_stop,
    sampling_scores,
)

pytestmark = pytest.mark.unit

NEG_INF = float("-inf")


def t64(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def draws(params: SamplingParams, logits: torch.Tensor, n: int, seed_offset: int = 0) -> list[int]:
    s = Sampler(params, [], seed_offset)
    return [s.sample(logits).token_id for _ in range(n)]


# --------------------------------------------------------------------------- processors, exact values


def test_logit_bias_adds_to_the_raw_logits() -> None:
    out = apply_logit_bias(t64(1, 2, 3, 4), [(0, 0.5), (3, -2.0)])
    assert out.tolist() == [1.5, 2, 3, 2]


def test_penalties_exact_arithmetic_and_order() -> None:
    # prompt {1, 2}, output counts {0: 2, 3: 1}: repetition over 0..3, frequency and presence over 0, 3.
    raw = t64(2, -1, 0, 4, 1)
    out = apply_penalties(raw, {1, 2}, {0: 2, 3: 1}, repetition_penalty=2.0, frequency_penalty=0.5,
                          presence_penalty=0.25)
    # repetition: 2/2=1, -1*2=-2, 0*2=0, 4/2=2; frequency: 1-0.5*2=0, 2-0.5*1=1.5; presence: -0.25, 1.25.
    assert out.tolist() == [-0.25, -2, 0, 1.25, 1]
    # Each alone.
    assert apply_penalties(raw, {1, 2}, {0: 2, 3: 1}, repetition_penalty=2.0).tolist() == [1, -2, 0, 2, 1]
    assert apply_penalties(raw, {1, 2}, {0: 2, 3: 1}, frequency_penalty=0.5).tolist() == [1, -1, 0, 3.5, 1]
    assert apply_penalties(raw, {1, 2}, {0: 2, 3: 1}, presence_penalty=0.25).tolist() == [1.75, -1, 0, 3.75, 1]
    # Frequency and presence only see the output: the prompt's tokens 1, 2 are untouched.
    assert apply_penalties(raw, {1, 2}, {}, frequency_penalty=1.0, presence_penalty=1.0).tolist() == raw.tolist()
    # Ids outside the vocabulary are ignored; -inf stays -inf.
    out = apply_penalties(t64(NEG_INF, 1), {0, 7, -1}, {9: 1}, repetition_penalty=2.0, frequency_penalty=1.0)
    assert out.tolist() == [NEG_INF, 1]


def test_sampler_keeps_the_prompt_and_output_for_the_penalties() -> None:
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    s = Sampler(p, [1, 2])
    for forced in (0, 0, 3):
        onehot = torch.zeros(5)
        onehot[forced] = 1000.0
        assert s.sample(onehot).token_id == forced
    assert s.output_ids == [0, 0, 3]
    assert s.processed_logits(t64(2, -1, 0, 4, 1)).tolist() == [-0.25, -2, 0, 1.25, 1]


def test_bias_comes_before_the_penalties() -> None:
    # Token 0: raw -1, bias +2 -> 1 > 0, so repetition divides: 0.5 (penalty first: -1*2 + 2 = 0).
    s = Sampler(SamplingParams(repetition_penalty=2.0, logit_bias=((0, 2.0),)), [0])
    assert s.processed_logits(t64(-1, 0)).tolist() == [0.5, 0]


def test_temperature_shifts_by_the_max_first() -> None:
    assert apply_temperature(t64(1, 2, 4), 0.5).tolist() == [-6, -4, 0]
    assert apply_temperature(t64(1, NEG_INF, 4), 2.0).tolist() == [-1.5, NEG_INF, 0]
    for tiny in (1e-300, 5e-324):
        z = apply_temperature(t64(1, 2, 4, 4), tiny)
        assert not torch.isnan(z).any()
        assert z.tolist()[2:] == [0, 0]
        assert (z[:2] < -1e300).all()
    # A +inf logit takes all the mass, no nan.
    assert apply_temperature(t64(1, math.inf, 3), 1.0).tolist() == [NEG_INF, 0, NEG_INF]


def test_min_p_drops_below_a_fraction_of_the_best() -> None:
    scores = t64(0, -math.log(2), -math.log(4), -math.log(10))  # probabilities 1 : 1/2 : 1/4 : 1/10
    assert apply_min_p(scores, 0.3).tolist() == [0, -math.log(2), NEG_INF, NEG_INF]
    assert apply_min_p(scores, 0.2).tolist() == [0, -math.log(2), -math.log(4), NEG_INF]
    assert apply_min_p(scores, 0.0).tolist() == scores.tolist()
    assert apply_min_p(scores, 1.0).tolist() == [0, NEG_INF, NEG_INF, NEG_INF]


def test_top_k_keeps_k_ties_by_lowest_id() -> None:
    x = t64(1, 3, 3, 2, 3)
    assert apply_top_k(x, 1).tolist() == [NEG_INF, 3, NEG_INF, NEG_INF, NEG_INF]
    assert apply_top_k(x, 2).tolist() == [NEG_INF, 3, 3, NEG_INF, NEG_INF]
    assert apply_top_k(x, 4).tolist() == [NEG_INF, 3, 3, 2, 3]
    for off in (0, -1, 5, 99):
        assert apply_top_k(x, off).tolist() == x.tolist()


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    uniform = torch.zeros(4, dtype=torch.float64)  # 0.25 each, exactly
    assert apply_top_p(uniform, 0.5).tolist() == [0, 0, NEG_INF, NEG_INF]  # mass exactly 0.5 suffices
    assert apply_top_p(uniform, 0.6).tolist() == [0, 0, 0, NEG_INF]
    assert apply_top_p(uniform, 1e-9).tolist() == [0, NEG_INF, NEG_INF, NEG_INF]  # at least one
    assert apply_top_p(uniform, 0.0).tolist() == [0, NEG_INF, NEG_INF, NEG_INF]  # top_p 0: the best only
    assert apply_top_p(uniform, 1.0).tolist() == [0, 0, 0, 0]
    halves = t64(-math.log(8), 0, -math.log(4), -math.log(2))  # ~ 1/15 * (1, 8, 2, 4)
    assert apply_top_p(halves, 0.4).tolist() == [NEG_INF, 0, NEG_INF, NEG_INF]
    assert apply_top_p(halves, 0.7).tolist() == [NEG_INF, 0, NEG_INF, -math.log(2)]
    assert apply_top_p(halves, 0.9).tolist() == [NEG_INF, 0, -math.log(4), -math.log(2)]
    # -inf tokens never count.
    assert apply_top_p(t64(0, NEG_INF, 0), 0.9).tolist() == [0, NEG_INF, 0]


def test_top_p_on_a_large_vocabulary_matches_a_full_sort() -> None:
    g = torch.Generator().manual_seed(0)
    for scale in (0.5, 4.0, 16.0):
        x = torch.round(torch.randn(50_000, generator=g, dtype=torch.float64) * scale * 4) / 4  # with ties
        order = torch.sort(x, descending=True, stable=True).indices  # the full ranking
        ranked = torch.softmax(x, dim=-1)[order]
        before = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(ranked, dim=-1)[:-1]])
        for p in (0.05, 0.5, 0.95, 0.9999):
            keep = before < p
            keep[0] = True
            expected = torch.full_like(x, NEG_INF)
            expected[order[keep]] = x[order[keep]]
            assert torch.equal(apply_top_p(x, p), expected)


def test_top_p_applies_to_the_top_k_distribution() -> None:
    # top_k=2 leaves two tokens at 0.5 each; top_p=0.6 then keeps both (over all four it would keep 3).
    z = sampling_scores(torch.zeros(4, dtype=torch.float64), SamplingParams(temperature=1.0, top_k=2, top_p=0.6))
    assert z.tolist() == [0, 0, NEG_INF, NEG_INF]
    # min_p, after the temperature: at T=1 the ratio 1/4 is kept by min_p=0.2, at T=0.5 it is 1/16.
    scores = t64(0, -math.log(4))
    assert torch.isfinite(sampling_scores(scores, SamplingParams(temperature=1.0, min_p=0.2))).all()
    assert sampling_scores(scores, SamplingParams(temperature=0.5, min_p=0.2)).tolist() == [0, NEG_INF]


# --------------------------------------------------------------------------- the sampler


def test_greedy_is_argmax_first_index_on_ties() -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        x = torch.randn(100, generator=g)
        assert Sampler(SamplingParams(), []).sample(x).token_id == int(torch.argmax(x))
    assert Sampler(SamplingParams(), []).sample(torch.tensor([1.0, 3.0, 3.0])).token_id == 1
    # With the processors on, still the argmax of the processed logits.
    s = Sampler(SamplingParams(logit_bias=((0, 2.5),)), [])
    assert s.sample(torch.tensor([1.0, 3.0, 3.0])).token_id == 0


def test_seeded_sampling_is_reproducible_and_the_offset_changes_it() -> None:
    x = torch.zeros(1000)  # flat: every draw is a fresh uniform pick
    p = SamplingParams(temperature=1.0, seed=1234)
    a = draws(p, x, 30)
    assert a == draws(p, x, 30)
    assert a != draws(p, x, 30, seed_offset=1)
    assert draws(p, x, 30, seed_offset=1) == draws(p, x, 30, seed_offset=1)
    assert a != draws(SamplingParams(temperature=1.0, seed=1235), x, 30)
    # (seed + offset) mod 2**64: seed 1234 at offset 1 is seed 1235; -1 is 2**64 - 1.
    assert draws(p, x, 30, seed_offset=1) == draws(SamplingParams(temperature=1.0, seed=1235), x, 30)
    assert draws(SamplingParams(temperature=1.0, seed=-1), x, 10) == draws(
        SamplingParams(temperature=1.0, seed=2**64 - 1), x, 10)
    assert draws(SamplingParams(temperature=1.0, seed=2**64 - 1), x, 5, seed_offset=1) == draws(
        SamplingParams(temperature=1.0, seed=0), x, 5)
    # Greedy takes no generator.
    assert Sampler(SamplingParams(seed=5), []).generator is None


def test_seeded_sampling_follows_the_distribution() -> None:
    probs = [0.5, 0.3, 0.2]
    x = torch.log(torch.tensor(probs))
    got = draws(SamplingParams(temperature=1.0, seed=7), x, 4000)
    for tok, p in enumerate(probs):
        assert abs(got.count(tok) / len(got) - p) < 0.03


def test_top_k_1_and_tiny_or_zero_top_p_and_tiny_temperature_are_greedy() -> None:
    g = torch.Generator().manual_seed(2)
    for i in range(20):
        x = torch.round(torch.randn(64, generator=g) * 2)  # ties at the max now and then
        best = int(torch.argmax(x))
        for p in (SamplingParams(temperature=1.0, top_k=1, seed=i),
                  SamplingParams(temperature=1.5, top_p=1e-6, seed=i),
                  SamplingParams(temperature=1.5, top_p=0.0, seed=i),  # OpenAI allows 0: the best only
                  SamplingParams(temperature=0.7, min_p=1.0, top_k=1, seed=i)):
            assert Sampler(p, []).sample(x).token_id == best


def test_tiny_temperature_samples_the_best_or_among_tied_best() -> None:
    x = torch.tensor([1.0, 5.0, 4.999, 5.0, -3.0])
    for t in (1e-300, 5e-324, 1e-8):
        got = set(draws(SamplingParams(temperature=t, seed=3), x, 200))
        assert got == {1, 3}
    assert set(draws(SamplingParams(temperature=1e-300, seed=3), torch.tensor([0.0, 2.0, 1.0]), 50)) == {1}


def test_logit_bias_forces_and_bans() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, generator=g)
    forced = SamplingParams(temperature=1.0, seed=0, logit_bias=((17, 100.0),))
    assert set(draws(forced, x, 100)) == {17}
    best = int(torch.argmax(x))
    banned = SamplingParams(temperature=1.0, seed=0, logit_bias=((best, -100.0),))
    assert best not in draws(banned, x, 500)
    assert Sampler(SamplingParams(logit_bias=((best, -100.0),)), []).sample(x).token_id != best
    assert Sampler(SamplingParams(logit_bias=((17, 100.0),)), []).sample(x).token_id == 17


def test_minus_inf_is_never_sampled_and_all_minus_inf_is_an_error() -> None:
    x = torch.tensor([NEG_INF, 0.0, NEG_INF, 0.0, NEG_INF])
    assert set(draws(SamplingParams(temperature=2.0, seed=0), x, 300)) == {1, 3}
    with pytest.raises(ValueError, match="no token"):
        Sampler(SamplingParams(temperature=1.0), []).sample(torch.full((4,), NEG_INF))


def test_logprobs_are_the_raw_distribution() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, generator=g, dtype=torch.float32)
    x[5] = x[6] = x.max() + 1  # a tie at the top
    ref = torch.log_softmax(x.double(), dim=-1)
    p = SamplingParams(temperature=0.6, top_k=3, repetition_penalty=1.5, frequency_penalty=1.0,
                       logit_bias=((9, 2.0),), logprobs=4, seed=11)
    s = Sampler(p, [5, 9])
    for _ in range(5):
        out = s.sample(x)
        assert out.logprob == ref[out.token_id].item()
        ids = [i for i, _ in out.top_logprobs]
        assert ids[:2] == [5, 6]  # the tie: lowest id first
        assert ids == sorted(range(40), key=lambda i: (-ref[i].item(), i))[:4]
        assert [lp for _, lp in out.top_logprobs] == [ref[i].item() for i in ids]
    zero = Sampler(SamplingParams(logprobs=0), []).sample(x)
    assert zero == Sampled(5, ref[5].item(), [])
    assert Sampler(SamplingParams(temperature=1.0), []).sample(x).logprob is None
    full = Sampler(SamplingParams(logprobs=40), []).sample(x)
    assert len(full.top_logprobs) == 40


def test_any_dtype_gives_the_float64_result() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, generator=g).to(torch.bfloat16)
    p = SamplingParams(temperature=0.9, top_p=0.8, seed=9, logprobs=2)
    assert [Sampler(p, []).sample(x) for _ in range(3)] == [Sampler(p, []).sample(x.double()) for _ in range(3)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_give_the_cpu_result() -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 32000, generator=g).half()
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=3),
              SamplingParams(repetition_penalty=1.3), SamplingParams(temperature=1.0, top_k=40, seed=2)]
    cpu = Sampler.sample_batch([Sampler(p, [1, 2, 3], i) for i, p in enumerate(params)], x)
    gpu = Sampler.sample_batch([Sampler(p, [1, 2, 3], i) for i, p in enumerate(params)], x.cuda())
    assert cpu == gpu
    assert [Sampler(p, [1, 2, 3], i).sample(x[i].cuda()) for i, p in enumerate(params)] == cpu


BATCH_PARAMS = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.3, presence_penalty=0.5),
    SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    SamplingParams(temperature=1.0, top_k=5, min_p=0.05, seed=2, logprobs=3),
    SamplingParams(temperature=1.0),  # unseeded: torch's default generator, in row order
    SamplingParams(logprobs=1),
    SamplingParams(),
]


@pytest.mark.parametrize("indices", [[0, 6], [0, 1, 2, 3, 4, 5, 6], [2, 0, 4, 6, 4], [3, 5]])
def test_sample_batch_equals_per_row(indices: list[int]) -> None:
    g = torch.Generator().manual_seed(7)
    steps = [torch.randn(len(indices), 200, generator=g) for _ in range(6)]
    results = []
    for batched in (True, False):
        torch.manual_seed(99)
        samplers = [Sampler(BATCH_PARAMS[i], [3, 4, 5], j) for j, i in enumerate(indices)]
        got: list[list[Sampled]] = []
        for logits in steps:
            if batched:
                got.append(Sampler.sample_batch(samplers, logits))
            else:
                got.append([s.sample(logits[j]) for j, s in enumerate(samplers)])
        results.append((got, [s.output_ids for s in samplers]))
    assert results[0] == results[1]


def test_sample_batch_checks_the_shape() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        Sampler.sample_batch([Sampler(SamplingParams(), [])], torch.zeros(2, 5))
    with pytest.raises(ValueError, match="1-D"):
        Sampler(SamplingParams(), []).sample(torch.zeros(1, 5))


@pytest.mark.parametrize(("kw", "name"), [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"logit_bias": ((100, 1.0),)}, "logit_bias"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
    ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
    ({"logit_bias": ((3, math.nan),)}, "logit_bias"),
    ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 101}, "logprobs"),
    ({"seed": 1.5}, "seed"),
])
def test_validate_names_the_parameter(kw: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name}"):
        SamplingParams(**kw).validate(100)  # type: ignore[arg-type]


def test_validate_accepts_the_edges() -> None:
    SamplingParams(temperature=1e-300, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2.0,
                   frequency_penalty=2.0, repetition_penalty=0.5, logit_bias=((0, -100.0), (99, 100.0)),
                   logprobs=100, seed=-(2**70)).validate(100)
    SamplingParams().validate(1)
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingParams().validate(0)


# --------------------------------------------------------------------------- stop strings


def stream(chunks: list[str], stops: list[str]) -> tuple[list[tuple[str, bool]], str, StopStrings]:
    ss = StopStrings(stops)
    text, results = "", []
    for c in chunks:
        text += c
        results.append(ss.feed(text))
    tail = ss.finish()
    return results, tail, ss


def test_stop_spanning_chunks_is_held_back_then_cut() -> None:
    results, tail, ss = stream(["Hello <", "/", "s> more"], ["</s>"])
    assert results == [("Hello ", False), ("", False), ("", True)]
    assert tail == ""
    assert ss.emitted == "Hello "


def test_held_back_text_is_released_when_it_cannot_be_a_stop() -> None:
    results, tail, ss = stream(["ab<", "/x", "y"], ["</s>"])
    assert results == [("ab", False), ("</x", False), ("y", False)]
    assert tail == ""
    results, tail, ss = stream(["abcEN"], ["END"])
    assert results == [("abc", False)]
    assert tail == "EN"
    assert ss.emitted == "abcEN"


def test_earliest_occurrence_wins() -> None:
    # Both in the same text: the one that starts first.
    assert stream(["abc"], ["bc", "ab"])[0] == [("", True)]
    assert cut_at_stop("abc", ["bc", "ab"]) == ("", True)
    # A longer stop that started earlier but is not complete when a shorter one completes: the text at
    # that moment holds only the shorter one, so it is cut there, streamed or not.
    assert stream(["xy", "z", "1"], ["xyz1", "z"])[0] == [("", False), ("xy", True), ("", True)]
    assert cut_at_stop("xyz", ["xyz1", "z"]) == ("xy", True)
    # The same stops in one chunk: the longer one is complete and starts first.
    assert stream(["xyz1"], ["xyz1", "z"])[0] == [("", True)]
    assert cut_at_stop("xyz1", ["xyz1", "z"]) == ("", True)


def test_no_stops_and_empty_stops() -> None:
    assert stream(["a", "b"], [])[0] == [("a", False), ("b", False)]
    assert stream(["a", "b"], ["", ""])[0] == [("a", False), ("b", False)]
    assert cut_at_stop("ab", [""]) == ("ab", False)


def test_after_a_stop_nothing_more() -> None:
    ss = StopStrings(["."])
    assert ss.feed("Hi. there") == ("Hi", True)
    assert ss.feed("Hi. there, more") == ("", True)
    assert ss.finish() == ""
    assert ss.emitted == "Hi"


def test_the_text_must_extend() -> None:
    ss = StopStrings(["STOP"])
    ss.feed("abcST")
    with pytest.raises(ValueError, match="extend"):
        ss.feed("abc")
    with pytest.raises(ValueError, match="extend"):
        ss.feed("abcXYZ")


def test_unicode() -> None:
    results, tail, ss = stream(["naïve ", "日本", "語。", "終"], ["語。終", "。終わり"])
    assert [r for r, _ in results] == ["naïve ", "日本", "", ""]
    assert results[-1][1]
    assert tail == ""
    assert ss.emitted == "naïve 日本"


ALPHABET = "ab\u00e9"


@settings(max_examples=600, deadline=None)
@given(chunks=st.lists(st.text(ALPHABET, max_size=4), max_size=10),
       stops=st.lists(st.text(ALPHABET, max_size=4), max_size=4))
def test_streaming_equals_the_cut_at_the_first_stop(chunks: list[str], stops: list[str]) -> None:
    texts = []
    text = ""
    for c in chunks:
        text += c
        texts.append(text)
    first = next((i for i, t in enumerate(texts) if cut_at_stop(t, stops)[1]), None)
    expected = cut_at_stop(texts[first], stops)[0] if first is not None else text

    ss = StopStrings(stops)
    real_stops = [s for s in stops if s]
    out = ""
    for i, t in enumerate(texts):
        delta, stopped = ss.feed(t)
        out += delta
        assert stopped == (first is not None and i >= first)  # stops at the first text holding a stop
        assert out == ss.emitted
        assert not any(s in out for s in real_stops)
        assert t.startswith(out)
        if not stopped:
            held = t[len(out):]
            # Held back: exactly the longest suffix that could begin a stop, no more.
            assert held == "" or any(s.startswith(held) and s != held for s in real_stops)
            for start in range(len(out)):  # no longer suffix could begin one
                assert not any(s.startswith(t[start:]) and s != t[start:] for s in real_stops)
        if i == first:
            assert out == expected
    tail = ss.finish()
    assert (tail == "") or first is None
    assert out + tail == expected == ss.emitted
    assert not any(s in expected for s in real_stops)
