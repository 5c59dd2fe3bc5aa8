"""The GPU profile read from conf/hardware/*.yaml: datasheet rates and cost-model coefficients."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from common.model_spec import ModelSpec
from common.parallel import ParallelConfig
from policies.base import check_settings

# the fields set from the ``parallel`` section -> their setting there
_PARALLEL_SETTINGS = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size"}
_EFFICIENCIES = ("matmul_efficiency", "mem_bw_efficiency", "attn_prefill_efficiency",
                 "attn_decode_efficiency", "allreduce_efficiency")


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One GPU type and how many of them serve the model (``tp`` x ``pp``: the ``parallel``
    section's sizes, never a profile's: ``from_dict`` takes them apart from the profile).

    The datasheet fields say what the chip can do; the efficiencies (fractions of those peaks)
    and the fixed times (microseconds) are the coefficients of ``simulator.cost_model``. A
    calibrated profile sets the same keys from measurements.
    """

    name: str
    peak_tflops: float  # dense bf16 tensor-core rate
    hbm_gib: float  # device memory as the driver reports it (nvidia-smi's total)
    hbm_tbps: float  # memory bandwidth, TB/s
    nvlink_gbps: float  # GPU-to-GPU bandwidth per direction, GB/s (PCIe where there is no NVLink)
    tp: int = 1  # tensor-parallel GPUs (parallel.tensor_parallel_size)
    pp: int = 1  # pipeline stages (parallel.pipeline_parallel_size)
    matmul_efficiency: float = 0.7
    mem_bw_efficiency: float = 0.8
    attn_prefill_efficiency: float = 0.45
    attn_decode_efficiency: float = 0.65
    allreduce_efficiency: float = 0.7
    roofline_exponent: float = 0.0  # matmuls: p-norm of the two bounds (0: their max; else >= 1)
    attn_seq_gbps: float = 0.0  # decode: rate one sequence's KV is read at (0: no such bound)
    num_sms: int = 132  # streaming multiprocessors (decode attention's key splits; H100/H200)
    kernel_launch_us: float = 5.0  # one eager kernel (launch-bound when the work is small)
    kernels_per_layer: int = 10
    mixed_kernels_per_layer: float = 0.0  # more in eager mixed prefill + decode steps
    graph_kernel_us: float = 1.0  # one kernel inside a CUDA graph (the GPU-side gap)
    cuda_graph_replay_us: float = 20.0
    cuda_graph_max_batch: int = 256  # decode batches above this run eagerly; 0: no CUDA graphs
    # prefill-only steps (<= 8 sequences) up to this many tokens replay a CUDA graph too
    # (schedlab's engine: 512; vLLM V0 runs every prefill eagerly: 0)
    prefill_graph_max_tokens: int = 0
    # other steps (mixed prefill + decode, larger prefills) up to this many tokens replay
    # piecewise graphs: L + 1 graphs between attentions, each layer's attention launched eagerly
    # (schedlab's engine: 2048; vLLM V0: 0)
    piecewise_graph_max_tokens: int = 0
    # eager kernels a layer launches between the pieces (schedlab's engine): the KV write, the
    # attention and the copy into the pieces' buffer; with prefill and decode rows both, the
    # other attention and the concatenation of the two besides
    piecewise_eager_kernels_per_layer: float = 3.0
    piecewise_mixed_kernels_per_layer: float = 2.0
    # launched per layer besides, in an eager or piecewise step whose decode attention splits its
    # keys (few decoding sequences): the merge of the splits (schedlab's engine: 1; 0: none).
    # The operator-table profile (op_tables) issues its steps from measured host times and
    # reads none of these counts.
    decode_split_kernels_per_layer: float = 0.0
    advance_step_us: float = 15.0  # multi-step: the advance_step kernel before steps 2..k
    sampler_us: float = 50.0
    sampler_bytes_per_logit: float = 12.0  # fp32 logits written, read by softmax, read by argmax
    allreduce_latency_us: float = 10.0
    p2p_latency_us: float = 10.0  # pipeline send/recv between stages
    activation_reserve_gib: float = 2.0  # peak activations, CUDA graphs, NCCL and CUDA context
    # the power-limited SM clock (simulator.clock): compute-bound work slows by
    # 1 + clock_power_slowdown * u + clock_heat_slowdown * heat; 0 and 0: off
    clock_power_slowdown: float = 0.0
    clock_heat_slowdown: float = 0.0
    clock_tau_s: float = 10.0  # how fast the heat follows the load
    # operator tables (simulator.op_cost): a directory of benchmarks/operators.py's CSVs, relative
    # to conf/ or absolute; set, it prices every step from them and the efficiencies, rates and
    # fixed times above are unused (tp > 1 keeps the all-reduce terms)
    op_tables: str = ""
    op_kernel_factor: float = 1.0  # served kernels' time over the tables' isolated time
    # served compute-bound kernels' slowdown over the tables' (the power-limited clock under
    # sustained load: the tables' points ran in short bursts at the full clock)
    op_compute_factor: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.op_tables, str):
            raise ValueError(f"hardware.op_tables must be a directory name, got {self.op_tables!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("name", "op_tables") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                     or value != value):
                raise ValueError(f"hardware.{f.name} must be a number, got {value!r}")
        for name in ("peak_tflops", "hbm_gib", "hbm_tbps", "nvlink_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware.{name} must be > 0, got {getattr(self, name)}")
        for name in ("tp", "pp", "kernels_per_layer", "num_sms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"hardware.{name} must be an integer >= 1, got {value!r}")
        for name in _EFFICIENCIES:
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"hardware.{name} must be in (0, 1], got {getattr(self, name)}")
        if self.roofline_exponent != 0.0 and not self.roofline_exponent >= 1.0:
            raise ValueError("hardware.roofline_exponent must be 0 (the plain max) or >= 1, got "
                             f"{self.roofline_exponent}")
        for name in ("attn_seq_gbps", "kernel_launch_us", "graph_kernel_us", "cuda_graph_replay_us",
                     "advance_step_us", "sampler_us", "sampler_bytes_per_logit",
                     "allreduce_latency_us", "p2p_latency_us", "activation_reserve_gib",
                     "clock_power_slowdown", "clock_heat_slowdown",
                     "mixed_kernels_per_layer", "piecewise_eager_kernels_per_layer",
                     "piecewise_mixed_kernels_per_layer", "decode_split_kernels_per_layer"):
            if getattr(self, name) < 0:
                raise ValueError(f"hardware.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("op_kernel_factor", "op_compute_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware.{name} must be > 0, got {getattr(self, name)}")
        if not self.clock_tau_s > 0:
            raise ValueError(f"hardware.clock_tau_s must be > 0, got {self.clock_tau_s}")
        for name in ("cuda_graph_max_batch", "prefill_graph_max_tokens",
                     "piecewise_graph_max_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"hardware.{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_dict(cls, d: dict[str, Any], parallel: ParallelConfig | None = None) -> HardwareSpec:
        """A GPU profile (conf/hardware/*.yaml) serving the model on ``parallel``'s GPUs."""
        for old, new in _PARALLEL_SETTINGS.items():
            if old in d:  # a profile describes one GPU; how many serve is the run's choice
                raise ValueError(f"hardware.{old} is no longer a hardware setting: set "
                                 f"parallel.{new} instead")
        check_settings("hardware", d, (f.name for f in fields(cls) if f.name not in
                                       _PARALLEL_SETTINGS))
        parallel = parallel or ParallelConfig()
        return cls(**d, tp=parallel.tensor_parallel_size, pp=parallel.pipeline_parallel_size)

    @property
    def profile(self) -> dict[str, Any]:
        """The settings a profile file holds (every field but the GPU count)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in _PARALLEL_SETTINGS}

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12

    @property
    def link_bytes_per_s(self) -> float:
        return self.nvlink_gbps * 1e9


def check_parallelism(model: ModelSpec, hw: HardwareSpec) -> None:
    """Raise a one-line error when ``tp``/``pp`` cannot split ``model`` (vLLM's rules)."""
    ParallelConfig(hw.tp, hw.pp).check_model(model)


def layers_per_stage(model: ModelSpec, pp: int) -> int:
    """Layers of the largest pipeline stage."""
    return -(-model.num_layers // pp)
