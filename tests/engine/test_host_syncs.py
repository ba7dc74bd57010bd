"""What keeps a CUDA step free of host syncs, checked on CPU: the sampler never branches on a device
value, reads tokens and logprobs back once and copies its inputs a fixed number of times whatever
the batch; communication timing on CUDA records events and reads them only at the end of the step."""
import pytest
import torch

from meshserve.distributed.parallel_state import CommTimer
from meshserve.layers import host_to_device
from meshserve.layers import sampler as sampler_module
from meshserve.layers.sampler import Sampler
from meshserve.sampling_params import SamplingParams


@pytest.fixture
def host_reads(monkeypatch):
    """Fail on a device value used in a host branch; count tolist() reads and host-to-device copies."""
    counts = {"tolist": 0, "copies": 0}

    def no_host_branch(self, *a):
        raise AssertionError("a tensor was read on the host for a decision")

    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        counts["tolist"] += 1
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "__bool__", no_host_branch)
    monkeypatch.setattr(torch.Tensor, "item", no_host_branch)
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    for name in ("to_device", "arrays_to_device"):
        real = getattr(host_to_device, name)

        def counted(*a, _real=real, **k):
            counts["copies"] += 1
            return _real(*a, **k)

        monkeypatch.setattr(sampler_module, name, counted)
    return counts


@pytest.mark.parametrize("batch", [2, 16])
def test_sampler_reads_back_once_and_copies_a_fixed_number_of_times(host_reads, batch):
    kinds = [SamplingParams(temperature=0, logprobs=3),
             SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.01, seed=7, repetition_penalty=1.2),
             SamplingParams(temperature=1.0, presence_penalty=0.5, logprobs=1)]
    params = [kinds[i % 3] for i in range(batch)]
    histories = [([1, 2, 3], [4, 4]) if p.has_penalties else None for p in params]
    logits = torch.randn(batch, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler(seed=1)(logits, list(range(batch)), params, list(range(batch)), histories)
    assert len(out.token_ids) == batch and all(isinstance(t, int) for t in out.token_ids)
    assert out.token_ids[0] == int(logits[0].argmax())  # the greedy row
    chosen, top = out.logprobs[0]
    assert [t for t, _ in top] == logits[0].topk(3).indices.tolist() and chosen == top[0][1]
    assert host_reads["tolist"] == 1 + 1  # the sampler's one read, and the check just above
    assert host_reads["copies"] == 3  # row parameters, penalty parameters, penalty indices


def test_greedy_batch_without_logprobs_copies_nothing(host_reads):
    logits = torch.randn(4, 50)
    out = Sampler()(logits, [0, 1, 2, 3], [SamplingParams(temperature=0)] * 4, [0] * 4)
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs == [None] * 4
    assert host_reads["copies"] == 0


class FakeEvent:
    """torch.cuda.Event stand-in: a clock value set at record()."""
    clock = 0.0
    created = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        FakeEvent.created += 1
        self.time = None

    def record(self):
        self.time = FakeEvent.clock

    def synchronize(self):
        pass

    def elapsed_time(self, end):  # milliseconds, as CUDA reports them
        return (end.time - self.time) * 1e3


def test_cuda_comm_timing_reads_events_at_the_end_of_the_step(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.created = 0
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    timer = CommTimer(torch.device("cuda"))
    for _ in range(2):
        for duration in (0.25, 0.5):
            with timer.timed("all_reduce"):
                FakeEvent.clock += duration  # the collective runs on the device
            FakeEvent.clock += 1.0  # compute between collectives
        assert timer.seconds == {}  # nothing read while the step runs
        capturing[0] = True
        with timer.timed("all_reduce"):  # inside a CUDA graph capture: not timed
            FakeEvent.clock += 5.0
        capturing[0] = False
        assert timer.take() == {"all_reduce": pytest.approx(0.75)}
    assert FakeEvent.created == 4  # the second step reused the first step's events
    assert timer.take() == {}


def test_cpu_comm_timing_is_wall_time():
    timer = CommTimer()
    with timer.timed("send_recv"):
        pass
    with timer.timed("send_recv"):
        pass
    taken = timer.take()
    assert list(taken) == ["send_recv"] and 0 <= taken["send_recv"] < 0.1 and timer.take() == {}


def test_host_to_device_on_cpu_is_plain_tensors():
    t = host_to_device.to_device([[1, 2], [3, 4]], torch.long, torch.device("cpu"))
    assert t.dtype == torch.long and t.tolist() == [[1, 2], [3, 4]]
    a, b, c = host_to_device.arrays_to_device([[1], [], [2, 3]], torch.float32, torch.device("cpu"))
    assert a.tolist() == [1.0] and b.numel() == 0 and c.tolist() == [2.0, 3.0]
