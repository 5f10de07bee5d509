"""Mutants of the engine's device guards (config.py, engine/device.py, engine/runner.py,
model/kernels.py): each removes one guard, and the tests named with it must then fail."""

from __future__ import annotations

from tools.mutation import Mutant

DEVICE = "tests/engine/test_device.py"


MUTANTS: list[Mutant] = [
    Mutant(
        "device-form-checked", "src/kvport/config.py",
        "    if not isinstance(device, str) or DEVICE_PATTERN.fullmatch(device) is None:\n",
        "    if not isinstance(device, str):\n",
        (f"{DEVICE}::test_a_bad_device_is_refused_naming_it",),
        "a device string other than cpu, cuda, cuda:N is refused at the config, naming it"),
    Mutant(
        "cuda-needs-cuda", "src/kvport/engine/device.py",
        "    if not torch.cuda.is_available():\n",
        "    if False:\n",
        (f"{DEVICE}::test_cuda_without_cuda_is_one_clear_error_naming_the_device_and_the_build",),
        "device='cuda' without CUDA is one error naming the device and torch's build"),
    Mutant(
        "runner-device-is-the-weights", "src/kvport/engine/runner.py",
        "        if self.device != weights_on:\n",
        "        if False:\n",
        (f"{DEVICE}::test_a_runner_refuses_a_device_other_than_its_weights",),
        "a runner never builds its pool on another device than the model's weights"),
    Mutant(
        "store-kernel-reads-host-memory-only", "src/kvport/model/kernels.py",
        "            or not _on_cpu(layer_cache, slot_blocks, slot_offsets, k, v)):\n",
        "            or False):\n",
        (f"{DEVICE}::test_the_c_kernels_are_never_handed_device_tensors",),
        "the KV write kernel is never handed a device tensor (torch's path runs off the CPU)"),
    Mutant(
        "decode-kernel-reads-host-memory-only", "src/kvport/model/kernels.py",
        "            or not _on_cpu(q, layer_cache, block_tables, lens)):\n",
        "            or False):\n",
        (f"{DEVICE}::test_the_c_kernels_are_never_handed_device_tensors",),
        "the decode kernel is never handed a device tensor (torch's path runs off the CPU)"),
]
