"""Fill a sharded skeleton from a checkpoint, one tensor at a time.

The checkpoint is checked against the skeleton (every tensor present, every shape right, nothing
unexplained) before anything is read. Then each tensor is read into memory of its own (no long-lived
mapping of the file, see `weight_files`), moved to this rank's device, quantized there if its layer is
quantized, and only this rank's dim-0 slice is kept. Several threads read ahead of the tensor being stored,
within a fixed byte budget (`ReadOptions`), so the memory a load adds grows with the model's largest tensor
at most, not with its size.

One file per concern:
    weight_files   one safetensors (or legacy .bin) file, read tensor by tensor; safetensors written too
    expert_layout  older per-expert MoE layouts, shown under the fused names transformers 5 models expect
    model_dir      a model directory's checkpoint: its index, which file holds each tensor (`Checkpoint`)
    plan           which checkpoint tensor feeds which parameter shard, and how it is stored there
    read_ahead     the threaded read-ahead that streams the plan's tensors onto the device (`load_weights`)
    sources        weights from elsewhere: random values, or rank 0's files over the network
    hub            Hub ids (org/name@revision) resolved into the Hub cache, downloaded once per node
"""

from qshard.loading.model_dir import INDEX_FILE, SINGLE_FILE, WEIGHT_SUFFIXES, Checkpoint
from qshard.loading.plan import check_checkpoint, init_adapters, join_name, load_plan, module_sources
from qshard.loading.read_ahead import ReadOptions, load_weights
from qshard.loading.sources import BroadcastSource, RandomSource, model_files_from_rank0

__all__ = [
    "INDEX_FILE", "SINGLE_FILE", "WEIGHT_SUFFIXES", "BroadcastSource", "Checkpoint", "RandomSource", "ReadOptions",
    "check_checkpoint", "init_adapters", "join_name", "load_plan", "load_weights", "model_files_from_rank0",
    "module_sources",
]
