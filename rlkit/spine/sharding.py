"""Sharded training with FSDP2 (``torch.distributed.fsdp.fully_shard``) on Lightning's ModelParallelStrategy.

Every parameter, gradient and optimizer state is split over the data-parallel ranks (ZeRO-3, Rajbhandari
et al. 2020; PyTorch FSDP, Zhao et al. 2023): each decoder layer is one unit (its weights are gathered for its
forward and backward and freed after), then the model's root holds what is left (embeddings, final norm, LM
head). FSDP2 averages gradients over ranks as DDP does, so the step totals the aggregation divides by are the
same as under DDP and the update equals one process's. It runs on CPU (gloo) as well as on GPUs, which is why
it replaces FSDP1 (Lightning's ``FSDPStrategy``), which refuses a CPU and so could never be tested here.

:class:`FSDP2Strategy` sizes the mesh (data-parallel = world size, no tensor parallelism), chooses the mixed
precision (bf16 parameters with fp32 gradient reduction on GPU, fp32 on CPU) and refuses one process;
:func:`shard_family` is called by :meth:`~rlkit.spine.family.Family.configure_model`.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn

from rlkit.checkpointing import fsync_file, staging_path, swap_in
from rlkit.errors import ConfigError

#: names of the container of decoder layers in Hugging Face models (``model.layers`` in Llama/Qwen2,
#: ``transformer.h`` in GPT-2, ``blocks`` elsewhere)
LAYER_CONTAINERS = ("layers", "h", "blocks")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over every process of the run (``devices`` x ``num_nodes``), without tensor parallelism.

    Args:
        param_dtype: the dtype parameters are gathered in for forward and backward (``bfloat16``,
            ``float16``, ``float32``); ``auto``: ``bfloat16`` on GPU, the parameters' own dtype on CPU. The
            sharded parameters and the optimizer states stay in the parameters' own dtype.
        reduce_dtype: the dtype gradients are reduced in across ranks (``auto``: ``float32`` when
            ``param_dtype`` is lower, else the parameters' own).
        reshard_after_forward: free each layer's gathered weights after its forward (gather again for the
            backward: least memory); false keeps them until the backward (less communication).
        save_distributed_checkpoint: each rank writes its own shard (a checkpoint folder); false gathers
            the whole state on rank 0 into one file.
        process_group_backend: ``gloo`` (CPU), ``nccl`` (GPU); None: chosen by the device.
    """

    def __init__(
        self,
        param_dtype: str = "auto",
        reduce_dtype: str = "auto",
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
    ) -> None:
        for key, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value != "auto" and value not in DTYPES:
                raise ConfigError(
                    f"trainer.strategy.init_args.{key}={value!r} is not a dtype FSDP2 can use: choose auto, "
                    f"{', '.join(DTYPES)}"
                )
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
        )
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        check_launched_world(self.cluster_environment, self.num_nodes, self.num_processes)
        if world < 2:
            raise ConfigError(
                "FSDP2 shards the model over several processes but this run has one (trainer.devices=1, "
                "trainer.num_nodes=1): set trainer.devices to 2 or more, or use configs/trainer/cpu.yaml or "
                "single_gpu.yaml for one process"
            )
        self._data_parallel_size = world
        super().setup_environment()

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """A distributed checkpoint folder that is never torn: every rank writes its shard into a staging
        folder beside the target (``.<name>.partial``), rank 0 writes the metadata and syncs it, then swaps
        the folder in by renames (:func:`swap_in`). Lightning writes into the target itself, so a run killed
        while it overwrote ``last.ckpt`` left new shards beside old metadata."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        staging = staging_path(path)
        if self.global_rank == 0 and staging.exists():
            shutil.rmtree(staging)  # left by a run killed while writing
        self.barrier("rlkit-checkpoint-staging")
        super().save_checkpoint(checkpoint, staging, storage_options)
        self.barrier("rlkit-checkpoint-written")
        if self.global_rank == 0:
            fsync_file(staging / "meta.pt")
            swap_in(staging, path)
        self.barrier("rlkit-checkpoint-swapped")

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """A distributed checkpoint folder as Lightning reads it; a one-process checkpoint (one file) read
        here, so a run started on one process (or DDP) resumes sharded: each rank takes its shard of the
        whole weights and optimizer states. (Lightning's own reading of a file re-keys the optimizer states
        by the whole module's parameter order, which is wrong for a second optimizer and fails on an empty
        state, e.g. SGD without momentum.)"""
        path = Path(self.broadcast(str(checkpoint_path)))
        if not path.is_file():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=bool(weights_only))
        load_full_state(self.model, self.optimizers, checkpoint, strict=self.lightning_module.strict_loading)
        return checkpoint


def check_launched_world(environment, num_nodes: int, devices: int) -> None:
    """Refuse a run whose launcher (torchrun, SLURM's srun, ...) started another number of processes than
    ``trainer.num_nodes`` x ``trainer.devices``: Lightning takes the ranks from the launcher's environment
    but sizes the device mesh and the data shards by the trainer's settings (torchrun's world size is not
    checked against them), so a mismatch would hang or fail later in torch with no hint of the settings."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    if environment is None or isinstance(environment, LightningEnvironment):
        return  # processes started by Lightning itself: their number is the trainer's
    if not environment.creates_processes_externally:
        return
    started = environment.world_size()
    if started != num_nodes * devices:
        raise ConfigError(
            f"the launcher started {started} processes ({type(environment).__name__}) but trainer.num_nodes x "
            f"trainer.devices = {num_nodes} x {devices} = {num_nodes * devices}: set --trainer.num_nodes to the "
            "number of nodes and --trainer.devices to the processes per node (torchrun's --nnodes and "
            "--nproc-per-node, srun's --nodes and --ntasks-per-node)"
        )


