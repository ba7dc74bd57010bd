"""How much of a GPU the KV cache may take, as arithmetic on measured numbers.

At start-up each CUDA rank loads its weights, runs the worst steps the scheduler may build
(`profile_steps`) on a one-block dummy cache, and measures: the weights, the activation peak of
those steps (sampler temporaries and logprobs included), the memory that is not PyTorch's (CUDA
context, cuBLAS and NCCL buffers, Triton modules, other processes on the device: device used
minus torch reserved), and the activations of a decode step at the largest CUDA graph batch,
which the graphs' private memory pool will hold on top of everything else. `plan_kv_cache` gives
the KV cache what is left of gpu_memory_utilization x memory. None of this touches the device, so
it is tested on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshserve.sampling_params import MAX_LOGPROBS, SamplingParams
from meshserve.worker.step import SeqStep, StepInput

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceMemoryProfile:
    total_bytes: int
    weights_bytes: int
    activation_peak_bytes: int  # peak of the profiled steps above the weights
    non_torch_bytes: int  # device memory in use that PyTorch's allocator does not hold
    cuda_graph_bytes: int = 0  # decode activations at the largest captured batch; 0 when eager
    allocator_slack_bytes: int = 0  # reserved but unallocated at the profiled peak (fragmentation)


@dataclass(frozen=True)
class KVCacheBudget:
    profile: DeviceMemoryProfile
    utilization: float
    block_bytes: int
    spare_blocks: int  # blocks allocated beyond those the scheduler may hand out (CUDA graph padding)

    @property
    def usable_bytes(self) -> int:
        return int(self.profile.total_bytes * self.utilization)

    @property
    def reserve_bytes(self) -> int:
        return self.profile.cuda_graph_bytes + self.profile.allocator_slack_bytes + self.spare_blocks * self.block_bytes

    @property
    def kv_bytes(self) -> int:
        p = self.profile
        return (self.usable_bytes - p.weights_bytes - p.activation_peak_bytes - p.non_torch_bytes
                - self.reserve_bytes)

    @property
    def num_blocks(self) -> int:
        return max(0, self.kv_bytes // self.block_bytes)

    def describe(self) -> str:
        p = self.profile

        def gib(n: int) -> str:
            return f"{n / GIB:.2f}"

        return (f"GPU memory (GiB): {gib(p.total_bytes)} total x {self.utilization:g} = {gib(self.usable_bytes)}"
                f" usable; weights {gib(p.weights_bytes)}, activation peak {gib(p.activation_peak_bytes)}, "
                f"non-torch {gib(p.non_torch_bytes)}, reserve {gib(self.reserve_bytes)} (CUDA graphs "
                f"{gib(p.cuda_graph_bytes)}, allocator slack {gib(p.allocator_slack_bytes)}, padding blocks "
                f"{self.spare_blocks}); KV cache {gib(max(0, self.kv_bytes))} = {self.num_blocks} blocks")


def plan_kv_cache(profile: DeviceMemoryProfile, utilization: float, block_bytes: int,
                  spare_blocks: int = 0) -> KVCacheBudget:
    budget = KVCacheBudget(profile, utilization, block_bytes, spare_blocks)
    if budget.num_blocks == 0:
        raise ValueError(f"no room for a KV cache: {budget.describe()}. Raise gpu_memory_utilization, lower "
                         "max_num_batched_tokens or max_num_seqs (smaller profiled steps), or use more devices")
    return budget


def profile_steps(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                  block_size: int) -> list[StepInput]:
    """The steps whose memory the scheduler's limits bound:
    1. the largest prefill: max_num_batched_tokens new tokens (in prompts of at most max_model_len),
       each chunk after a cached prefix that fills the context;
    2. the largest decode batch: min(max_num_seqs, max_num_batched_tokens) sequences at full context,
       one of them a prefill chunk taking the rest of the token budget.
    Every sequence samples, with every sampler feature on and the most logprobs a request may ask.
    All slots and block tables name block 0: the dummy cache has one block."""
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, logprobs=MAX_LOGPROBS,
                            presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
    # One shared list: the sampler's penalty indices at full length.
    history: tuple[list[int], list[int]] = ([0] * (max_model_len - 1), [])
    table = [0] * -(-max_model_len // block_size)

    def seq(seq_id: int, num_new: int) -> SeqStep:
        return SeqStep(seq_id, [0] * num_new, max_model_len - num_new, table, True, params, seq_id, history)

    prefill_lens = [min(max_model_len, max_num_batched_tokens - done)
                    for done in range(0, max_num_batched_tokens, max_model_len)]
    largest_prefill = StepInput([seq(i, n) for i, n in enumerate(prefill_lens)])
    rows = min(max_num_seqs, max_num_batched_tokens)
    chunk = min(max_model_len, max_num_batched_tokens - (rows - 1))
    largest_decode = StepInput([seq(i, 1) for i in range(rows - 1)] + [seq(rows - 1, chunk)])
    return [largest_prefill, largest_decode]


def decode_step(batch: int, max_model_len: int, block_size: int) -> StepInput:
    """`batch` decodes at full context, without sampling: what one captured CUDA graph runs."""
    table = [0] * -(-max_model_len // block_size)
    return StepInput([SeqStep(i, [0], max_model_len - 1, table, False) for i in range(batch)])
