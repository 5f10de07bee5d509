"""Chained block hashes: deterministic, namespaced, shared exactly by common full blocks."""

from __future__ import annotations

import subprocess
import sys

from kvport.engine.hashing import hash_blocks, namespace_hash

ROOT = namespace_hash("model-a", "float32", 4, "layout")


def hashes(tokens: list[int], root: bytes = ROOT) -> list[bytes]:
    out: list[bytes] = []
    hash_blocks(root, tokens, 4, out)
    return out


def test_two_prompts_share_exactly_their_common_full_blocks() -> None:
    a = hashes(list(range(1, 15)))  # 3 full blocks + 2 tokens
    b = hashes(list(range(1, 10)) + [99, 98, 97, 96])  # equal for 9 tokens: 2 full blocks
    assert len(a) == 3 and len(b) == 3
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_chain_depends_on_every_earlier_token() -> None:
    a = hashes([1, 2, 3, 4, 5, 6, 7, 8])
    b = hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix


def test_incremental_equals_batch() -> None:
    tokens = list(range(50))
    known: list[bytes] = []
    for n in range(1, len(tokens) + 1):
        hash_blocks(ROOT, tokens[:n], 4, known)
    assert known == hashes(tokens)


def test_namespace_separates_models_dtypes_and_block_sizes() -> None:
    tokens = [1, 2, 3, 4]
    roots = [
        ROOT,
        namespace_hash("model-b", "float32", 4, "layout"),
        namespace_hash("model-a", "bfloat16", 4, "layout"),
        namespace_hash("model-a", "float32", 8, "layout"),
        namespace_hash("model-a", "float32", 4, "other-layout"),
    ]
    assert len({hashes(tokens, r)[0] for r in roots}) == len(roots)


def test_deterministic_across_processes() -> None:
    code = (
        "from kvport.engine.hashing import hash_blocks, namespace_hash\n"
        "out = []\n"
        "hash_blocks(namespace_hash('model-a', 'float32', 4, 'layout'), list(range(1, 15)), 4, out)\n"
        "print(','.join(x.hex() for x in out))\n"
    )
    env_seeds = ["0", "12345"]
    results = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
        for seed in env_seeds
    }
    assert results == {",".join(x.hex() for x in hashes(list(range(1, 15))))}