def load_full_state(module: nn.Module, optimizers, checkpoint: dict, strict: bool = True) -> None:
    """Load a one-process Lightning ``checkpoint`` (``state_dict`` and ``optimizer_states`` of whole tensors)
    into the sharded ``module`` and its ``optimizers``; pops both keys. Each rank reads the whole file (memory
    mapped) and keeps its own shard. A plain optimizer's state is keyed by the position of each parameter in
    its own parameter groups; here it is re-keyed by the parameter's name in ``module``, which is what
    ``set_optimizer_state_dict`` maps to the shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(module, checkpoint.pop("state_dict"), options=options)
    names = {id(p): name for name, p in module.named_parameters()}
    for optimizer, saved in zip(optimizers, checkpoint.pop("optimizer_states", []), strict=True):
        if not saved["state"]:  # no per-parameter state (SGD without momentum): the groups' settings only
            optimizer.load_state_dict(saved)  # (torch's sharded loading needs a state tensor to find the device)
            continue
        params = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        state = {params[index]: value for index, value in saved["state"].items()}
        groups = [{**group, "params": [params[i] for i in group["params"]]} for group in saved["param_groups"]]
        set_optimizer_state_dict(module, optimizer, {"state": state, "param_groups": groups}, options=options)


def mixed_precision_policy(
    device: torch.device, dtype: torch.dtype, param_dtype: str = "auto", reduce_dtype: str = "auto"
):
    """FSDP2's mixed precision for parameters stored in ``dtype`` on ``device``: bf16 compute with fp32
    reduction on GPU by default, none (compute and reduce in ``dtype``) on CPU; None when nothing is cast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute = DTYPES.get(param_dtype) or (torch.bfloat16 if device.type == "cuda" else dtype)
    reduce = DTYPES.get(reduce_dtype) or (torch.float32 if compute.itemsize < dtype.itemsize else dtype)
    if compute == dtype and reduce == dtype:
        return None
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)


def decoder_layers(model: nn.Module, what: str = "model.policy.checkpoint") -> list[nn.Module]:
    """The decoder layers of a Hugging Face model, each an FSDP2 unit.

    Found by the classes the model itself names as never to be split (``_no_split_modules``, set by every
    transformers architecture for device maps), else as the children of a ``ModuleList`` called ``layers``,
    ``h`` or ``blocks``. None found is a config error naming ``what``.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in LAYER_CONTAINERS and len(module):
            return list(module)
    raise ConfigError(
        f"{what}: cannot find the decoder layers of {type(model).__name__} to shard (no module of a class in its "
        f"_no_split_modules, no ModuleList named {', '.join(LAYER_CONTAINERS)}): set _no_split_modules on the "
        "model class to its layer class, or train it without FSDP2 (configs/trainer/cpu.yaml, single_gpu.yaml)"
    )


def shard_module(module: nn.Module, mesh, policy, reshard_after_forward: bool = True, layers: bool = True) -> None:
    """``fully_shard`` each decoder layer of ``module`` (when ``layers``), then ``module`` itself."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if policy is not None:
        kwargs["mp_policy"] = policy
    for layer in decoder_layers(module) if layers else []:
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)


def shard_family(family) -> None:
    """Shard a family's models over the data-parallel mesh of its ModelParallelStrategy: the policy's LM,
    the frozen models (a reference, a teacher: gathered for their forwards, no gradients, no optimizer
    state, never in checkpoints), and each other trained child module (a critic; its transformer's layers
    when it has one)."""
    strategy = family.trainer.strategy
    mesh = family.device_mesh
    if mesh.ndim > 1 and mesh.size(1) > 1:
        raise ConfigError(
            f"trainer.strategy: tensor parallelism ({mesh.size(1)}) is not supported by rlkit's families: set "
            "tensor_parallel_size=1, or use rlkit.spine.sharding.FSDP2Strategy (configs/trainer/fsdp.yaml)"
        )
    dp_mesh = mesh["data_parallel"] if mesh.ndim > 1 else mesh
    reshard = getattr(strategy, "reshard_after_forward", True)
    param_dtype, reduce_dtype = getattr(strategy, "param_dtype", "auto"), getattr(strategy, "reduce_dtype", "auto")
    device = strategy.root_device

    def shard(module: nn.Module, layers: bool = True) -> None:
        dtype = next(module.parameters()).dtype
        shard_module(module, dp_mesh, mixed_precision_policy(device, dtype, param_dtype, reduce_dtype), reshard, layers)

    shard(family.policy.model)
    for frozen in family.spine.frozen.values():
        shard(frozen.model)
    for name, child in family.named_children():
        if name == "policy" or not any(p.requires_grad for p in child.parameters()):
            continue
        for backbone in _outermost_transformers(child):  # a separate critic's transformer: its layers, then it
            shard(backbone)
        shard(child, layers=False)


def _outermost_transformers(module: nn.Module) -> list[nn.Module]:
    """Hugging Face models (they name their ``_no_split_modules``) inside ``module``, not nested in another."""
    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_modules():
        if child is module or not hasattr(child, "_no_split_modules"):
            continue
        if not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, child))
    return [child for _, child in found]


def is_sharded(parameters) -> bool:
    """Whether any of ``parameters`` is a DTensor (sharded by FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in parameters)


def full_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``module``'s state dict under its own names, each sharded tensor gathered whole as it is reached.

    Collective under FSDP2: every rank must consume the whole iterator, in order. Only one tensor is whole
    at a time (the consumer copies it out before asking for the next), so the extra memory of a weight push
    is about the largest tensor, not the whole model.
    """
    for name, tensor in module.state_dict().items():
        yield name, (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()
