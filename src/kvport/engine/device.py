"""The engine's device: where the model, the KV pool and the sampler run.

`EngineConfig.device` is checked for its form by the config ("cpu", "cuda", "cuda:N"); whether
this machine has that device is checked here, once, when an engine core or a runner is built, so
that a missing GPU is one clear error at construction instead of a failure in the first step.
"""

from __future__ import annotations

import torch


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch.device the engine runs on, with its index: "cuda" is the calling thread's
    current CUDA device, fixed here, because the runner may run on another thread (async
    scheduling), whose current device is its own. A ValueError naming the device and the torch
    build when it is CUDA and torch cannot use it (a CPU-only build, no GPU visible, an index
    past the GPUs there are)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {str(dev)!r}")
    if not torch.cuda.is_available():
        build = (f"a CUDA {torch.version.cuda} build" if torch.version.cuda
                 else "a CPU-only build")
        raise ValueError(
            f"device={str(dev)!r} needs CUDA, but torch.cuda.is_available() is False: torch "
            f"{torch.__version__} is {build}"
            + (" and sees no GPU" if torch.version.cuda else "")
            + "; use device='cpu' or install a CUDA build of torch on a machine with a GPU")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"device={str(dev)!r}: torch sees {count} CUDA device(s) "
                         f"(cuda:0..cuda:{count - 1})")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator seeded with `seed` on `device`: torch.multinomial draws with a generator of
    its tensor's device, so the sampler's generators live where the logits are. Draws differ
    between devices (each has its own RNG); greedy rows never draw."""
    return torch.Generator(device=device).manual_seed(seed)
