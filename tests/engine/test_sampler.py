"""Sampler arithmetic on synthetic logits: filters, penalties and logprobs, exactly."""
import torch

from meshserve.layers.sampler import PenaltyState, Sampler, _penalize
from meshserve.sampling_params import SamplingParams

LOGITS = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])


def draw(params, logits=LOGITS, n=400, histories=None):
    s = Sampler(seed=0)
    counts = torch.zeros(logits.shape[1])
    for i in range(n):
        out = s(logits, [i], [params], [0], histories)
        counts[out.token_ids[0]] += 1
    return counts


def test_top_k_top_p_min_p_restrict_the_support():
    assert draw(SamplingParams(temperature=1.0, top_k=2))[2:].sum() == 0
    # softmax of [4,3,2,1,0] = .636 .234 .086 .032 .012: top_p 0.8 keeps the first two
    assert draw(SamplingParams(temperature=1.0, top_p=0.8))[2:].sum() == 0
    assert draw(SamplingParams(temperature=1.0, top_p=0.9))[:3].sum() == 400
    # min_p 0.1 keeps tokens with p >= 0.0636: the first three
    c = draw(SamplingParams(temperature=1.0, min_p=0.1))
    assert c[3:].sum() == 0 and c[2] > 0


def test_sampling_follows_the_distribution():
    c = draw(SamplingParams(temperature=1.0), n=2000)
    p = torch.softmax(LOGITS[0], 0)
    assert torch.allclose(c / 2000, p, atol=0.04)
    hot = draw(SamplingParams(temperature=100.0), n=2000)
    assert hot.min() > 300  # near uniform


def _state(prompt, output, vocab=5):
    st = PenaltyState(torch.device("cpu"))
    st.load({0: (prompt, output)}, vocab)
    return st.batch([0], vocab)


def test_penalties():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, -1.0]])
    counts, seen = _state([4], [0, 0, 1])  # prompt has token 4; output has token 0 twice and token 1 once

    def penalized(**kw):
        return _penalize(logits.clone(), [SamplingParams(**kw)], counts, seen)[0].tolist()

    assert penalized(presence_penalty=1.5) == [2.5, 1.5, 2.0, 1.0, -1.0]
    assert penalized(frequency_penalty=0.5) == [3.0, 2.5, 2.0, 1.0, -1.0]
    # repetition: seen positive logits divided, seen negative ones multiplied (prompt tokens count)
    assert penalized(repetition_penalty=2.0) == [2.0, 1.5, 2.0, 1.0, -2.0]
    hist = [([4], [0, 0, 1])]
    close = torch.tensor([[3.5, 3.0, 2.0, 1.0, -1.0]])
    assert Sampler()(close, [0], [SamplingParams(temperature=0)], [0], hist).token_ids == [0]
    assert Sampler()(close, [0], [SamplingParams(temperature=0, presence_penalty=2.0)], [0], hist).token_ids == [2]


def test_penalty_state_follows_the_sampled_tokens_without_resending_history():
    """The history goes to the sampler once; every token it samples afterwards is counted there."""
    s = Sampler()
    p = SamplingParams(temperature=0, frequency_penalty=2.0)
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, 0.0]])
    picks = [s(logits, [7], [p], [0], [([4], [])] if i == 0 else None).token_ids[0] for i in range(4)]
    # 0 (3.0) -> 1 (2.5 vs 3-2=1) -> 2 (2.0 vs 1, 0.5) -> 0 (3-2=1 vs 0.5, 0, ... ) ties broken low
    assert picks == [0, 1, 2, 0]
    s.forget([7])
    assert not s.penalties.counts


def test_logprobs_are_raw_log_softmax_with_top_n():
    s = Sampler()
    out = s(LOGITS, [0], [SamplingParams(temperature=0, logprobs=2)], [0])
    ref = torch.log_softmax(LOGITS[0], 0)
    chosen, top = out.logprobs[0]
    assert out.token_ids == [0] and abs(chosen - ref[0].item()) < 1e-6
    assert [t for t, _ in top] == [0, 1] and abs(top[1][1] - ref[1].item()) < 1e-6
    assert s(LOGITS, [0], [SamplingParams(temperature=0)], [0]).logprobs == [None]


def test_rows_without_penalties_share_a_batch_with_penalized_rows():
    """A penalized request batched with plain ones: plain rows carry no history and are unchanged."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, -1.0]] * 2)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, presence_penalty=2.0)]
    s = Sampler()
    assert s(logits, [0, 1], params, [0, 0], [None, ([4], [0, 0, 1])]).token_ids == [0, 0]
    counts, seen = s.penalties.batch([0, 1], 5)
    assert counts[0].sum() == 0 and not seen[0].any()  # the plain row has no state
    out = _penalize(logits.clone(), params, counts, seen)
    assert out[0].tolist() == logits[0].tolist()
    assert out[1].tolist() == [2.0, 1.0, 2.0, 1.0, -1.0]


def test_inverse_cdf_draw_never_lands_on_a_zero_probability_token(monkeypatch):
    s = Sampler(seed=0)
    probs = torch.tensor([[0.0, 0.0, 0.25, 0.0, 0.75, 0.0]] * 4)
    edges = torch.tensor([[0.0], [0.25 - 1e-12], [0.25], [1.0 - 1e-12]], dtype=torch.float64)
    monkeypatch.setattr(s, "_uniforms", lambda b, *args: edges)
    greedy_free = [SamplingParams(temperature=1.0)] * 4
    assert s._draw(probs, [0, 1, 2, 3], greedy_free, [0] * 4).tolist() == [2, 2, 4, 4]


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_batch():
    logits = torch.zeros(3, 50)  # uniform: every draw is the noise's alone
    seeded = SamplingParams(temperature=1.0, seed=7)
    lone, shared = Sampler(seed=1), Sampler(seed=2)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    alone = [lone(logits[:1], [5], [seeded], [7]).token_ids[0] for _ in range(6)]
    crowd = [shared(logits, [5, 6, 8], [seeded, *others], [7, 0, 0]).token_ids for _ in range(6)]
    assert [row[0] for row in crowd] == alone and len(set(alone)) > 1
    assert all(row[2] == 0 for row in crowd)  # the greedy row: the first of equal logits
