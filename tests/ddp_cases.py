"""A DDP scenario shared by the CPU and the GPU tests: a layer no rank uses, under ``colltune_hook``.

The model's first layer is skipped from step 3 on, on every rank, so DDP
(``find_unused_parameters=True``) keeps no result for it; what top-k
selected there must go back to the residuals (``colltune.train.hook``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


class Gated(nn.Module):
    """Two layers, the first skipped on steps the caller says: unused then on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(40, 40), nn.Linear(40, 1)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        return self.b(self.a(x) if use_a else x)


def unused_layer_run(rank: int, world_size: int, device: str = "cpu", as_view: bool = False,
                     to_none: bool = True) -> list[float]:
    """Compress from the first step; ``a`` is used in steps 0 to 2 only. Per step, how far ``a.weight``'s
    fed-in gradients (each rank's own, computed apart on the CPU) are from what DDP delivered plus the
    residuals, summed over the ranks in float64. ``device`` ``cuda``: the model on GPU 0 (ranks share it)."""
    from colltune.train import ColltuneHookState, colltune_hook

    if device == "cuda":
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = Gated().to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0] if device == "cuda" else None,
                                              find_unused_parameters=True, gradient_as_bucket_view=as_view)
    state = ColltuneHookState(model=ddp, density=0.05, start_compression_iter=0, min_compress_numel=1,
                              algorithm="allgather")
    ddp.register_comm_hook(state, colltune_hook)
    g = torch.Generator().manual_seed(rank)
    numel = model.a.weight.numel()
    fed, delivered, apart = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64), []
    for step in range(6):
        use = step < 3
        x = torch.randn(8, 40, generator=g)
        alone = Gated()
        alone.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        alone(x, use).sum().backward()
        own = torch.zeros(numel, dtype=torch.float64) if alone.a.weight.grad is None else alone.a.weight.grad.double()
        ddp.zero_grad(set_to_none=to_none)
        ddp(x.to(device), use).sum().backward()
        dist.all_reduce(own := own.reshape(-1))
        fed += own
        if model.a.weight.grad is not None:  # DDP's gradient as the optimizer would apply it
            delivered += model.a.weight.grad.double().cpu().reshape(-1) * world_size
        (residual,) = [st.residual for st in state.topk_states.values()]  # one part: a.weight first
        held = residual[:numel].double().cpu()
        dist.all_reduce(held)
        apart.append(float((fed - delivered - held).abs().max()))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.01 * p.grad
    return apart
